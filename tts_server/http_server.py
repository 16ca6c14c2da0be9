"""Connection hygiene on top of uvicorn's h11 protocol: what a production HTTP server enforces before a request
reaches the app.

- header-read timeout: a connection must deliver complete request headers within `header_timeout` s of opening
  (or of the end of its previous response); a slow or silent socket is answered 408 (if it sent anything) and
  closed. uvicorn on its own has no such timer: an idle socket stays open for ever.
- keep-alive timeout: an idle kept-alive connection is closed after `keep_alive_timeout` s (uvicorn's timer).
- header size limit: headers larger than `max_header_bytes` get 431 (h11 enforces the size; the default httptools
  parser has no limit at all).
- connection caps: at most `max_connections` open connections and `max_connections_per_client` per client
  address. At either cap the oldest *idle* connection (between requests or still sending headers; of the same
  client for its own cap) is closed to make room, so idle sockets can never lock working clients out; only when
  every candidate is busy is the newcomer refused: 429 over the per-client cap, 503 over the global one.
- over a cap with no idle connection to close, the newcomer is refused at once (429 or 503 written as soon as it
  connects) and closed within `LINGER_S`; it never waits for its headers, so refused sockets pile up nowhere.
- a request body nobody reads (an early 401, 408, 413, or any response sent before the client finished sending) ends
  the connection: the response goes out, then a lingering close reads and discards what the client still sends for at
  most `LINGER_S` (so the client sees the response, not a reset) and aborts. A trickling body cannot hold a socket.
- framing the app must never see: Content-Length together with Transfer-Encoding (RFC 9112 6.1, the setup for request
  smuggling) gets 400, a request line other than HTTP/1.0 or 1.1 gets 505; both close the connection.
- every response this layer writes (400, 408, 429, 431, 503, 505) has the API's JSON error shape and an X-Request-Id.
- the app sees the connection as the scope extension `CONNECTION_EXTENSION`, whose `abort()` cuts it (a stream past its
  deadline whose client stopped reading: closing gracefully would wait for ever on a full socket).

The h11 parser is used (not httptools) because it bounds header size and lets us see the header phase end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, ClassVar

import h11

try:  # FIONREAD: unread bytes on a socket (POSIX)
    import fcntl
    import termios
except ImportError:  # pragma: no cover
    fcntl = termios = None  # type: ignore[assignment]
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

EVICTION_GRACE_S = 0.05
# A new connection that has sent nothing yet is a client still on its way (a burst opens many before writing any):
# it is closed to make room only after this long. One that sent part of its headers, or sits between requests, may be
# closed at once.
FRESH_GRACE_S = 1.0
# Longest a connection lingers after its last response when its client is still sending (an unread body, a refusal).
LINGER_S = 2.0
CONNECTION_EXTENSION = "tts.connection"
# scope["state"] key: time.monotonic() when the request's headers arrived (the read that completed them).
ARRIVED_AT = "arrived_at"


@dataclass(frozen=True)
class ConnectionLimits:
    """The TTS_* settings of the same names (their defaults and ranges live in settings.py)."""

    header_timeout: float
    keep_alive_timeout: float
    max_header_bytes: int
    max_connections: int
    max_connections_per_client: int
    retry_after: int
    # Told the reason of each refusal or close this layer makes (the server counts them in tts_rejections_total).
    on_refusal: Callable[[str], None] | None = field(default=None, compare=False)


def _error_bytes(status: int, message: str, type_: str, code: str, extra: dict[str, str] | None = None) -> bytes:
    """A complete HTTP/1.1 response with the JSON error shape, written raw: h11 refuses to send a response
    while it has not parsed a request, which is exactly when these are needed."""
    request_id = uuid.uuid4().hex
    body = json.dumps(error_body(status, message, type_, code, None, request_id)).encode()
    headers = {
        "content-type": "application/json",
        "content-length": str(len(body)),
        "connection": "close",
        "x-request-id": request_id,
        **(extra or {}),
    }
    head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode("latin-1") + b"\r\n" + body


async def _send_error(send: Send, status: int, message: str, type_: str, code: str) -> None:
    """One JSON error from an ASGI app, closing the connection after it."""
    request_id = uuid.uuid4().hex
    body = json.dumps(error_body(status, message, type_, code, None, request_id)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        (b"x-request-id", request_id.encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def framing_error(scope: Scope) -> tuple[int, str, str] | None:
    """(status, message, code) when the request's framing must not reach the app, else None."""
    if scope.get("http_version") not in ("1.0", "1.1"):
        return 505, f"HTTP/{scope.get('http_version')} is not supported (use HTTP/1.1)", "http_version_not_supported"
    names = {name.lower() for name, _ in scope.get("headers", [])}
    if b"transfer-encoding" in names and b"content-length" in names:
        return 400, "Content-Length and Transfer-Encoding together are refused (RFC 9112 6.1)", "invalid_http"
    return None


class Connection:
    """What the app may do to its connection (scope["extensions"][CONNECTION_EXTENSION])."""

    def __init__(self, protocol: HygienicH11Protocol):
        self._protocol = protocol

    def abort(self) -> None:
        """Drop the connection now with a reset, discarding what is queued here and in the kernel: for a client that
        stopped reading (a plain close would leave the kernel trying to deliver its buffer for minutes)."""
        transport = self._protocol.real_transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: `close()` while the client is still sending a body lingers
    (see the module docstring) instead of closing over unread bytes, which the kernel answers with a reset that can
    destroy the response on its way. Everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, protocol: HygienicH11Protocol):
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        if self._protocol.conn.their_state is h11.SEND_BODY:
            self._protocol.linger()
        else:
            self._transport.close()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HygienicH11Protocol(H11Protocol):
    """uvicorn's H11Protocol plus the limits above. `limits` is set on a subclass by `protocol_class`."""

    limits: ClassVar[ConnectionLimits]

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # our caps replace uvicorn's (which answers in plain text)
        self.timeout_keep_alive = self.limits.keep_alive_timeout
        self._header_timer: asyncio.TimerHandle | None = None
        self._idle_since = time.monotonic()
        self._client_key: str | None = None
        self._evicting = False
        self._bytes_seen = 0
        self.lingering = False
        self._linger_timer: asyncio.TimerHandle | None = None
        self.real_transport: asyncio.Transport | None = None

    # --- connection accounting -------------------------------------------------------------------------
    def _per_client(self) -> dict[str, int]:
        counts = getattr(self.server_state, "tts_per_client", None)
        if counts is None:
            counts = self.server_state.tts_per_client = {}  # type: ignore[attr-defined]
        return counts

    def _count(self, reason: str) -> None:
        if self.limits.on_refusal is not None:
            self.limits.on_refusal(reason)

    def _idle(self) -> bool:
        """Between requests or still sending headers: closing it loses no work."""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _evictable(self) -> bool:
        """Idle, and not a new connection whose client has simply not written yet (FRESH_GRACE_S)."""
        fresh = self.cycle is None and self._bytes_seen == 0
        return self._idle() and (not fresh or self._idle_age() >= FRESH_GRACE_S)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.real_transport = transport
        self.transport = _LingeringTransport(transport, self)  # type: ignore[assignment]
        self.app = self._guarded(self.app)
        lim = self.limits
        self._client_key = self.client[0] if self.client else "?"
        counts = self._per_client()
        counts[self._client_key] = counts.get(self._client_key, 0) + 1
        self._arm_header_timer()
        retry = {"retry-after": str(lim.retry_after)}
        if counts[self._client_key] > lim.max_connections_per_client and not self._evict_idle(self._client_key):
            self._count("client_connection_limit")
            message = f"too many connections from this client (limit {lim.max_connections_per_client})"
            self._refuse(_error_bytes(429, message, "rate_limit_error", "too_many_connections", retry))
        elif len(self.connections) > lim.max_connections and not self._evict_idle():
            self._count("connection_limit")
            message = f"server is at its connection limit ({lim.max_connections}); retry later"
            self._refuse(_error_bytes(503, message, "service_unavailable", "too_many_connections", retry))

    def _guarded(self, app: Any) -> Any:
        """The app behind the framing checks, with the connection handed to it as a scope extension."""
        connection = Connection(self)

        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                refused = framing_error(scope)
                if refused is not None:
                    status, message, code = refused
                    self._count("invalid_http")
                    await _send_error(send, status, message, "invalid_request_error", code)
                    return
            scope.setdefault("extensions", {})[CONNECTION_EXTENSION] = connection
            await app(scope, receive, send)

        return guarded

    def _refuse(self, response: bytes) -> None:
        """Answer a connection over a cap at once and let it go: it holds no slot while it lingers."""
        self._release_client()
        self.connections.discard(self)
        self.real_transport.write(response)
        self.linger()

    def linger(self) -> None:
        """Stop answering: send what is queued, then FIN; discard what the client still sends; abort after LINGER_S
        (or close as soon as the client closes its side)."""
        if self.lingering or self.real_transport.is_closing():
            return
        self.lingering = True
        self._cancel_header_timer()
        self._unset_keepalive_if_required()
        transport = self.real_transport
        transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, transport.abort)

    def _evict_idle(self, client: str | None = None) -> bool:
        """Close the longest-idle other connection (of `client`, if given); False if every candidate is busy."""
        idle = [
            c
            for c in self.connections
            if c is not self
            and isinstance(c, HygienicH11Protocol)
            and c._evictable()
            and not c._evicting
            and not c.lingering
            and not c.transport.is_closing()
            and (client is None or c._client_key == client)
        ]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c._idle_since)
        victim._evicting = True
        self.logger.info("connection limit reached: closing a connection idle for %.1f s", victim._idle_age())
        # A moment's grace lets the loop read bytes already on their way (closing over unread bytes is a bare
        # reset, with no 408 to say why).
        self.loop.call_later(EVICTION_GRACE_S, victim._evict)
        return True

    def _evict(self) -> None:
        # Bytes already in the socket's receive queue mean a request on its way that a busy loop has not read yet
        # (a burst of new connections): that connection is not idle, and closing it would reset a working client.
        if self._idle() and not self._unread_bytes():
            self._count("idle_evicted")
            self._close("connection closed to make room: no complete request headers arrived")
        else:
            self._evicting = False

    def _unread_bytes(self) -> int:
        """Bytes the kernel holds for this connection that the loop has not read (0 where that cannot be asked)."""
        sock = self.real_transport.get_extra_info("socket")
        if sock is None or fcntl is None:
            return 0
        try:
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            return 0

    def _idle_age(self) -> float:
        return time.monotonic() - self._idle_since

    def _release_client(self) -> None:
        counts = self._per_client()
        if self._client_key is not None:
            left = counts.get(self._client_key, 1) - 1
            if left > 0:
                counts[self._client_key] = left
            else:
                counts.pop(self._client_key, None)
            self._client_key = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        self._release_client()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        """The WebSocket protocol takes the transport over (and its own connection_lost): release the accounting."""
        self._cancel_header_timer()
        self._release_client()
        self.transport = self.real_transport  # type: ignore[assignment]
        super().handle_websocket_upgrade(event)

    # --- header phase --------------------------------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._idle() and not self.transport.is_closing():
            self._count("header_timeout")
            self._close(f"request headers not received within {self.limits.header_timeout:g} s")

    def _close(self, message: str) -> None:
        """Close an idle connection; if the client had started a request, answer 408 with the reason first."""
        if self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:
            self.transport.write(_error_bytes(408, message, "invalid_request_error", "header_timeout"))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a body (or a request) nobody will answer
        self._bytes_seen += len(data)
        if self.conn.their_state is h11.IDLE and self._headers_too_large(data):
            self._cancel_header_timer()
            self._count("headers_too_large")
            self.real_transport.write(self._too_large())
            self.linger()  # the client is likely still sending its headers: let it read the 431
            return
        arrived, cycle = time.monotonic(), self.cycle
        super().data_received(data)
        if self.cycle is not cycle and self.cycle is not None:
            # This read completed a request's headers. Its task has not run yet (the app's own clock starts when it
            # does, which in a burst can be much later): the request's arrival is now.
            self.cycle.scope.setdefault("state", {})[ARRIVED_AT] = arrived
        if self._header_timer is not None and self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # headers are complete; the body has its own timeout (TTS_BODY_TIMEOUT)

    def on_response_complete(self) -> None:
        self._idle_since = time.monotonic()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.linger()  # answered before its body was read: the rest is not wanted, and neither is the connection
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the next request's headers must come in time too

    # --- parser errors -------------------------------------------------------------------------------------
    def _headers_too_large(self, data: bytes = b"") -> bool:
        """Checked before h11 parses: h11 bounds only incomplete headers, so a large header block arriving in one
        read would pass it."""
        buffered = self.conn.trailing_data[0] + data
        end = buffered.find(b"\r\n\r\n")
        return (len(buffered) if end < 0 else end) > self.limits.max_header_bytes

    def _too_large(self) -> bytes:
        message = f"request headers are larger than the limit of {self.limits.max_header_bytes} bytes"
        return _error_bytes(431, message, "invalid_request_error", "headers_too_large")

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this on any h11 parse error; answer 431 for oversized headers, else 400, in JSON."""
        self._cancel_header_timer()
        if self._headers_too_large():
            self._count("headers_too_large")
            data = self._too_large()
        else:
            self._count("invalid_http")
            data = _error_bytes(400, "malformed HTTP request", "invalid_request_error", "invalid_http")
        self.real_transport.write(data)
        self.linger()


def protocol_class(limits: ConnectionLimits) -> type[HygienicH11Protocol]:
    """The protocol class to hand to uvicorn.Config(http=...), bound to `limits`."""
    return type("BoundHygienicH11Protocol", (HygienicH11Protocol,), {"limits": limits})


def uvicorn_options(limits: ConnectionLimits) -> dict[str, Any]:
    """uvicorn.Config keyword arguments that install the protocol and the limits uvicorn enforces itself."""
    return {
        "http": protocol_class(limits),
        "h11_max_incomplete_event_size": limits.max_header_bytes,
        "timeout_keep_alive": limits.keep_alive_timeout,
        "limit_concurrency": None,
    }
