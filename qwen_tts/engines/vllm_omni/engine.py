"""`Engine` over vLLM-Omni's AsyncOmni (Talker -> SharedMemoryConnector -> Code2Wav).

Each request becomes one Base request, x-vector-only or, for a request with an ICL reference, vLLM-Omni's in-context
form with the reference codes precomputed (requests.py): the speaker vector is validated here (a bad one would kill
the talker's engine core), the prompt placeholder length comes from vLLM-Omni's own estimator, our sampling options
become stage 0's SamplingParams, and the cumulative waveform vLLM-Omni streams is cut into new-tail chunks.
Cancelling aborts the request in the pipeline. A health watch turns a dead stage into not-ready (the server
answers 503) and, unless disabled, restarts the pipeline.

Streamed text (a request with a `text_stream`): a running vLLM-Omni request cannot wait for text, so the stream is
spoken sentence by sentence, each complete sentence a request of its own, their audio in order through the one
handle (sentences.py says what that changes).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import time
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch

from qwen_tts.engine_api import (
    EngineNotReadyError,
    EngineSettings,
    EngineSettingsError,
    FinishReason,
    QueueFullError,
    RequestHandle,
    SynthesisRequest,
    draw_seed,
)
from qwen_tts.engines.checkpoint import CheckpointEngine, FiniteCheck
from qwen_tts.model.config import ConfigError, ModelConfig
from qwen_tts.model.model_paths import DEMO, ModelPathError, resolve_model_path
from qwen_tts.model.prompt import normalize_language
from qwen_tts.model.tokenizer import TextTokenizer

from .requests import (
    AudioTail,
    SpeakerTransport,
    additional_information,
    finish_reason,
    stage0_finish_reason,
    stage0_sampling,
    validate_xvector,
)
from .sentences import serve_text_stream

log = logging.getLogger("qwen_tts.engines.vllm_omni")

# Same budget rule as the native engine: generous for normal speech, never unbounded.
BUDGET_BASE_FRAMES = 25
BUDGET_FRAMES_PER_TOKEN = 8
DEFAULT_STAGE_CONFIG = "stage_config_optimized.yaml"
FAST_PATH_PLUGIN = "myfi_qwen3_tts"  # vllm-omni-myfi's talker (group vllm_omni.general_plugins)


@dataclass
class VllmOmniConfig:
    model_path: str
    stage_config: str = DEFAULT_STAGE_CONFIG  # vLLM-Omni deploy config (its `deploy_config`)
    stage_init_timeout: float = 600.0  # seconds each stage may take to start
    max_slots: int = 16  # requests in the pipeline at once (keep <= stage 0's max_num_seqs)
    max_queue: int = 64  # requests waiting for a slot; beyond that, QueueFullError
    max_frames: int = 2048  # hard cap per request (frames of 80 ms)
    max_text_tokens: int = 1024
    # auto: the tensor fast path when vllm-omni-myfi's talker is installed, else the float list stock vLLM-Omni takes
    speaker_transport: str = "auto"
    warmup: bool = True
    auto_restart: bool = True  # restart the pipeline when a stage dies
    health_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.speaker_transport not in ("auto", "tensor", "list"):
            raise ValueError(f"speaker_transport must be auto, tensor or list, got {self.speaker_transport!r}")
        if self.max_slots < 1 or self.max_queue < 0 or self.max_frames < 1:
            raise ValueError("max_slots >= 1, max_queue >= 0 and max_frames >= 1 are required")


# VllmOmniConfig's fields that EngineSettings.backend_options carries (the server's TTS_STAGE_CONFIG,
# TTS_STAGE_INIT_TIMEOUT and TTS_VLLM_SPEAKER_TRANSPORT; the batch CLI's --stage-configs-path).
BACKEND_OPTIONS = ("stage_config", "stage_init_timeout", "speaker_transport", "auto_restart", "health_interval_s")


def fast_path_installed() -> bool:
    return any(e.name == FAST_PATH_PLUGIN for e in entry_points(group="vllm_omni.general_plugins"))


class VllmOmniEngine(CheckpointEngine):
    @classmethod
    def from_settings(cls, settings: EngineSettings) -> VllmOmniEngine:
        """From the one engine-settings type; the model path is resolved as for the native engine ('demo' too).
        This backend's own options come from `settings.backend_options` (BACKEND_OPTIONS: VllmOmniConfig's fields
        that the common settings do not carry)."""
        try:
            model_dir = resolve_model_path(settings.model_path, demo_dir=settings.demo_dir)
        except (ModelPathError, OSError) as e:
            raise EngineSettingsError("model_path", str(e)) from None
        options = dict(settings.backend_options)
        if unknown := sorted(set(options) - set(BACKEND_OPTIONS)):
            raise EngineSettingsError(
                "backend_options", f"unknown vllm-omni option(s) {unknown}; known: {', '.join(BACKEND_OPTIONS)}"
            )
        options["stage_config"] = str(options.get("stage_config") or DEFAULT_STAGE_CONFIG)
        try:
            config = VllmOmniConfig(
                model_path=str(model_dir),
                max_slots=settings.max_slots,
                max_queue=settings.max_queue,
                max_frames=settings.max_frames,
                max_text_tokens=settings.max_text_tokens,
                warmup=settings.warmup,
                **options,
            )
        except ValueError as e:
            raise EngineSettingsError("backend_options.speaker_transport", str(e)) from None
        engine = cls(config)
        engine._model_info["name"] = DEMO if settings.model_path == DEMO else model_dir.name
        return engine

    def __init__(self, config: VllmOmniConfig):
        if importlib.util.find_spec("vllm_omni") is None or importlib.util.find_spec("vllm") is None:
            raise ImportError(
                "vllm and vllm-omni are not installed in this environment "
                "(CPU: scripts/setup_vllm_omni.sh; GPU: pip install '.[vllm]' ./vllm-omni-myfi)"
            )
        self.config = config
        self._finite = FiniteCheck()  # x-vectors found finite (submit)
        # config.json and the tokenizer are read here, so width, languages and model info are known before start().
        path = Path(config.model_path)
        try:
            self._cfg = ModelConfig.from_pretrained(path)
            self._tokenizer = TextTokenizer.from_pretrained(path)
        except (ConfigError, OSError) as e:
            raise EngineSettingsError("model_path", str(e)) from None
        self._model_info: dict[str, Any] = {
            "name": path.name,
            "path": str(path),
            "size": self._cfg.tts_model_size,
            "xvector_dim": self._cfg.xvector_dim,
            "backend": "vllm-omni",
            "max_slots": config.max_slots,
            "stage_config": str(config.stage_config),
        }
        self._omni: Any = None
        self._estimate: Any = None
        self._sampling_params_cls: Any = None
        self._stage1_params: Any = None
        self._transport: SpeakerTransport = "tensor"
        self._slots = asyncio.Semaphore(config.max_slots)
        self._tasks: dict[str, asyncio.Task] = {}
        self._running: set[str] = set()
        self._accepting = False
        self._ready = False
        self._dead: str | None = None
        self._watch_task: asyncio.Task | None = None
        self._restart_task: asyncio.Task | None = None
        self.restarts = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.config.speaker_transport == "auto":
            self._transport = "tensor" if fast_path_installed() else "list"
        else:
            self._transport = self.config.speaker_transport  # type: ignore[assignment]
        if self._transport == "tensor" and not fast_path_installed():
            raise RuntimeError("speaker_transport=tensor needs the vllm-omni-myfi plugin package installed")
        stage_config = Path(self.config.stage_config)
        if not stage_config.is_file():
            raise FileNotFoundError(f"vLLM-Omni stage config {stage_config}: not found")
        from vllm import SamplingParams
        from vllm_omni.model_executor.models.qwen3_tts.prompt_embeds_builder import Qwen3TTSPromptEmbedsBuilder

        self._sampling_params_cls = SamplingParams
        self._estimate = Qwen3TTSPromptEmbedsBuilder.estimate_prompt_len_from_additional_information
        await self._start_pipeline()
        self._accepting = True
        if self.config.warmup:
            await self._warmup()
        self._ready = True
        self._watch_task = asyncio.create_task(self._watch(), name="vllm-omni-health")

    async def _start_pipeline(self) -> None:
        from vllm_omni.entrypoints.async_omni import AsyncOmni

        t0 = time.monotonic()
        kwargs = dict(
            model=str(self.config.model_path),
            deploy_config=str(self.config.stage_config),
            stage_init_timeout=int(self.config.stage_init_timeout),
            init_timeout=int(self.config.stage_init_timeout) * 2,
        )
        self._omni = await asyncio.to_thread(lambda: AsyncOmni(**kwargs))
        self._stage1_params = self._omni.default_sampling_params_list[-1]
        dtype = "?"
        with contextlib.suppress(Exception):
            dtype = str(self._omni.engine.stage_vllm_configs[0].model_config.dtype).removeprefix("torch.")
        from vllm.platforms import current_platform

        self._model_info.update(
            device=current_platform.device_type,
            dtype=dtype,
            speaker_transport=self._transport,
            startup_s=round(time.monotonic() - t0, 1),
        )
        log.debug("vLLM-Omni pipeline started: %s", self.model_info)  # model_info in full: for debugging

    async def _warmup(self) -> None:
        x = torch.zeros(self.xvector_dim)
        handle = self.submit(SynthesisRequest(text="Warm up.", xvector=x, greedy=True, max_frames=4))
        await handle.collect()

    async def stop(self, drain_timeout: float = 0.0) -> None:
        self._accepting = False
        if self._watch_task is not None:
            self._watch_task.cancel()
            self._watch_task = None
        if self._restart_task is not None:
            self._restart_task.cancel()
            self._restart_task = None
        tasks = list(self._tasks.values())
        if tasks and drain_timeout > 0:
            await asyncio.wait(tasks, timeout=drain_timeout)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._ready = False
        await self._shutdown_pipeline()

    async def _shutdown_pipeline(self) -> None:
        omni, self._omni = self._omni, None
        if omni is not None:
            try:
                await asyncio.to_thread(omni.shutdown)
            except Exception:  # a pipeline whose stage died may fail to shut down cleanly
                log.warning("vLLM-Omni shutdown raised", exc_info=True)

    # ------------------------------------------------------------------ health
    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            if self._dead is not None or self._omni is None:
                continue
            try:
                await self._omni.check_health()
            except Exception as e:
                self._mark_dead(f"vLLM-Omni pipeline died: {e}")

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        log.error("%s", reason)
        for task in list(self._tasks.values()):
            task.cancel()
        if self.config.auto_restart and self._accepting:
            self._restart_task = asyncio.create_task(self._restart(), name="vllm-omni-restart")

    async def _restart(self) -> None:
        while self._accepting:
            await self._shutdown_pipeline()
            try:
                await self._start_pipeline()
                self._dead = None
                if self.config.warmup:
                    await self._warmup()
                self.restarts += 1
                log.info("vLLM-Omni pipeline restarted (%d restarts)", self.restarts)
                return
            except Exception as e:
                self._dead = f"vLLM-Omni pipeline restart failed: {e}"
                log.exception("vLLM-Omni restart failed; retrying")
                await asyncio.sleep(5.0)

    # ------------------------------------------------------------------ interface
    @property
    def restarting_itself(self) -> bool:
        return self._restart_task is not None and not self._restart_task.done()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # speaker vectors are sent from host memory

    @property
    def ready(self) -> bool:
        return self._ready and self._dead is None and self._omni is not None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._tasks) - len(self._running)

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        if not self._accepting or self._dead is not None or self._omni is None:
            raise EngineNotReadyError(self._dead or "engine is not accepting requests")
        language = normalize_language(self._cfg, request.language)
        xvector = validate_xvector(request.xvector, self.xvector_dim, self._finite)
        if request.text_stream is not None:
            return self._submit_stream(request, language)
        if not request.text.strip():
            raise ValueError("text is empty")
        text_ids = self._tokenizer.text_ids(request.text)
        if len(text_ids) > self.config.max_text_tokens:
            raise ValueError(f"text is {len(text_ids)} tokens, the limit is {self.config.max_text_tokens}")
        if len(self._tasks) >= self.config.max_slots + self.config.max_queue:
            raise QueueFullError(f"{self.num_waiting} requests waiting (limit {self.config.max_queue})")
        if request.seed is None and not request.greedy:  # as the native engine: every sampled request has a seed
            request.seed = draw_seed()
        handle = RequestHandle(request)
        cap = self.config.max_frames if request.max_frames is None else min(request.max_frames, self.config.max_frames)
        budget = max(1, min(cap, BUDGET_BASE_FRAMES + BUDGET_FRAMES_PER_TOKEN * len(text_ids)))
        handle.stats.frame_budget = budget
        info = additional_information(request, xvector, language, self._transport)
        prompt_len = self._estimate(
            info,
            task_type="Base",
            tokenize_prompt=self._tokenizer.encode,
            codec_language_id=self._cfg.talker.codec_language_id,
            spk_is_dialect=None,
        )
        # The talker builds its prompt from `info`; the ids only give the length. vLLM's repetition penalty also
        # counts prompt ids, so they are the codec pad id, which codebook 0 never samples: the penalty then acts
        # on generated codes only, as in the official package.
        placeholder = int(self._cfg.talker.codec_pad_id)
        prompt = {"prompt_token_ids": [placeholder] * int(prompt_len), "additional_information": info}
        task = asyncio.get_running_loop().create_task(self._serve(handle, prompt), name=f"tts-{handle.request_id}")
        self._tasks[handle.request_id] = task
        return handle

    def _submit_stream(self, request: SynthesisRequest, language: str) -> RequestHandle:
        """A request with a text_stream: one task that submits its sentences as they complete (sentences.py)."""
        stream = request.text_stream
        if request.non_streaming_text:
            raise ValueError("a text_stream needs non_streaming_text=False (the talker reads one token per frame)")
        if not stream.snapshot().text.startswith(request.text):
            raise ValueError("text must be what the text_stream held when the request was submitted")
        if len(self._tasks) >= self.config.max_slots + self.config.max_queue:
            raise QueueFullError(f"{self.num_waiting} requests waiting (limit {self.config.max_queue})")
        if request.seed is None and not request.greedy:
            request.seed = draw_seed()
        handle = RequestHandle(request)
        rid = handle.request_id
        task = asyncio.get_running_loop().create_task(
            serve_text_stream(handle, stream, language, self.submit, self.cancel), name=f"tts-stream-{rid}"
        )
        self._tasks[rid] = task
        task.add_done_callback(lambda _: self._tasks.pop(rid, None))
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        task = self._tasks.get(handle.request_id)
        if task is not None and not task.done():
            handle._cancel_requested = True
            task.cancel()

    # ------------------------------------------------------------------ one request
    async def _serve(self, handle: RequestHandle, prompt: dict) -> None:
        rid = handle.request_id
        stats = handle.stats
        request = handle.request
        in_pipeline = False
        reason, error = FinishReason.ERROR, None
        try:
            async with self._slots:
                stats.started_at = time.monotonic()
                self._running.add(rid)
                sampling = stage0_sampling(request, stats.frame_budget)
                params = [self._sampling_params_cls(**sampling.kwargs()), self._stage1_params]
                tail = AudioTail(stats.frame_budget)
                stage0_reason = None
                in_pipeline = True
                async for out in self._omni.generate(prompt, request_id=rid, sampling_params_list=params):
                    chunk = tail.new((out.multimodal_output or {}).get("audio"))
                    if chunk.size:
                        if stats.first_audio_at is None:
                            stats.first_audio_at = time.monotonic()
                        stats.samples += chunk.size
                        stats.frames = tail.frames
                        handle.put_threadsafe(chunk)
                    if out.finished:
                        # per-stage timings (benchmarks: which stage limits throughput)
                        handle.stage_metrics = (getattr(out, "metrics", None) or {}).get("stage_metrics")
                        stage0_reason = stage0_finish_reason(handle.stage_metrics, sampling.max_tokens)
                        in_pipeline = False
                        break
                    if tail.sent >= tail.limit:  # budget reached: what follows is not ours to send
                        break
                reason = finish_reason(stage0_reason, tail.frames, stats.frame_budget)
        except asyncio.CancelledError:
            reason = FinishReason.ERROR if self._dead else FinishReason.CANCELLED
            error = self._dead
        except Exception as e:  # the pipeline failed this request; the health watch decides if it is dead
            error = f"{type(e).__name__}: {e}"
            log.warning("request %s failed in vLLM-Omni: %s", rid, error)
        finally:
            if in_pipeline and self._omni is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._omni.abort(rid))
            self._running.discard(rid)
            self._tasks.pop(rid, None)
            if stats.started_at is None:
                stats.started_at = time.monotonic()
            handle.finish_threadsafe(reason, error)
