"""The one engine interface that the server, the batch CLI and the benchmarks use.

An engine turns (x-vector, text, options) into a stream of float32 PCM chunks at `engine.sample_rate`. Nothing
above this interface knows which implementation (native PyTorch, vLLM-Omni, the fake) runs: callers build one
with `qwen_tts.engines.create_engine(EngineSettings(...))` and use only what is defined here.

    engine = create_engine(EngineSettings(model_path="demo"))
    await engine.start()
    handle = engine.submit(SynthesisRequest(text=..., xvector=...))
    async for chunk in handle:      # np.ndarray float32, mono, engine.sample_rate
        ...
    handle.stats.finish_reason      # eos | budget | cancelled | error
    engine.cancel(handle)           # stops the request's work at the next step
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .audio import SAMPLE_RATE
from .fastpath.options import PRESETS
from .icl import IclReference
from .text_stream import TextStream

FRAME_SAMPLES = 1920  # 12.5 Hz codec frames at SAMPLE_RATE
# Seeds are 0 ... MAX_SEED everywhere: the HTTP schemas' range, the batch manifest's, and what an engine draws for a
# request without one, so a seed a summary or log reports can be sent back over HTTP to replay the request.
MAX_SEED = 2**32 - 1


def draw_seed() -> int:
    """A random seed in 0 ... MAX_SEED, for a request that has none."""
    return secrets.randbelow(MAX_SEED + 1)


class FinishReason(str, Enum):
    EOS = "eos"  # the model emitted end-of-speech
    BUDGET = "budget"  # the frame budget (from text length, capped by max_frames) ran out
    CANCELLED = "cancelled"  # the client or caller cancelled
    ERROR = "error"  # the request failed; others are unaffected


class EngineError(Exception):
    """Base class of errors an engine raises at submission."""


class QueueFullError(EngineError):
    """Admission refused: all slots busy and the wait queue is full."""


class EngineNotReadyError(EngineError):
    """The engine is not started, is draining, or has died."""


class RequestFailedError(EngineError):
    """Raised from a handle's iteration when the request failed inside the engine."""


class EngineSettingsError(EngineError, ValueError):
    """An engine cannot be built from its settings; `setting` names the EngineSettings field at fault, so each
    caller can name its own option (TTS_MODEL_PATH, --model, ...) in front of the message."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting


@dataclass
class EngineSettings:
    """Everything an engine is built from; `qwen_tts.engines.create_engine` takes this and nothing else.

    The defaults here are the project's defaults: the server's settings and the batch CLI's options take theirs
    from this class and map onto it in one function each. The native engine's kernels are one preset name here
    (`fast_path`); their options are `qwen_tts.fastpath.options.FastPath`. Figures: docs/performance.md.
    """

    model_path: str = "demo"  # 'demo' (the tiny random checkpoint), a checkpoint directory, or a hub id in the cache
    backend: str = "native"  # native | vllm-omni | fake (sine tones, for HTTP load tests)
    demo_dir: Path | None = None  # where the demo checkpoint is written (None: a per-user cache directory)
    # Options only the named backend reads (vllm-omni: stage_config, stage_init_timeout, speaker_transport, ...;
    # see qwen_tts/engines/vllm_omni), so the interface carries no backend's internals.
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA (Code2Wav always float32)
    max_slots: int = 16  # requests decoding at once
    max_queue: int = 64  # requests waiting for a slot; beyond that, QueueFullError
    max_frames: int = 2048  # hard cap per request (frames of 80 ms)
    max_text_tokens: int = 1024  # longest accepted text, in tokens (sizes the KV cache)
    first_chunk_frames: int = 3  # small first chunk: the first audio comes fast
    chunk_frames: int = 12  # later chunks: fewer, larger decodes
    # Each chunk after the first at most this many times the one before, up to chunk_frames (the native scheduler's
    # `chunk_schedule`): a stream stays ahead of playback while its chunks grow only if it runs at >= this many
    # times real time.
    chunk_growth: int = 2
    warmup: bool = True  # load, capture and run one request at start, so the first client waits for none of it
    # When the engine is idle, wait this long after the first arrival so a burst shares one batched prefill.
    admission_window_s: float = 0.002
    # Hold new requests while the running ones get a frame (80 ms of audio) less often than every this many ms, so
    # an admission does not slow every stream below real time; 0 admits whenever a slot is free.
    admission_step_budget_ms: float = 0.0
    # Chunks of one request that may wait in or for the decoder before that request's generation pauses.
    decode_lookahead: int = 2
    # Most rows in one Code2Wav call (and its largest graph bucket, so graph memory): at many streams a larger call
    # decodes the same chunks in less GPU time (docs/performance.md); it never exceeds max_slots.
    decode_max_batch: int = 128
    # TF32 in the float32 Code2Wav: cuDNN's convolutions, and the pre-transformer's matmuls in its CUDA graphs; much
    # faster, the audio within a small distance of the exact decode. False: exact streaming (a stream equals the
    # whole decode).
    decoder_tf32: bool = True
    # Code2Wav's final conv stack in float16 (every op accumulating in float32) instead of float32 with TF32: half
    # the bytes, the audio about as close to the exact decode.
    decoder_fp16: bool = True
    # Decode each request's chunks on their own: its waveform is then a function of its codes alone, bit for bit,
    # whatever else runs; costs the batching of Code2Wav (docs/security.md).
    batch_invariant_decode: bool = False
    # Compile the fast path in inductor's deterministic mode: a fresh process (a replica, a restart) gives the same
    # bits for the same request and seed; off, each process times its own reduction configurations.
    fused_deterministic: bool = True
    # default | one-stream (both stack kernels and the few-row heads: fastest for a lone stream, batch invariant
    # among up to four rows only) | eager (no compiled or custom kernel, no CUDA graph: the debugging path).
    fast_path: str = "default"

    def __post_init__(self) -> None:
        lowest = dict.fromkeys(("max_slots", "max_frames", "max_text_tokens", "first_chunk_frames", "chunk_frames"), 1)
        lowest |= {"decode_lookahead": 1, "decode_max_batch": 1, "admission_step_budget_ms": 0, "chunk_growth": 2}
        for name, low in (lowest | {"max_queue": 0}).items():
            if getattr(self, name) < low:
                raise EngineSettingsError(name, f"{name} must be >= {low}, not {getattr(self, name)}")
        if self.fast_path not in PRESETS:
            raise EngineSettingsError("fast_path", f"fast_path must be {', '.join(PRESETS)}, not {self.fast_path!r}")


@dataclass
class SynthesisRequest:
    """One synthesis job. Defaults follow the checkpoints' generation_config.json."""

    text: str
    xvector: torch.Tensor  # (D,) float32; D = talker hidden size
    language: str = "auto"
    non_streaming_text: bool = True  # all text in the prefill (better pacing); False feeds one token per step
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    cp_temperature: float = 0.9
    cp_top_k: int = 50
    cp_top_p: float = 1.0
    greedy: bool = False  # argmax for codebook 0 and the residual codebooks (official do_sample=False)
    seed: int | None = None  # None: a random seed is drawn at submission
    max_frames: int | None = None  # hard cap; the engine also derives a budget from the text length
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Frames of end-of-speech masking at the start (official min_new_tokens=2); benchmarks raise it to fix lengths.
    min_frames: int = 2
    return_codes: bool = False  # keep the generated codes on the handle (tests, parity, debugging)
    text_stream: TextStream | None = None  # text arriving while spoken (streaming-text mode; `text`: what came first)
    icl: IclReference | None = None  # an ICL voice's reference codes and transcript (None: x-vector mode)


@dataclass
class RequestStats:
    request_id: str
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # prefill began
    first_audio_at: float | None = None
    finished_at: float | None = None
    frames: int = 0
    samples: int = 0
    frame_budget: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.submitted_at

    @property
    def time_to_first_audio(self) -> float | None:
        return None if self.first_audio_at is None else self.first_audio_at - self.submitted_at

    @property
    def audio_seconds(self) -> float:
        return self.samples / SAMPLE_RATE

    @property
    def wall_time(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    def as_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "queue_time": self.queue_time,
            "time_to_first_audio": self.time_to_first_audio,
            "wall_time": self.wall_time,
            "frames": self.frames,
            "audio_seconds": self.audio_seconds,
            "frame_budget": self.frame_budget,
            "finish_reason": self.finish_reason.value if self.finish_reason else None,
            "error": self.error,
        }


_DONE = object()


class AudioHandle(ABC):
    """What a consumer of one utterance's audio sees: `request`, `request_id`, `stats`, `finished`, async iteration
    over its float32 chunks (a subclass's `__anext__`) and `collect`. RequestHandle is one request's; the server's
    long-text chain (tts_server/long_text.py) is that of a request split into pieces."""

    def __init__(self, request: SynthesisRequest):
        self.request = request
        self.request_id = request.request_id
        self.stats = RequestStats(request.request_id)
        self._finished = False

    @property
    def finished(self) -> bool:
        return self._finished

    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        return self

    @abstractmethod
    async def __anext__(self) -> np.ndarray:
        """The next chunk; StopAsyncIteration after the last."""

    async def collect(self) -> np.ndarray:
        """Wait for the whole utterance and return it as one float32 array."""
        chunks = [c async for c in self]
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)


class RequestHandle(AudioHandle):
    """Async iterator over a request's audio chunks. Created by `Engine.submit`.

    The engine pushes chunks from its own thread or task with `put_threadsafe`; the consumer iterates in its
    event loop. Iteration ends after the last chunk; a failed request raises RequestFailedError.
    """

    def __init__(self, request: SynthesisRequest, loop: asyncio.AbstractEventLoop | None = None):
        super().__init__(request)
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.codes: list[torch.Tensor] = []  # (t, 16) per decoded chunk when request.return_codes

    def put_threadsafe(self, chunk: np.ndarray) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, chunk)

    def finish_threadsafe(self, reason: FinishReason, error: str | None = None) -> None:
        self.stats.finish_reason = reason
        self.stats.error = error
        self.stats.finished_at = time.monotonic()
        self._loop.call_soon_threadsafe(self._queue.put_nowait, _DONE)

    async def __anext__(self) -> np.ndarray:
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _DONE:
            self._finished = True
            if self.stats.finish_reason is FinishReason.ERROR:
                raise RequestFailedError(self.stats.error or "request failed")
            raise StopAsyncIteration
        return item


class Engine(ABC):
    """Async engine interface (native PyTorch, vLLM-Omni, or the fake).

    `xvector_dim`, `languages`, `model_info`, `device` and `sample_rate` are known from construction on (before
    `start`), so a caller can check its voices and inputs before any weights load.
    """

    @abstractmethod
    async def start(self) -> None:
        """Load, warm up, and begin serving. `ready` is True afterwards."""

    @abstractmethod
    async def stop(self, drain_timeout: float = 0.0) -> None:
        """Stop accepting; let in-flight work finish for up to `drain_timeout` s, cancel the rest."""

    @abstractmethod
    def submit(self, request: SynthesisRequest) -> RequestHandle:
        """Queue a request. Raises QueueFullError, EngineNotReadyError, or ValueError for bad options."""

    @abstractmethod
    def cancel(self, handle: RequestHandle) -> None:
        """Cancel a request; its work stops at the next engine step. Idempotent."""

    @property
    @abstractmethod
    def ready(self) -> bool:
        """Loaded, warmed up, and accepting work."""

    @property
    def restarting_itself(self) -> bool:
        """Not ready because the engine is bringing itself back (a backend that restarts its own pipeline): a
        supervisor above must wait rather than replace it."""
        return False

    @property
    @abstractmethod
    def xvector_dim(self) -> int:
        """Width of the x-vectors this engine's model takes."""

    @property
    @abstractmethod
    def languages(self) -> list[str]:
        """Accepted language names, lower case, including 'auto'."""

    @property
    def sample_rate(self) -> int:
        """Rate of the PCM chunks, in Hz."""
        return SAMPLE_RATE

    @property
    def device(self) -> torch.device:
        """Where the engine wants request x-vectors (a voice cache keeps them there)."""
        return torch.device("cpu")

    @property
    def model_info(self) -> dict[str, Any]:
        """What is served: at least `name` and `xvector_dim`; engines add size, device, dtype, slots, and `path`
        (a file system path: callers that publish the info drop it)."""
        return {"name": type(self).__name__, "xvector_dim": self.xvector_dim}

    @property
    def num_running(self) -> int:
        """Requests being generated now."""
        return 0

    @property
    def num_waiting(self) -> int:
        """Requests accepted and waiting for a slot."""
        return 0

    @property
    def timings(self) -> dict[str, float]:
        """Cumulative busy time by phase (engine specific, e.g. steps, step_s, prefill_s, decode_s); may be empty."""
        return {}
