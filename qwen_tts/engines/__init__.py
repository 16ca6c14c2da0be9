"""Engine implementations and the one factory that builds them from `EngineSettings`.

Each backend is a package or module here (native/, vllm_omni/, fake.py) that implements
`qwen_tts.engine_api.Engine`. Callers import only this factory and the interface, never a backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qwen_tts.engine_api import Engine, EngineSettings, EngineSettingsError
from qwen_tts.fastpath.options import FastPath

# Names a setting may give; `create_engine` says which of them this build lacks.
BACKENDS = ("native", "vllm-omni", "fake")
AVAILABLE_BACKENDS = ("native", "vllm-omni", "fake")  # vllm-omni: where vllm and vllm-omni are installed


def create_engine(
    settings: EngineSettings, fast_path: FastPath | None = None, *, fault_hook: Callable[[], None] | None = None
) -> Engine:
    """The engine `settings.backend` names, not yet started (`xvector_dim`, `languages` and `model_info` are
    already known). Raises EngineSettingsError naming the setting at fault (backend, model_path, device...).
    `fast_path` (benchmarks' A/B runs) replaces the native engine's preset `settings.fast_path`. `fault_hook`
    (fault injection, tests only) runs at each busy turn of the native engine's loop; the other backends have no
    loop of ours and ignore it."""
    if fast_path is not None and settings.backend != "native":
        raise EngineSettingsError("backend", f"a FastPath is the native engine's, not the {settings.backend} backend's")
    if settings.backend == "native":
        from .native import NativeEngine

        return NativeEngine(settings, fast_path=fast_path, fault_hook=fault_hook)
    if settings.backend == "vllm-omni":
        from .vllm_omni import VllmOmniEngine

        try:
            return VllmOmniEngine.from_settings(settings)
        except ImportError as e:
            raise EngineSettingsError("backend", str(e)) from None
    if settings.backend == "fake":
        from .fake import FakeEngine

        return FakeEngine.from_settings(settings)
    raise EngineSettingsError(
        "backend",
        f"backend {settings.backend!r} is not available in this build (available: {', '.join(AVAILABLE_BACKENDS)})",
    )


def release_device_memory(device: torch.device | str | None = None) -> None:
    """Between two engines of one process (the first stopped and collected, the next not built yet): hand back the
    device memory the CUDA libraries keep per stream and the allocator's cached blocks. cuBLAS keeps a workspace for
    every stream a matmul ran on for the life of the process (32 MiB each on Hopper), and a new engine runs on
    streams of its own, so each replaced engine used to leave its workspaces behind. Never while an engine is alive:
    its CUDA graphs use the workspaces they were captured with. `device`: the engine's (its work finishes first; a
    CPU device, or None, waits for the current CUDA device). A no-op where CUDA was never used."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    device = torch.device(device) if device is not None else None
    torch.cuda.synchronize(device if device is not None and device.type == "cuda" else None)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # not public API: used where this torch has it
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


__all__ = ["AVAILABLE_BACKENDS", "BACKENDS", "create_engine", "release_device_memory"]
