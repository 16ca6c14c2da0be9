"""The synthesis service: one call per synthesis route, from a parsed body to the response that owns its job.

`file` (the whole utterance, encoded), `stream` (chunked audio as it is decoded) and `speech` (OpenAI's speech API:
audio or SSE) each check the body against the server's limits, admit and submit it (`synthesis`), wait for the
audio under the request's deadline and build the response. A streaming response owns its job from the first chunk
on: whatever ends it closes the job, which cancels the engine work still running. The deadline covers the sends as
well: a client that stops reading is cut there, not when its socket drains.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import anyio
import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from qwen_tts.engine_api import RequestFailedError

from .audio_encoding import FORMATS, StreamEncoder, encode, get_format
from .errors import InvalidField, RequestTimeout, validation_error
from .http_server import ARRIVED_AT
from .middleware import StreamAborted, abort_connection
from .runtime import Runtime
from .schemas import SpeechRequest, StreamRequest, SynthesizeRequest, allowed_fields
from .synthesis import ClientDisconnected, Job, Outcome, check_limits, collect, first_chunk, rest, submit

# nginx's code for "client closed the request": logged and counted, never seen by a client.
CLIENT_CLOSED = 499
# Seconds a response may still be sending past its job's deadline before the connection is cut.
SEND_GRACE_S = 1.0
# OpenAI's speech formats, in its order, for the message that lists what this build serves.
OPENAI_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")


# --- the three service calls -----------------------------------------------------------------------------------
async def file(request: Request, runtime: Runtime, body: SynthesizeRequest) -> Response:
    """POST /synthesize: the whole utterance as one file (wav by default)."""
    check_limits(runtime, body)
    if body.response_format not in FORMATS:
        raise InvalidField(
            f"response_format: {body.response_format!r} is not available in this build", param="response_format"
        )
    job = await submit(runtime, body, _rid(request))
    _submitted(request, job)
    return await _whole_file(request, job, body.response_format)


async def stream(request: Request, runtime: Runtime, body: StreamRequest) -> Response:
    """POST /synthesize/stream (and /synthesize with `"stream": true`): chunked audio as it is decoded."""
    check_limits(runtime, body)
    job = await submit(runtime, body, _rid(request))
    _submitted(request, job)
    first = await _start_stream(request, job)
    if isinstance(first, Response):
        return first
    rate = runtime.engine.sample_rate
    encoder = StreamEncoder(body.response_format, rate)
    headers = {
        "X-Sample-Rate": str(rate),
        "X-Audio-Format": body.response_format,
        "X-Time-To-First-Audio": f"{job.source.stats.time_to_first_audio or 0.0:.3f}",
        "X-Voice-Mode": job.voice_mode,
        "Cache-Control": "no-store",
    }
    return JobStreamingResponse(
        job, _encoded_stream(job, first, encoder), media_type=encoder.format.media_type, headers=headers
    )


async def speech(request: Request, runtime: Runtime, body: SpeechRequest) -> Response:
    """POST /v1/audio/speech: `voice` is a speaker id; audio streams as it is generated, raw or as SSE (flac and,
    outside SSE, wav are sent whole)."""
    check_limits(runtime, body, text_field="input")
    if body.response_format not in FORMATS:
        raise InvalidField(
            f"response_format: {body.response_format!r} is not supported by this server "
            f"(use one of: {', '.join(f for f in OPENAI_FORMATS if f in FORMATS)})",
            param="response_format",
            code="unsupported_format",
        )
    job = await submit(runtime, body, _rid(request), speaker_field="voice")
    _submitted(request, job)
    # FLAC cannot state its length up front and many decoders refuse a FLAC stream without it: sent whole, also as
    # the one delta of an SSE stream. A wav body is the saved file of OpenAI's `speech.create(...).write_to_file`,
    # which needs true RIFF and data sizes (a streamed header says 0xFFFFFFFF: 89,478 s to sox, 2**31-1 frames to
    # Python's wave): sent whole with its Content-Length. Streamed wav remains where streaming is asked for by
    # name: `stream_format: "sse"`, /synthesize/stream, /synthesize with `"stream": true`; `pcm` streams the
    # same samples without a header.
    whole = body.response_format == "flac"
    if body.stream_format == "audio" and body.response_format in ("flac", "wav"):
        return await _whole_file(request, job, body.response_format)
    first = await _start_stream(request, job)
    if isinstance(first, Response):
        return first
    rate = runtime.engine.sample_rate
    encoder = StreamEncoder(body.response_format, rate)
    headers = {"X-Sample-Rate": str(rate), "X-Voice-Mode": job.voice_mode, "Cache-Control": "no-store"}
    if body.stream_format == "sse":
        content = _sse_stream(job, first, encoder, whole, body.input)
        return JobStreamingResponse(job, content, media_type="text/event-stream", headers=headers)
    content = _encoded_stream(job, first, encoder)
    return JobStreamingResponse(job, content, media_type=encoder.format.media_type, headers=headers)


def as_stream_request(body: SynthesizeRequest) -> StreamRequest:
    """The seed's `"stream": true` on /synthesize: the same fields as a /synthesize/stream body (its default
    format, f32le, unless pcm or wav was asked for); a format streams cannot carry is a 422 naming the field."""
    fields = body.model_dump(exclude={"stream"}, exclude_unset=True)
    try:
        return StreamRequest.model_validate(fields)
    except ValidationError as e:
        error = validation_error(e, allowed_fields(StreamRequest))
        error.message = f'with "stream": true, {error.message}'
        raise error from None


# --- responses that own their job ------------------------------------------------------------------------------
def _rid(request: Request) -> str:
    return request.state.request_id


def _submitted(request: Request, job: Job) -> None:
    """Count the time from the request's arrival (its headers read: tts_server/http_server.py; where the server is not
    ours, the middleware's first look at it) to the engine's submission."""
    state = request.scope.get("state", {})
    arrived = state.get(ARRIVED_AT, state.get("received_at"))
    if arrived is not None:
        job.runtime.metrics.time_to_engine.observe(max(0.0, job.source.stats.submitted_at - arrived))


def _audio_headers(job: Job, request: Request, pcm: np.ndarray) -> dict[str, str]:
    received = request.scope.get("state", {}).get("received_at", job.received_at)
    rate = job.runtime.engine.sample_rate
    return {
        "X-Audio-Duration": f"{pcm.shape[0] / rate:.3f}",
        "X-Latency": f"{time.monotonic() - received:.3f}",
        "X-Sample-Rate": str(rate),
        "X-Finish-Reason": job.source.stats.finish_reason.value if job.source.stats.finish_reason else "",
        "X-Voice-Mode": job.voice_mode,
    }


async def send_by(deadline: float, scope: Scope, respond: Awaitable[None]) -> bool:
    """Run `respond` (a response being sent) until `deadline` + SEND_GRACE_S; past it, cut the connection (its
    client has stopped reading, or the engine is late) and return False. The grace lets a route's own timeout
    message (an SSE error event) go out first where the socket still takes it."""
    with anyio.move_on_after(max(0.0, deadline + SEND_GRACE_S - time.monotonic())) as cut:
        await respond
    if cut.cancelled_caught:
        abort_connection(scope)
        return False
    return True


class JobStreamingResponse(StreamingResponse):
    """A streaming response that owns its job: whatever ends the stream (completion, failure, deadline, client
    gone), the job is closed, which cancels the engine request if it is still running. The job's deadline covers
    every send: a client that stops reading is cut there, not when its socket drains."""

    def __init__(self, job: Job, content: AsyncIterator[bytes], **kwargs: Any):
        super().__init__(content, **kwargs)
        self.job = job
        job.outcome = Outcome.STREAMING

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if not await send_by(self.job.deadline, scope, super().__call__(scope, receive, send)):
                self.job.outcome = Outcome.TIMEOUT
                raise StreamAborted("request timeout: the client did not take the audio in time", status=504)
        finally:
            if self.job.outcome is Outcome.STREAMING:
                self.job.outcome = Outcome.DISCONNECTED
            self.job.close()


class DeadlineResponse(Response):
    """A whole file, sent by its job's deadline (a client that does not read it is cut there)."""

    def __init__(self, deadline: float, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not await send_by(self.deadline, scope, super().__call__(scope, receive, send)):
            raise StreamAborted("request timeout: the client did not take the file in time", status=504)


async def _encoded_stream(job: Job, first: np.ndarray | None, encoder: StreamEncoder) -> AsyncIterator[bytes]:
    try:
        if first is not None:
            yield encoder.feed(first)
            async for chunk in rest(job):
                data = encoder.feed(chunk)
                if data:
                    yield data
        tail = encoder.close()
        if tail:
            yield tail
        job.outcome = Outcome.OK
    except RequestFailedError as e:
        job.outcome = Outcome.ERROR  # Job.close logs it, with the engine's error
        raise StreamAborted(f"engine failure: {e}") from None
    except RequestTimeout:
        job.outcome = Outcome.TIMEOUT
        raise StreamAborted("request timeout", status=504) from None


async def _start_stream(request: Request, job: Job) -> np.ndarray | Response | None:
    """Wait for the first chunk; on any failure close the job here (no response owns it yet)."""
    try:
        return await first_chunk(job, request.receive)
    except ClientDisconnected:
        job.close()
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        job.close()
        raise


async def _whole_file(request: Request, job: Job, fmt: str) -> Response:
    try:
        pcm = await collect(job, request.receive)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        job.close()
    audio_format = get_format(fmt)
    data = await anyio.to_thread.run_sync(encode, pcm, audio_format, job.runtime.engine.sample_rate)
    headers = _audio_headers(job, request, pcm)
    return DeadlineResponse(job.deadline, data, media_type=audio_format.media_type, headers=headers)


def _sse_event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def _sse_stream(
    job: Job, first: np.ndarray | None, encoder: StreamEncoder, whole: bool, text: str
) -> AsyncIterator[bytes]:
    """OpenAI speech SSE: `speech.audio.delta` events with base64 audio, then `speech.audio.done`.
    With `whole` (FLAC) the one delta is the complete file."""

    def delta(data: bytes) -> bytes:
        return _sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})

    async def chunks() -> AsyncIterator[np.ndarray]:
        if first is not None:
            yield first
            async for chunk in rest(job):
                yield chunk

    try:
        if whole:
            parts = [c async for c in chunks()]
            pcm = np.concatenate(parts) if parts else np.zeros(0, np.float32)
            rate = job.runtime.engine.sample_rate
            yield delta(await anyio.to_thread.run_sync(encode, pcm, encoder.format, rate))
        else:
            async for chunk in chunks():
                data = encoder.feed(chunk)
                if data:
                    yield delta(data)
            tail = encoder.close()
            if tail:
                yield delta(tail)
        frames = job.source.stats.frames
        # input_tokens counts characters: the text tokenizer's count is the engine's business.
        usage = {"input_tokens": len(text), "output_tokens": frames, "total_tokens": len(text) + frames}
        yield _sse_event({"type": "speech.audio.done", "usage": usage, "voice_mode": job.voice_mode})
        job.outcome = Outcome.OK
    except (RequestFailedError, RequestTimeout) as e:
        job.outcome = Outcome.TIMEOUT if isinstance(e, RequestTimeout) else Outcome.ERROR  # Job.close logs it
        timed_out = job.outcome is Outcome.TIMEOUT
        message = "request timed out" if timed_out else f"synthesis failed (request id {job.request_id})"
        yield _sse_event({"type": "error", "error": {"message": message, "code": job.outcome.value}})
