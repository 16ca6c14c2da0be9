"""CPU stage workers: vLLM-Omni's worker mixin and model runners over vLLM's CPU worker and runner.

The runners put vLLM-Omni's runner first in the MRO so its Omni behaviour (talker MTP, connectors, payloads)
wins, while vLLM's `CPUModelRunner` below it supplies the CPU versions of device set-up, sync and loading.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin


class _CPURunnerMixin:
    """What every Omni runner needs on the CPU beyond vLLM's `CPUModelRunner`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Omni's runners allocate more host/device buffer pairs after CPUModelRunner aliased its own; alias
        # these too so that "copy to device" is a no-op instead of a second copy in RAM.
        self._postprocess_tensors()

    def load_model(self, *args, **kwargs) -> None:
        # Omni sizes its talker-MTP buffers by max(max_num_reqs, max_cudagraph_capture_size); without CUDA
        # graphs vLLM leaves the latter None.
        if self.compilation_config.max_cudagraph_capture_size is None:
            self.compilation_config.max_cudagraph_capture_size = 0
        super().load_model(*args, **kwargs)

    def capture_model(self) -> int:
        return 0  # no graphs on the CPU

    def _init_device_properties(self) -> None:
        self.num_sms = None

    def _sync_device(self) -> None:
        return None


class CPUARModelRunner(_CPURunnerMixin, GPUARModelRunner, CPUModelRunner):
    pass


class CPUGenerationModelRunner(_CPURunnerMixin, GPUGenerationModelRunner, CPUModelRunner):
    pass


class _CPUOmniWorker(OmniWorkerMixin, CPUWorker):
    model_runner_cls: type

    def init_device(self) -> None:
        self.use_v2_model_runner = False  # vLLM-Omni's hooks live in the v1 runners
        super().init_device()
        self.model_runner = self.model_runner_cls(self.vllm_config, torch.device("cpu"))


class CPUARWorker(_CPUOmniWorker):
    """Autoregressive stage (the talker)."""

    model_runner_cls = CPUARModelRunner


class CPUGenerationWorker(_CPUOmniWorker):
    """Generation stage (Code2Wav)."""

    model_runner_cls = CPUGenerationModelRunner
