"""The WebSocket speech session at /v1/audio/speech/stream: text streamed in (a voice agent's LLM tokens) while its
audio streams out, utterance after utterance over one connection. The protocol is in docs/api.md ("WebSocket").

Client messages are JSON text frames with a `type`: `auth` (first, where the server has API keys and the handshake
carried no Authorization header), `start` (voice, language, format, sampling options: the HTTP bodies' fields and
rules), `text` (a fragment), `end` (no more text: speak the rest), `cancel` (barge-in: the audio stops now) and
`close`. The server sends JSON events (`session`, `started`, `audio`, `done`, `error` in the API's one error shape)
and the audio as binary frames, each right after the `audio` event that describes it.

Each utterance is one engine request in streaming-text mode (`SynthesisRequest.text_stream`): it holds an admission
slot from `start` (a refusal is an error event; the connection stays), is submitted once it has something to say,
and ends in exactly one `done` event. Whatever ends a session (the client leaving, a deadline, a cut), every engine
request it started is cancelled and every slot given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from qwen_tts.engine_api import EngineError, RequestFailedError, SynthesisRequest
from qwen_tts.text_stream import TextStream

from .audio_encoding import FORMATS, StreamEncoder
from .errors import (
    ApiError,
    BadRequest,
    Conflict,
    EngineFailure,
    InvalidField,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
    error_body,
    validation_error,
)
from .middleware import abort_connection, deny_websocket
from .runtime import Runtime
from .schemas import SynthesisOptions, _Strict, allowed_fields
from .synthesis import (
    Job,
    Outcome,
    admit,
    check_options,
    engine_refusal,
    has_visible_text,
    prepare,
    rest,
    start_job,
    voice_mode_of,
)

logger = logging.getLogger("tts_server")

WS_PATH = "/v1/audio/speech/stream"
# Formats an utterance may ask for (where this build has them): raw int16, raw float32, Ogg Opus.
STREAM_FORMATS = ("pcm", "f32le", "opus")
# Each rate limit may be exceeded by a burst of this many seconds' worth.
BURST_S = 2.0
# The protocol layer (uvicorn) closes a connection whose message exceeds this many times TTS_WS_MAX_MESSAGE_BYTES
# (1009) before buffering it; between the two limits a message gets a recoverable error event.
PROTOCOL_SIZE_FACTOR = 4
# WebSocket close codes (RFC 6455 7.4.1).
CLOSE_NORMAL, CLOSE_POLICY, CLOSE_INTERNAL = 1000, 1008, 1011


# --- messages -------------------------------------------------------------------------------------------------
class StartMessage(SynthesisOptions):
    """Begins an utterance: the voice, the options of an HTTP body, the audio format, and any text already known."""

    type: Literal["start"]
    voice: str = Field(min_length=1, max_length=64, description="A speaker id (GET /v1/audio/voices).")
    text: str = Field("", description="Text known at the start (more comes in `text` messages).")
    response_format: Literal["pcm", "f32le", "opus"] = Field(
        "pcm", description="pcm: int16 LE mono; f32le: float32 LE mono; opus: an Ogg Opus stream."
    )

    @property
    def speaker_id(self) -> str:
        return self.voice


class TextMessage(_Strict):
    type: Literal["text"]
    text: str


class EndMessage(_Strict):
    type: Literal["end"]


class CancelMessage(_Strict):
    type: Literal["cancel"]


class CloseMessage(_Strict):
    type: Literal["close"]


class AuthMessage(_Strict):
    type: Literal["auth"]
    token: str = Field(max_length=4096)


MESSAGES: dict[str, type[BaseModel]] = {
    "start": StartMessage,
    "text": TextMessage,
    "end": EndMessage,
    "cancel": CancelMessage,
    "close": CloseMessage,
    "auth": AuthMessage,
}


def parse_message(raw: str) -> BaseModel:
    """A client message, validated strictly as HTTP bodies are; BadRequest or InvalidField naming the field."""
    try:
        peek = json.loads(raw)
    except ValueError as e:
        raise BadRequest(f"message is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(peek, dict):
        raise BadRequest("a message must be a JSON object with a `type`", code="invalid_message")
    kind = peek.get("type")
    model = MESSAGES.get(kind) if isinstance(kind, str) else None
    if model is None:
        shown = json.dumps(kind)[:40]
        raise InvalidField(
            f"type: {shown} is not a message type (one of: {', '.join(MESSAGES)})",
            param="type",
            code="unknown_message_type",
        )
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e, allowed_fields(model)) from None


# --- session bookkeeping ------------------------------------------------------------------------------------------
class SessionCounts:
    """Open sessions, in all and per client address (an upgraded connection leaves the HTTP layer's accounting)."""

    def __init__(self) -> None:
        self.total = 0
        self.per_client: dict[str, int] = {}

    def open(self, client: str) -> None:
        self.total += 1
        self.per_client[client] = self.per_client.get(client, 0) + 1

    def close(self, client: str) -> None:
        self.total -= 1
        left = self.per_client.get(client, 1) - 1
        if left > 0:
            self.per_client[client] = left
        else:
            self.per_client.pop(client, None)


class Rate:
    """A token bucket: `per_s` a second, holding BURST_S seconds' worth (at least `floor`)."""

    def __init__(self, per_s: float, floor: float = 1.0):
        self.per_s = per_s
        self.capacity = max(per_s * BURST_S, floor)
        self.level = self.capacity
        self.at = time.monotonic()

    def take(self, n: float) -> bool:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.at) * self.per_s)
        self.at = now
        if n > self.level:
            return False
        self.level -= n
        return True


class SessionOver(Exception):
    """The session ends; `reason` labels tts_ws_session_ends_total."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class Utterance:
    id: str
    request: SynthesisRequest
    stream: TextStream
    encoder: StreamEncoder
    started_at: float = field(default_factory=time.monotonic)
    last_text_at: float = field(default_factory=time.monotonic)
    first_text_at: float | None = None
    first_audio_at: float | None = None
    job: Job | None = None
    holds_slot: bool = True  # the admission slot, until a Job takes it
    pump: asyncio.Task | None = None
    chars: int = 0
    fed: int = 0  # samples given to the encoder
    sent: int = 0  # samples whose bytes have been sent
    stopped: bool = False  # cancelled or failed: nothing more is sent for it

    @property
    def text_ended(self) -> bool:
        return self.stream.ended


# --- the endpoint ----------------------------------------------------------------------------------------------------
class SpeechSocket:
    """The ASGI endpoint of WS_PATH (a plain ASGI app, so it can refuse a handshake in the error shape)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = scope["app"]
        request_id = scope.get("state", {}).get("request_id") or uuid.uuid4().hex
        runtime: Runtime | None = getattr(app.state, "runtime", None)
        if runtime is None:
            await deny_websocket(
                scope, send, NotReady("server is starting; retry later", headers={"Retry-After": "1"}), request_id
            )
            return
        s = runtime.settings
        counts: SessionCounts = app.state.ws_sessions
        client = scope["client"][0] if scope.get("client") else "?"
        retry = {"Retry-After": str(s.retry_after)}
        if counts.per_client.get(client, 0) >= s.ws_max_sessions_per_client:
            runtime.metrics.rejections.labels("ws_client_session_limit").inc()
            error: ApiError = Overloaded(
                f"too many WebSocket sessions from this client (limit {s.ws_max_sessions_per_client}, "
                "TTS_WS_MAX_SESSIONS_PER_CLIENT)",
                code="too_many_sessions",
                headers=retry,
            )
            await deny_websocket(scope, send, error, request_id)
            return
        if counts.total >= s.ws_max_sessions:
            runtime.metrics.rejections.labels("ws_session_limit").inc()
            error = NotReady(
                f"server is at its WebSocket session limit ({s.ws_max_sessions}, TTS_WS_MAX_SESSIONS); retry later",
                code="too_many_sessions",
                headers=retry,
            )
            await deny_websocket(scope, send, error, request_id)
            return
        counts.open(client)
        try:
            await Session(WebSocket(scope, receive, send), runtime, request_id).run()
        finally:
            counts.close(client)


class Session:
    """One connection: its messages, at most one utterance at a time, its limits and deadlines."""

    def __init__(self, websocket: WebSocket, runtime: Runtime, request_id: str):
        self.ws = websocket
        self.runtime = runtime
        self.settings = s = runtime.settings
        self.id = request_id
        self.key_check: Callable[[str], bool] | None = websocket.scope.get("state", {}).get("api_key_check")
        self.utterance: Utterance | None = None
        self.detached: set[Utterance] = set()  # cancelled utterances whose engine work is winding down
        self.count = 0
        self.messages = Rate(s.ws_messages_per_s)
        self.chars = Rate(s.ws_text_chars_per_s, floor=s.ws_max_fragment_chars)
        self.last_activity = time.monotonic()
        self.send_lock = asyncio.Lock()
        self.rate = runtime.engine.sample_rate
        self.formats = [f for f in STREAM_FORMATS if f in FORMATS]

    # --- lifecycle -----------------------------------------------------------------------------------------------
    async def run(self) -> None:
        m = self.runtime.metrics
        await self.ws.accept()
        m.ws_sessions.inc()
        reason = "client"
        try:
            if self.key_check is not None:
                await self._authenticate()
            await self._event({"type": "session", "session_id": self.id, "sample_rate": self.rate,
                               "formats": self.formats, "limits": self._limits()})  # fmt: skip
            await self._serve()
        except SessionOver as e:
            reason = e.reason
        except Exception:
            reason = "error"
            logger.exception("session %s failed", self.id)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.ws.close(CLOSE_INTERNAL), self.settings.ws_send_timeout)
        finally:
            pumps = self._teardown()
            m.ws_sessions.dec()
            m.ws_session_ends.labels(reason).inc()
            if pumps:  # let them finish their cleanup (each has closed or will close its job)
                await asyncio.wait(pumps, timeout=1.0)

    def _limits(self) -> dict[str, Any]:
        s = self.settings
        return {
            "max_message_bytes": s.ws_max_message_bytes,
            "max_fragment_chars": s.ws_max_fragment_chars,
            "max_text_chars": s.max_text_chars,
            "text_chars_per_s": s.ws_text_chars_per_s,
            "messages_per_s": s.ws_messages_per_s,
            "max_utterances": s.ws_max_utterances,
            "idle_timeout_s": s.ws_idle_timeout,
            "text_timeout_s": s.ws_text_timeout,
            "send_timeout_s": s.ws_send_timeout,
        }

    async def _authenticate(self) -> None:
        """On a server with keys, a handshake without an Authorization header must send `auth` first."""
        timeout = self.settings.header_timeout
        usage = 'send {"type": "auth", "token": "<key>"} first (or an Authorization: Bearer header)'
        try:
            message = await asyncio.wait_for(self.ws.receive(), timeout)
        except asyncio.TimeoutError:
            await self._fatal(Unauthorized(f"no auth message within {timeout:g} s: {usage}"), "auth")
        if message["type"] == "websocket.disconnect":
            raise SessionOver("client")
        parsed: BaseModel | None = None
        if message.get("text") is not None and len(message["text"]) <= self.settings.ws_max_message_bytes:
            with contextlib.suppress(ApiError):
                parsed = parse_message(message["text"])
        if not isinstance(parsed, AuthMessage):
            await self._fatal(Unauthorized(f"missing API key: {usage}"), "auth")
        assert self.key_check is not None and isinstance(parsed, AuthMessage)
        if not self.key_check(parsed.token):
            await self._fatal(Unauthorized("invalid API key"), "auth")
        self.key_check = None

    async def _serve(self) -> None:
        receiving = asyncio.ensure_future(self.ws.receive())
        try:
            while True:
                utt = self.utterance
                waits: set[asyncio.Future] = {receiving}
                if utt is not None and utt.pump is not None:
                    waits.add(utt.pump)
                done, _ = await asyncio.wait(waits, timeout=self._timeout(), return_when=asyncio.FIRST_COMPLETED)
                if utt is not None and utt.pump is not None and utt.pump in done:
                    utt.pump.result()  # SessionOver where the client was cut
                if receiving in done:
                    message = receiving.result()
                    if message["type"] == "websocket.disconnect":
                        raise SessionOver("client")
                    receiving = asyncio.ensure_future(self.ws.receive())
                    await self._on_message(message)
                elif not done:
                    await self._on_timeout()
        finally:
            receiving.cancel()

    def _timeout(self) -> float | None:
        now, utt = time.monotonic(), self.utterance
        if utt is None:
            return max(0.0, self.last_activity + self.settings.ws_idle_timeout - now)
        if not utt.text_ended:
            return max(0.0, utt.last_text_at + self.settings.ws_text_timeout - now)
        return None  # its audio is on its way; the job's deadline bounds it

    async def _on_timeout(self) -> None:
        utt, s = self.utterance, self.settings
        if utt is None:
            error = RequestTimeout(
                f"no message for {s.ws_idle_timeout:g} s (TTS_WS_IDLE_TIMEOUT): session closed", code="idle_timeout"
            )
            await self._fatal(error, "idle", CLOSE_NORMAL)
        assert utt is not None
        if not utt.text_ended:
            error = RequestTimeout(
                f"no text for {s.ws_text_timeout:g} s (TTS_WS_TEXT_TIMEOUT) while the utterance was open: it was "
                "cancelled (send end when the text is complete)",
                code="text_timeout",
            )
            await self._error(error, utt)
            await self._stop(utt, Outcome.TIMEOUT, "timeout")

    def _teardown(self) -> list[asyncio.Task]:
        """Cancel every engine request this session started and give back every slot; runs once, at the end. The
        pumps still running (cancelled here), to be awaited."""
        pumps = []
        if self.utterance is not None:  # the detached ones have had their done event
            self.runtime.metrics.ws_utterances.labels("disconnected").inc()
        for utt in [*([self.utterance] if self.utterance else []), *self.detached]:
            utt.stopped = True
            utt.stream.end()
            if utt.pump is not None and not utt.pump.done():
                utt.pump.cancel()
                pumps.append(utt.pump)
            if utt.job is not None:
                if utt.job.outcome in (Outcome.ERROR, Outcome.STREAMING):
                    utt.job.outcome = Outcome.DISCONNECTED
                utt.job.close()
            elif utt.holds_slot:
                utt.holds_slot = False
                self.runtime.admission.release()
        self.utterance = None
        self.detached.clear()
        return pumps

    # --- sending -------------------------------------------------------------------------------------------------
    async def _send_raw(self, message: str | bytes) -> None:
        """One frame, within TTS_WS_SEND_TIMEOUT: past it the client has stopped reading and is cut."""
        send = self.ws.send_bytes(message) if isinstance(message, bytes) else self.ws.send_text(message)
        try:
            await asyncio.wait_for(send, self.settings.ws_send_timeout)
        except asyncio.TimeoutError:
            logger.warning("session %s: client did not read for %g s: cut", self.id, self.settings.ws_send_timeout)
            abort_connection(self.ws.scope)
            raise SessionOver("slow_reader") from None
        except (WebSocketDisconnect, OSError, RuntimeError):  # gone (RuntimeError: Starlette after a close)
            raise SessionOver("client") from None

    async def _event(self, event: dict[str, Any]) -> None:
        async with self.send_lock:
            await self._send_raw(json.dumps(event, separators=(",", ":")))

    async def _error(self, error: ApiError, utt: Utterance | None = None) -> None:
        """An error event in the API's one shape (`type`, the utterance's id and a retry hint added)."""
        self.runtime.metrics.ws_errors.labels(error.code).inc()
        event: dict[str, Any] = {"type": "error"}
        event |= error_body(error.status, error.message, error.type, error.code, error.param, self.id)
        if utt is not None:
            event["utterance_id"] = utt.id
        if "Retry-After" in error.headers:
            event["retry_after"] = int(error.headers["Retry-After"])
        await self._event(event)

    async def _fatal(self, error: ApiError, reason: str, code: int = CLOSE_POLICY) -> None:
        """An error event, then the close: the session is over."""
        with contextlib.suppress(SessionOver):
            await self._error(error)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code, error.message[:120]), self.settings.ws_send_timeout)
        raise SessionOver(reason)

    # --- client messages -----------------------------------------------------------------------------------------
    async def _on_message(self, message: dict[str, Any]) -> None:
        self.last_activity = time.monotonic()
        utt = self.utterance
        try:
            if message.get("text") is None:
                raise BadRequest("binary frames are not accepted: send JSON text messages", code="binary_message")
            raw: str = message["text"]
            size = len(raw.encode("utf-8", "surrogatepass"))
            limit = self.settings.ws_max_message_bytes
            if size > limit:
                raise PayloadTooLarge(
                    f"message of {size} bytes is larger than the limit of {limit} bytes (TTS_WS_MAX_MESSAGE_BYTES)",
                    code="message_too_large",
                )
            if not self.messages.take(1):
                raise Overloaded(
                    f"more than {self.settings.ws_messages_per_s:g} messages a second (TTS_WS_MESSAGES_PER_S): "
                    "message dropped",
                    code="rate_limited",
                )
            parsed = parse_message(raw)
            if isinstance(parsed, StartMessage):
                await self._on_start(parsed)
            elif isinstance(parsed, TextMessage):
                await self._on_text(parsed.text)
            elif isinstance(parsed, EndMessage):
                await self._on_end()
            elif isinstance(parsed, CancelMessage):
                if self.utterance is not None:
                    await self._stop(self.utterance, Outcome.CANCELLED, "cancelled")
            elif isinstance(parsed, CloseMessage):
                if self.utterance is not None:
                    await self._stop(self.utterance, Outcome.CANCELLED, "cancelled")
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.ws.close(CLOSE_NORMAL), self.settings.ws_send_timeout)
                raise SessionOver("client_close")
            elif isinstance(parsed, AuthMessage) and self.key_check is None:
                pass  # already authenticated (or no keys): harmless
        except ApiError as e:
            await self._error(e, self.utterance or utt)

    async def _on_start(self, body: StartMessage) -> None:
        s, rt = self.settings, self.runtime
        if self.utterance is not None:
            raise Conflict(
                f"utterance {self.utterance.id} is in progress: send end and wait for its done event, or cancel it",
                param="type",
                code="utterance_in_progress",
            )
        if self.count >= s.ws_max_utterances:
            await self._fatal(
                InvalidField(
                    f"this connection has started {self.count} utterances, the limit is {s.ws_max_utterances} "
                    "(TTS_WS_MAX_UTTERANCES): reconnect to go on",
                    code="utterance_limit",
                ),
                "utterance_limit",
            )
        if body.response_format not in self.formats:
            raise InvalidField(
                f"response_format: {body.response_format!r} is not available in this build "
                f"(one of: {', '.join(self.formats)})",
                param="response_format",
                code="unsupported_format",
            )
        if body.speed != 1.0:
            raise InvalidField("speed: only 1.0 on the WebSocket session (its audio streams as it is generated)",
                               param="speed")  # fmt: skip
        if body.reference is not None:
            raise InvalidField(
                "reference: not taken on the WebSocket session (a start message is a small JSON frame): enrol the voice "
                "with its transcript (POST /v1/audio/voices with ref_text) and name it",
                param="reference",
            )
        self._check_fragment(body.text, 0)
        check_options(rt, body)
        utterance_id = f"{self.id}-{self.count + 1}"
        request = prepare(rt, body, utterance_id, speaker_field="voice")
        admit(rt)  # Overloaded, with Retry-After: an error event, the connection stays
        self.count += 1
        stream = TextStream()
        request.text, request.text_stream, request.non_streaming_text = "", stream, False
        utt = Utterance(utterance_id, request, stream, StreamEncoder(body.response_format, self.rate))
        self.utterance = utt
        await self._event({"type": "started", "utterance_id": utt.id, "response_format": body.response_format,
                           "sample_rate": self.rate, "voice_mode": voice_mode_of(request)})  # fmt: skip
        if body.text:
            self._take_chars(len(body.text))
            await self._push(utt, body.text)

    def _check_fragment(self, text: str, so_far: int) -> None:
        s = self.settings
        if len(text) > s.ws_max_fragment_chars:
            raise InvalidField(
                f"text: {len(text)} characters, the limit for one fragment is {s.ws_max_fragment_chars} "
                "(TTS_WS_MAX_FRAGMENT_CHARS): fragment dropped",
                param="text",
                code="fragment_too_long",
            )
        if so_far + len(text) > s.max_text_chars:
            raise InvalidField(
                f"text: the utterance would have {so_far + len(text)} characters, the limit is {s.max_text_chars} "
                "(TTS_MAX_TEXT_CHARS): fragment dropped",
                param="text",
                code="text_too_long",
            )

    def _take_chars(self, n: int) -> None:
        if not self.chars.take(n):
            raise Overloaded(
                f"text: more than {self.settings.ws_text_chars_per_s:g} characters a second (TTS_WS_TEXT_CHARS_PER_S): "
                "fragment dropped",
                param="text",
                code="rate_limited",
            )

    async def _on_text(self, text: str) -> None:
        utt = self.utterance
        if utt is None:
            raise Conflict("text before start: send a start message first", param="type", code="no_utterance")
        if utt.text_ended:
            raise Conflict(
                f"utterance {utt.id} has ended its text (end was sent): start a new utterance for more",
                param="type",
                code="utterance_ended",
            )
        self._check_fragment(text, utt.chars)
        self._take_chars(len(text))
        await self._push(utt, text)

    async def _push(self, utt: Utterance, text: str) -> None:
        now = time.monotonic()
        utt.last_text_at = now
        if not text:
            return
        if utt.first_text_at is None:
            utt.first_text_at = now
        utt.chars += len(text)
        self.runtime.metrics.ws_text_chars.inc(len(text))
        utt.stream.push(text)
        if utt.job is None and has_visible_text(utt.stream.snapshot().text):
            await self._submit(utt)

    async def _submit(self, utt: Utterance) -> None:
        """The engine request, once there is something to say (its slot passes to the Job)."""
        utt.request.text = utt.stream.snapshot().text
        utt.holds_slot = False
        try:
            utt.job = start_job(self.runtime, utt.request)
        except ApiError as e:
            await self._error(e, utt)
            await self._finish(utt, "error")
            return
        utt.job.outcome = Outcome.STREAMING
        utt.pump = asyncio.ensure_future(self._pump(utt))

    async def _on_end(self) -> None:
        utt = self.utterance
        if utt is None:
            raise Conflict("end before start: send a start message first", param="type", code="no_utterance")
        utt.stream.end()
        if utt.job is None:  # nothing to say: no engine work at all
            await self._finish(utt, "empty")

    # --- an utterance's audio --------------------------------------------------------------------------------------
    async def _pump(self, utt: Utterance) -> None:
        """The utterance's audio, chunk by chunk as the engine makes it, then its done event."""
        job = utt.job
        assert job is not None
        try:
            async for chunk in rest(job):
                if utt.stopped:
                    return
                utt.fed += chunk.shape[0]
                await self._audio(utt, utt.encoder.feed(chunk))
            if utt.stopped:
                return
            await self._audio(utt, utt.encoder.close())
            job.outcome = Outcome.OK
            reason = job.source.stats.finish_reason
            await self._finish(utt, reason.value if reason else "eos")
        except RequestFailedError:
            job.outcome = Outcome.ERROR  # Job.close logs the engine's error
            if not utt.stopped:
                await self._error(EngineFailure(f"synthesis failed (utterance {utt.id})"), utt)
                await self._finish(utt, "error")
        except (EngineError, ValueError) as e:  # refused by an engine in another process (remote_engine.py)
            job.outcome = Outcome.ERROR
            if not utt.stopped:
                await self._error(engine_refusal(self.runtime, e) or EngineFailure(f"synthesis failed ({utt.id})"), utt)
                await self._finish(utt, "error")
        except RequestTimeout:
            job.outcome = Outcome.TIMEOUT
            if not utt.stopped:
                limit = self.settings.request_timeout
                error = RequestTimeout(f"utterance took longer than the limit of {limit:g} s (TTS_REQUEST_TIMEOUT) "
                                       "and was cancelled", code="request_timeout")  # fmt: skip
                await self._error(error, utt)
                await self._finish(utt, "timeout")
        finally:
            if job.outcome is Outcome.STREAMING:
                job.outcome = Outcome.DISCONNECTED
            job.close()
            self.detached.discard(utt)

    async def _audio(self, utt: Utterance, data: bytes) -> None:
        """An `audio` event and its binary frame, together (no other message between them)."""
        if not data:
            return
        async with self.send_lock:
            if utt.stopped:
                return
            now = time.monotonic()
            if utt.first_audio_at is None:
                utt.first_audio_at = now
                if utt.first_text_at is not None:
                    self.runtime.metrics.ws_ttfa.observe(now - utt.first_text_at)
            event = {"type": "audio", "utterance_id": utt.id, "offset": utt.sent, "samples": utt.fed - utt.sent,
                     "bytes": len(data)}  # fmt: skip
            utt.sent = utt.fed
            await self._send_raw(json.dumps(event, separators=(",", ":")))
            await self._send_raw(data)

    async def _finish(self, utt: Utterance, reason: str) -> None:
        """The utterance's one `done` event; the session is free for the next."""
        if self.utterance is utt:
            self.utterance = None
        utt.stopped = True
        utt.stream.end()
        if utt.holds_slot:
            utt.holds_slot = False
            self.runtime.admission.release()
        self.last_activity = time.monotonic()
        self.runtime.metrics.ws_utterances.labels(reason).inc()
        stats = utt.job.source.stats if utt.job is not None else None
        ttfa = None
        if utt.first_audio_at is not None and utt.first_text_at is not None:
            ttfa = round(utt.first_audio_at - utt.first_text_at, 4)
        await self._event(
            {
                "type": "done",
                "utterance_id": utt.id,
                "finish_reason": reason,
                "samples": utt.sent,
                "audio_seconds": round(utt.sent / self.rate, 4),
                "text_chars": utt.chars,
                "frames": stats.frames if stats is not None else 0,
                "time_to_first_audio": ttfa,
                "wall_time": round(time.monotonic() - utt.started_at, 4),
                "voice_mode": voice_mode_of(utt.request),
            }
        )

    async def _stop(self, utt: Utterance, outcome: Outcome, reason: str) -> None:
        """Barge-in (or a text timeout): the engine request is cancelled now (it stops within a step), no more audio
        of it is sent, and its done event goes out before anything else; the session may start the next at once."""
        utt.stopped = True
        utt.stream.end()
        if utt.job is not None:
            utt.job.outcome = outcome
            utt.job.source.cancel()
            if utt.pump is not None and not utt.pump.done():
                self.detached.add(utt)  # its pump closes the job once the engine has let go
        await self._finish(utt, reason)
