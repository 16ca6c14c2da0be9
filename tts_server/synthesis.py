"""From a validated request to engine work: admission, submission, waiting with a deadline and a disconnect
watch, and the guaranteed cleanup (cancel the engine request, free the admission slot, record metrics).

Every engine request is owned by a `Job`; `Job.close()` runs exactly once, in a `finally`, whatever happened
(success, failure, timeout, client gone), so nothing keeps running after the client has left.
"""

from __future__ import annotations

import asyncio
import logging
import time
import unicodedata
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from starlette.types import Receive

from embedding_cache import InvalidProfileError, InvalidSpeakerIdError, UnknownSpeakerError
from qwen_tts.engine_api import (
    EngineNotReadyError,
    QueueFullError,
    RequestFailedError,
    RequestHandle,
    SynthesisRequest,
)

from .errors import EngineFailure, InvalidField, NotFound, NotReady, Overloaded, RequestTimeout
from .runtime import Runtime

logger = logging.getLogger("tts_server")

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection; its work has been cancelled."""


@dataclass
class Options:
    """What every synthesis route asks of the engine, already validated against the settings."""

    speaker_id: str
    text: str
    language: str
    max_new_tokens: int | None
    min_new_tokens: int | None
    temperature: float | None
    top_k: int | None
    seed: int | None


def check_limits(runtime: Runtime, opts: Options, text_field: str = "text") -> Options:
    """Apply the limits that are settings; normalise text and language. Raises InvalidField."""
    s = runtime.settings
    text = opts.text.strip()
    if not text:
        raise InvalidField(f"{text_field}: must contain non-whitespace text", param=text_field)
    if not any(unicodedata.category(c)[0] in "LNPS" for c in text):
        # Zero-width spaces, BOMs, control characters: nothing to say, only a budget of noise to generate.
        raise InvalidField(
            f"{text_field}: contains no visible characters (only whitespace, control or format characters)",
            param=text_field,
        )
    if len(opts.text) > s.max_text_chars:
        raise InvalidField(
            f"{text_field}: {len(opts.text)} characters, the limit is {s.max_text_chars}",
            param=text_field,
            code="text_too_long",
        )
    if opts.max_new_tokens is not None and opts.max_new_tokens > s.max_new_tokens:
        raise InvalidField(
            f"max_new_tokens: {opts.max_new_tokens} is above the server's limit of {s.max_new_tokens}",
            param="max_new_tokens",
        )
    if opts.min_new_tokens is not None:
        cap = s.max_new_tokens if opts.max_new_tokens is None else opts.max_new_tokens
        if opts.min_new_tokens > cap:
            raise InvalidField(
                f"min_new_tokens: {opts.min_new_tokens} is above max_new_tokens ({cap})", param="min_new_tokens"
            )
    language = opts.language.strip().lower()
    accepted = runtime.engine.languages
    if language not in accepted:
        raise InvalidField(
            f"language: {opts.language!r} is not supported (one of: {', '.join(_title(accepted))})",
            param="language",
            code="unsupported_language",
        )
    opts.text, opts.language = text, language
    return opts


def _title(names: list[str]) -> list[str]:
    return [n.capitalize() for n in names]


class Job:
    """One admitted engine request and its cleanup."""

    def __init__(self, runtime: Runtime, handle: RequestHandle, request_id: str):
        self.runtime = runtime
        self.handle = handle
        self.request_id = request_id
        self.received_at = time.monotonic()
        self.outcome = "error"  # overwritten on success, timeout or disconnect
        self._closed = False

    @property
    def deadline(self) -> float:
        return self.handle.stats.submitted_at + self.runtime.settings.request_timeout

    def close(self) -> None:
        """Cancel leftover engine work, free the admission slot, record metrics. Idempotent."""
        if self._closed:
            return
        self._closed = True
        rt, stats = self.runtime, self.handle.stats
        if not self.handle.finished:
            rt.engine.cancel(self.handle)
        rt.admission.release()
        m = rt.metrics
        m.syntheses.labels(self.outcome).inc()
        if self.outcome == "disconnected":
            m.disconnects.inc()
        if stats.queue_time is not None:
            m.queue_time.observe(stats.queue_time)
        if stats.time_to_first_audio is not None:
            m.ttfa.observe(stats.time_to_first_audio)
        m.audio_seconds.inc(stats.audio_seconds)
        if self.outcome == "ok" and stats.audio_seconds > 0:
            wall = time.monotonic() - stats.submitted_at
            m.rtf.observe(wall / stats.audio_seconds)
        if self.outcome != "ok":  # the one log line of a request that did not end well
            level = {"error": logging.ERROR, "timeout": logging.WARNING}.get(self.outcome, logging.INFO)
            logger.log(level, "request %s ended: %s (%s)", self.request_id, self.outcome, stats.as_dict())


def submit(runtime: Runtime, opts: Options, request_id: str, speaker_field: str = "speaker_id") -> Job:
    """Admit and submit; every refusal is an ApiError with the right status, naming `speaker_field` (the
    route's name for the voice: `voice` on /v1/audio/speech)."""
    s = runtime.settings
    retry = {"Retry-After": str(s.retry_after)}
    if not runtime.ready:
        runtime.metrics.rejections.labels("not_ready").inc()
        reason = "draining for shutdown" if runtime.draining else "not ready"
        raise NotReady(f"server is {reason}; retry later", headers=retry)
    try:
        xvector = runtime.voices.get(opts.speaker_id)
    except InvalidSpeakerIdError as e:
        raise InvalidField(f"{speaker_field}: {e}", param=speaker_field, code="invalid_speaker_id") from None
    except UnknownSpeakerError:
        raise NotFound(
            f"unknown speaker {opts.speaker_id!r} (GET /speakers lists the voices)",
            param=speaker_field,
            code="unknown_speaker",
        ) from None
    except InvalidProfileError:
        raise NotFound(
            f"speaker {opts.speaker_id!r} has an unusable profile file (the server log says why)",
            param=speaker_field,
            code="invalid_profile",
        ) from None
    if not runtime.admission.try_acquire():
        runtime.metrics.rejections.labels("queue_full").inc()
        raise Overloaded(
            f"server is at capacity ({runtime.admission.limit} requests in progress); retry later", headers=retry
        )
    temperature = s.temperature if opts.temperature is None else opts.temperature
    request = SynthesisRequest(
        text=opts.text,
        xvector=xvector,
        language=opts.language,
        temperature=temperature,
        top_k=s.top_k if opts.top_k is None else opts.top_k,
        greedy=temperature == 0.0,
        seed=opts.seed,
        max_frames=s.max_new_tokens if opts.max_new_tokens is None else opts.max_new_tokens,
        request_id=request_id,
    )
    if opts.min_new_tokens is not None:
        request.min_frames = opts.min_new_tokens
    try:
        handle = runtime.engine.submit(request)
    except QueueFullError:
        runtime.admission.release()
        runtime.metrics.rejections.labels("queue_full").inc()
        raise Overloaded("server is at capacity; retry later", headers=retry) from None
    except EngineNotReadyError:
        runtime.admission.release()
        runtime.metrics.rejections.labels("not_ready").inc()
        raise NotReady("engine is not accepting requests; retry later", headers=retry) from None
    except ValueError as e:  # options the engine refuses (e.g. text longer than its token limit)
        runtime.admission.release()
        message = str(e)
        raise InvalidField(message, param="text" if message.startswith("text") else None) from None
    except BaseException:
        runtime.admission.release()
        raise
    return Job(runtime, handle, request_id)


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
            job.outcome = "disconnected"
            raise ClientDisconnected()
        job.outcome = "timeout"
        raise RequestTimeout(
            f"request took longer than the limit of {job.runtime.settings.request_timeout:g} s and was cancelled",
            code="request_timeout",
        )
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


async def collect(job: Job, receive: Receive) -> np.ndarray:
    """The whole utterance; failures become EngineFailure (500 with the request id)."""
    try:
        pcm = await guarded(job, receive, job.handle.collect())
    except RequestFailedError:  # Job.close logs it, with the engine's error
        raise EngineFailure(f"synthesis failed (request id {job.request_id})") from None
    job.outcome = "ok"
    return pcm


async def first_chunk(job: Job, receive: Receive) -> np.ndarray | None:
    """The first audio chunk (None if the utterance is empty); sent before the response headers so that
    early failures still get a proper status code."""
    try:
        return await guarded(job, receive, _next_or_none(job.handle))
    except RequestFailedError:  # Job.close logs it, with the engine's error
        raise EngineFailure(f"synthesis failed (request id {job.request_id})") from None


async def _next_or_none(handle: RequestHandle) -> np.ndarray | None:
    try:
        return await handle.__anext__()
    except StopAsyncIteration:
        return None


async def rest(job: Job) -> AsyncIterator[np.ndarray]:
    """The chunks after the first, each awaited against the deadline. Raises RequestTimeout or
    RequestFailedError; disconnects arrive as cancellation from the response."""
    while True:
        remaining = job.deadline - time.monotonic()
        if remaining <= 0:
            job.outcome = "timeout"
            raise RequestTimeout("request timed out")
        try:
            chunk = await asyncio.wait_for(_next_or_none(job.handle), timeout=remaining)
        except asyncio.TimeoutError:
            job.outcome = "timeout"
            raise RequestTimeout("request timed out") from None
        if chunk is None:
            return
        yield chunk
