"""From a validated request body to engine work: limits, admission, submission, waiting with a deadline and a
disconnect watch, and the guaranteed cleanup (cancel the engine work, free the admission slot, record metrics).

A route's body (a `schemas.SynthesisOptions`) goes straight to `engine_request`, the one mapping onto the engine's
`SynthesisRequest`, with the server's defaults filled in. `check_limits`, then `submit` admits and submits it and
hands back a `Job`, which reads its audio from one `ChunkSource` whatever is behind it: one engine request, the pieces of a long
text, or either stretched to another speed. `Job.close()` runs exactly once, in a `finally`, whatever happened
(success, failure, timeout, client gone), so nothing keeps running after the client has left.
"""

from __future__ import annotations

import asyncio
import logging
import time
import unicodedata
from collections.abc import AsyncIterator, Awaitable
from enum import Enum
from typing import Protocol, TypeVar

import numpy as np
import torch
from starlette.types import Receive

from qwen_tts.engine_api import (
    Engine,
    EngineError,
    EngineNotReadyError,
    QueueFullError,
    RequestFailedError,
    RequestHandle,
    RequestStats,
    SynthesisRequest,
)
from qwen_tts.icl import IclReference
from qwen_tts.languages import canonical_language, describe_languages
from qwen_tts.voices import InvalidProfileError, InvalidSpeakerIdError, UnknownSpeakerError

from . import speed
from .errors import ApiError, EngineFailure, InvalidField, NotFound, NotReady, Overloaded, RequestTimeout
from .inline_reference import inline_voice
from .long_text import PieceChain, needs_split, split_text
from .runtime import Runtime, Voice
from .schemas import SynthesisOptions
from .settings import ServerSettings

logger = logging.getLogger("tts_server")

T = TypeVar("T")


class ChunkSource(Protocol):
    """Where a job's audio comes from: float32 chunks at the engine's rate, in order, and a way to stop the work
    behind them. Implemented by `EngineSource` (one engine request), `long_text.PieceChain` (the pieces of a long
    text) and `speed.StretchedSource` (either, time-stretched)."""

    request_id: str
    stats: RequestStats

    @property
    def finished(self) -> bool: ...

    def cancel(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[np.ndarray]: ...

    async def __anext__(self) -> np.ndarray: ...

    async def collect(self) -> np.ndarray: ...


class EngineSource:
    """One engine request as a ChunkSource: the handle's chunks, and `cancel` through its engine."""

    def __init__(self, engine: Engine, handle: RequestHandle):
        self._engine = engine
        self.handle = handle
        self.request_id = handle.request_id
        self.stats = handle.stats

    @property
    def finished(self) -> bool:
        return self.handle.finished

    def cancel(self) -> None:
        self._engine.cancel(self.handle)

    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        return self

    async def __anext__(self) -> np.ndarray:
        return await self.handle.__anext__()

    async def collect(self) -> np.ndarray:
        return await self.handle.collect()


class ClientDisconnected(Exception):
    """The client closed the connection; its work has been cancelled."""


class Outcome(str, Enum):
    """How a job ended, as counted by `tts_syntheses_total{outcome=...}`."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    DISCONNECTED = "disconnected"
    STREAMING = "streaming"  # the response is sending; becomes OK, or DISCONNECTED if it never finishes
    CANCELLED = "cancelled"  # the client asked to stop it (a WebSocket barge-in)


def check_limits(runtime: Runtime, body: SynthesisOptions, text_field: str = "text") -> None:
    """Apply the limits that are settings. Raises InvalidField."""
    s = runtime.settings
    if not body.text.strip():
        raise InvalidField(f"{text_field}: must contain non-whitespace text", param=text_field)
    if not has_visible_text(body.text):
        # Zero-width spaces, BOMs, control characters: nothing to say, only a budget of noise to generate.
        raise InvalidField(
            f"{text_field}: contains no visible characters (only whitespace, control or format characters)",
            param=text_field,
        )
    if len(body.text) > s.max_text_chars:
        raise InvalidField(
            f"{text_field}: {len(body.text)} characters, the limit is {s.max_text_chars}",
            param=text_field,
            code="text_too_long",
        )
    check_options(runtime, body)


def has_visible_text(text: str) -> bool:
    """Whether `text` has a letter, digit, punctuation mark or symbol: something to say."""
    return any(unicodedata.category(c)[0] in "LNPS" for c in text)


def check_options(runtime: Runtime, body: SynthesisOptions) -> None:
    """The limits on a body's options (frame caps, speed, language), its text apart. Raises InvalidField."""
    s = runtime.settings
    if body.max_new_tokens is not None and body.max_new_tokens > s.max_new_tokens:
        raise InvalidField(
            f"max_new_tokens: {body.max_new_tokens} is above the server's limit of {s.max_new_tokens}",
            param="max_new_tokens",
        )
    if body.min_new_tokens is not None:
        cap = s.max_new_tokens if body.max_new_tokens is None else body.max_new_tokens
        if body.min_new_tokens > cap:
            raise InvalidField(
                f"min_new_tokens: {body.min_new_tokens} is above max_new_tokens ({cap})", param="min_new_tokens"
            )
    if not speed.is_identity(body.speed) and not speed.available():
        raise InvalidField(
            "speed: only 1.0 on this server (time-stretching needs the optional 'speed' extra: pip install .[speed])",
            param="speed",
        )
    accepted = runtime.engine.languages
    if canonical_language(body.language) not in accepted:
        raise InvalidField(
            f"language: {body.language!r} is not supported (one of: {describe_languages(accepted)}; a name in any "
            "case or its ISO 639-1 code)",
            param="language",
            code="unsupported_language",
        )


def engine_request(
    settings: ServerSettings,
    body: SynthesisOptions,
    xvector: torch.Tensor,
    request_id: str,
    icl: IclReference | None = None,
) -> SynthesisRequest:
    """The engine request for a checked body: normalised text and language, the server's sampling defaults, and the
    voice's ICL reference when it is served in ICL mode (`choose_reference`)."""
    temperature = settings.temperature if body.temperature is None else body.temperature
    request = SynthesisRequest(
        text=body.text.strip(),
        xvector=xvector,
        icl=icl,
        language=canonical_language(body.language),
        temperature=temperature,
        top_k=settings.top_k if body.top_k is None else body.top_k,
        greedy=temperature == 0.0,
        seed=body.seed,
        max_frames=settings.max_new_tokens if body.max_new_tokens is None else body.max_new_tokens,
        request_id=request_id,
    )
    if body.min_new_tokens is not None:
        request.min_frames = body.min_new_tokens
    return request


def voice_mode_of(request: SynthesisRequest) -> str:
    """How a request's voice is cloned, as the X-Voice-Mode header and the stats name it."""
    return "icl" if request.icl is not None else "xvector"


def choose_reference(
    mode: str, icl: IclReference | None, speaker_id: str, speaker_field: str = "speaker_id"
) -> IclReference | None:
    """The reference a request is served with: the voice's ICL data unless `voice_mode` is 'xvector'; 'icl' for a
    voice without ICL data is an InvalidField naming `voice_mode`."""
    if mode == "xvector":
        return None
    if mode == "icl" and icl is None:
        raise InvalidField(
            f"voice_mode: 'icl' needs a voice with ICL data, and {speaker_field} {speaker_id!r} has none (enrol it "
            "with its transcript: ref_text); use 'auto' or 'xvector'",
            param="voice_mode",
            code="voice_without_icl",
        )
    return icl


class Job:
    """One admitted engine request and its cleanup."""

    def __init__(self, runtime: Runtime, source: ChunkSource, request_id: str, voice_mode: str = "xvector"):
        self.runtime = runtime
        self.source = source
        self.request_id = request_id
        self.voice_mode = voice_mode
        self.received_at = time.monotonic()
        self.outcome = Outcome.ERROR  # overwritten on success, timeout or disconnect
        self._closed = False

    @property
    def deadline(self) -> float:
        return self.source.stats.submitted_at + self.runtime.settings.request_timeout

    def close(self) -> None:
        """Cancel leftover engine work, free the admission slot, record metrics. Idempotent."""
        if self._closed:
            return
        self._closed = True
        rt, stats = self.runtime, self.source.stats
        if not self.source.finished:
            self.source.cancel()
        rt.admission.release()
        m = rt.metrics
        m.syntheses.labels(self.outcome.value).inc()
        if self.outcome is Outcome.DISCONNECTED:
            m.disconnects.inc()
        if stats.queue_time is not None:
            m.queue_time.observe(stats.queue_time)
        if stats.time_to_first_audio is not None:
            m.ttfa.observe(stats.time_to_first_audio)
        m.audio_seconds.inc(stats.audio_seconds)
        if self.outcome is Outcome.OK and stats.audio_seconds > 0:
            wall = time.monotonic() - stats.submitted_at
            m.rtf.observe(wall / stats.audio_seconds)
        if self.outcome is not Outcome.OK:  # the one log line of a request that did not end well
            level = {Outcome.ERROR: logging.ERROR, Outcome.TIMEOUT: logging.WARNING}.get(self.outcome, logging.INFO)
            logger.log(
                level,
                "request %s ended: %s (%s, voice_mode %s)",
                self.request_id,
                self.outcome.value,
                stats.as_dict(),
                self.voice_mode,
            )


async def submit(runtime: Runtime, body: SynthesisOptions, request_id: str, speaker_field: str = "speaker_id") -> Job:
    """Admit and submit a checked body; every refusal is an ApiError with the right status, naming
    `speaker_field` (the route's name for the voice: `voice` on /v1/audio/speech). A body with an inline reference
    has it enrolled first (tts_server/inline_reference.py), in place of the stored voice."""
    request = prepare(runtime, body, request_id, speaker_field, await inline_voice(runtime, body))
    admit(runtime)
    return start_job(runtime, request, body.speed)


def _retry(runtime: Runtime) -> dict[str, str]:
    return {"Retry-After": str(runtime.settings.retry_after)}


def prepare(
    runtime: Runtime,
    body: SynthesisOptions,
    request_id: str,
    speaker_field: str = "speaker_id",
    voice: Voice | None = None,
) -> SynthesisRequest:
    """The engine request for a checked body, once the server is ready and the voice is known (NotReady, InvalidField
    or NotFound naming `speaker_field` otherwise); `voice` (an inline reference's) instead of the stored one."""
    if not runtime.ready:
        reason = "draining for shutdown" if runtime.draining else "not ready"
        raise _refused(runtime, "not_ready", NotReady(f"server is {reason}; retry later", headers=_retry(runtime)))
    if voice is not None:
        xvector, icl = voice
        icl = choose_reference(body.voice_mode, icl, body.speaker_id, speaker_field)
        return engine_request(runtime.settings, body, xvector, request_id, icl)
    try:
        xvector, icl = runtime.voices.voice(body.speaker_id)
    except InvalidSpeakerIdError as e:
        raise InvalidField(f"{speaker_field}: {e}", param=speaker_field, code="invalid_speaker_id") from None
    except UnknownSpeakerError:
        raise NotFound(
            f"unknown speaker {body.speaker_id!r} (GET /speakers lists the voices)",
            param=speaker_field,
            code="unknown_speaker",
        ) from None
    except InvalidProfileError:
        raise NotFound(
            f"speaker {body.speaker_id!r} has an unusable profile file (the server log says why)",
            param=speaker_field,
            code="invalid_profile",
        ) from None
    icl = choose_reference(body.voice_mode, icl, body.speaker_id, speaker_field)
    return engine_request(runtime.settings, body, xvector, request_id, icl)


def admit(runtime: Runtime) -> None:
    """Take an admission slot (Overloaded, 429 with Retry-After, when none is free). The caller owns it until a
    `start_job` hands it to a Job, or gives it back with `runtime.admission.release()`."""
    if not runtime.admission.try_acquire():
        limit = runtime.admission.limit
        error = Overloaded(
            f"server is at capacity ({limit} requests in progress); retry later", headers=_retry(runtime)
        )
        raise _refused(runtime, "queue_full", error)


def start_job(runtime: Runtime, request: SynthesisRequest, speed_factor: float = 1.0) -> Job:
    """Submit an admitted request; its admission slot passes to the Job (or is given back if the engine refuses).
    A request with a `text_stream` is one engine request whatever its length (its text is not all there to split)."""
    try:
        source = _submit_to_engine(runtime.engine, request)
        if not speed.is_identity(speed_factor):
            source = speed.StretchedSource(source, runtime.engine.sample_rate, speed_factor)
    except BaseException as e:
        runtime.admission.release()  # the one release before a Job owns the slot
        error = engine_refusal(runtime, e)
        if error is not None:
            raise error from None
        raise
    mode = voice_mode_of(request)
    runtime.metrics.voice_modes.labels(mode).inc()
    return Job(runtime, source, request.request_id, mode)


# The request fields an engine's refusal may start with (its message then names the field for the client).
_ENGINE_FIELDS = ("text", "voice_mode")


def engine_refusal(runtime: Runtime, e: BaseException) -> ApiError | None:
    """The error for an engine's refusal of a request: at its submission, or (an engine in another process,
    remote_engine.py) at its first chunk. None for anything else."""
    if isinstance(e, QueueFullError):
        return _refused(
            runtime, "queue_full", Overloaded("server is at capacity; retry later", headers=_retry(runtime))
        )
    if isinstance(e, EngineNotReadyError):
        error = NotReady("engine is not accepting requests; retry later", headers=_retry(runtime))
        return _refused(runtime, "not_ready", error)
    if isinstance(e, ValueError):  # options the engine refuses (e.g. text longer than its token limit)
        message = str(e)
        return InvalidField(message, param=next((f for f in _ENGINE_FIELDS if message.startswith(f)), None))
    return None


def _submit_to_engine(engine: Engine, request: SynthesisRequest) -> ChunkSource:
    """One engine request, or a `PieceChain` when the text is longer than one comfortable piece."""
    if request.text_stream is None and needs_split(request.text):
        pieces = split_text(request.text, request.language)
        if len(pieces) > 1:
            return PieceChain(engine, request, pieces)
    return EngineSource(engine, engine.submit(request))


def _refused(runtime: Runtime, reason: str, error: ApiError) -> ApiError:
    """Count a refusal by reason (tts_rejections_total) and hand back the error to raise."""
    runtime.metrics.rejections.labels(reason).inc()
    return error


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def guarded(job: Job, receive: Receive, awaitable: Awaitable[T]) -> T:
    """Await `awaitable` until the job's deadline, watching for the client to leave.

    Raises RequestTimeout or ClientDisconnected (setting job.outcome); the caller's finally closes the job.
    """
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        remaining = max(0.0, job.deadline - time.monotonic())
        done, _ = await asyncio.wait({work, watch}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        if watch in done:
            job.outcome = Outcome.DISCONNECTED
            raise ClientDisconnected()
        job.outcome = Outcome.TIMEOUT
        raise RequestTimeout(
            f"request took longer than the limit of {job.runtime.settings.request_timeout:g} s and was cancelled",
            code="request_timeout",
        )
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


async def _engine_result(job: Job, receive: Receive, awaitable: Awaitable[T]) -> T:
    """`guarded`, with a failed synthesis as EngineFailure (500 with the request id) and a refusal by an engine in
    another process as the error `engine_refusal` gives."""
    try:
        return await guarded(job, receive, awaitable)
    except RequestFailedError:  # Job.close logs it, with the engine's error
        raise EngineFailure(f"synthesis failed (request id {job.request_id})") from None
    except (EngineError, ValueError) as e:  # refused by an engine in another process
        raise engine_refusal(job.runtime, e) or EngineFailure(
            f"synthesis failed (request id {job.request_id})"
        ) from None


async def collect(job: Job, receive: Receive) -> np.ndarray:
    """The whole utterance; failures become EngineFailure (500 with the request id)."""
    pcm = await _engine_result(job, receive, job.source.collect())
    job.outcome = Outcome.OK
    return pcm


async def first_chunk(job: Job, receive: Receive) -> np.ndarray | None:
    """The first audio chunk (None if the utterance is empty); sent before the response headers so that
    early failures still get a proper status code."""
    return await _engine_result(job, receive, _next_or_none(job.source))


async def _next_or_none(source: ChunkSource) -> np.ndarray | None:
    try:
        return await source.__anext__()
    except StopAsyncIteration:
        return None


async def rest(job: Job) -> AsyncIterator[np.ndarray]:
    """The chunks after the first, each awaited against the deadline. Raises RequestTimeout or
    RequestFailedError; disconnects arrive as cancellation from the response."""
    while True:
        remaining = job.deadline - time.monotonic()
        if remaining <= 0:
            job.outcome = Outcome.TIMEOUT
            raise RequestTimeout("request timed out")
        try:
            chunk = await asyncio.wait_for(_next_or_none(job.source), timeout=remaining)
        except asyncio.TimeoutError:
            job.outcome = Outcome.TIMEOUT
            raise RequestTimeout("request timed out") from None
        if chunk is None:
            return
        yield chunk
