"""Pure-ASGI middleware: request ids, access accounting and the request deadline, API keys, body size limit and
upload bytes in flight, HEAD, WebSocket refusals, stream aborts.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect messages pass through untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import secrets
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import anyio
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import logs
from .errors import (
    ApiError,
    BodyTimeout,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
    error_body,
)
from .http_server import CONNECTION_EXTENSION

logger = logging.getLogger("tts_server.access")

_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def loggable_path(path: str) -> str:
    """The path re-encoded as it travels in a URL: a client cannot forge log lines with %0a or write raw NULs."""
    return urllib.parse.quote(path, safe="/!$&'()*+,;=:@-._~")


class StreamAborted(Exception):
    """Raised inside a streaming body to end the connection without a clean end of stream (so the client
    knows its audio is incomplete). `status` is what the access log and metrics record."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


def abort_connection(scope: Scope) -> None:
    """Cut the request's connection now (a reset, discarding unsent bytes) where the server offers it
    (tts_server/http_server.py); a blocked send then returns at once instead of waiting on a client that does not
    read."""
    connection = scope.get("extensions", {}).get(CONNECTION_EXTENSION)
    if connection is not None:
        connection.abort()


def _error_message(exc: ApiError, request_id: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(error_body(exc.status, exc.message, exc.type, exc.code, exc.param, request_id)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    return headers, body


async def send_error(send: Send, exc: ApiError, request_id: str) -> None:
    headers, body = _error_message(exc, request_id)
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def deny_websocket(scope: Scope, send: Send, exc: ApiError, request_id: str) -> None:
    """Refuse a WebSocket handshake with an HTTP response in the error shape (the ASGI denial-response extension);
    a server without it can only close."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    headers, body = _error_message(exc, request_id)
    headers.append((b"x-request-id", request_id.encode()))
    await send({"type": "websocket.http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


class RequestContextMiddleware:
    """Outermost layer: assigns the request id (echoes a safe client X-Request-Id), adds it to every response,
    counts responses by route and status, logs one access line, and turns StreamAborted into a cut
    connection instead of an 'unhandled exception' traceback.

    It also holds every request to `timeout` seconds from its arrival, whatever it awaits (a body, the engine, a
    send blocked on a client that does not read): past it, a request with no response yet gets 504, one whose
    response has started has its connection cut. Routes keep their own, earlier deadlines (TTS_REQUEST_TIMEOUT);
    this one is the floor under all of them. HEAD is answered as GET without the body, and a WebSocket handshake
    that no route accepts is refused in the error shape."""

    def __init__(
        self,
        app: ASGIApp,
        on_response: Callable[[str, int], None],
        routes: Iterable[str],
        timeout: float | None = None,
        websocket_paths: Iterable[str] = (),
    ):
        self.app = app
        self.on_response = on_response
        self.routes = set(routes)
        self.timeout = timeout
        self.websocket_paths = set(websocket_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._with_request_id(self._websocket_handshake, scope, receive, send)
        elif scope["type"] == "http":
            await self._with_request_id(self._http, scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _with_request_id(
        self, handle: Callable[[Scope, Receive, Send, str], Awaitable[None]], scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Run `handle` with the request's id; this task's log records carry it meanwhile (tts_server/logs.py)."""
        request_id = self._request_id(scope)
        logged_as = logs.request_id.set(request_id)
        try:
            await handle(scope, receive, send, request_id)
        finally:
            logs.request_id.reset(logged_as)

    async def _http(self, scope: Scope, receive: Receive, send: Send, request_id: str) -> None:
        started = time.monotonic()
        state = scope.setdefault("state", {})
        state["request_id"], state["received_at"] = request_id, started
        status = 0
        complete = client_gone = False
        inner_scope = scope
        if scope.get("method") == "HEAD":
            # The server drops the body of a HEAD response; the app answers the GET it stands for.
            inner_scope = {**scope, "method": "GET"}

        async def send_with_id(message: Message) -> None:
            nonlocal status, complete
            last = message["type"] == "http.response.body" and not message.get("more_body", False)
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode()))
                message["headers"] = headers
            await send(message)
            if last:
                complete = True  # once the server has taken it: a send blocked on a full socket has not finished

        async def watch_receive() -> Message:
            nonlocal client_gone
            message = await receive()
            if message["type"] == "http.disconnect" and not complete:
                client_gone = True
            return message

        try:
            with anyio.move_on_after(self.timeout if self.timeout is not None else float("inf")) as deadline:
                await self.app(inner_scope, watch_receive, send_with_id)
            if deadline.cancelled_caught:
                if status and not complete:
                    status, complete = RequestTimeout.status, True
                await self._past_deadline(scope, send_with_id, request_id, started=status != 0)
        except StreamAborted as e:
            logger.warning("request %s: stream aborted: %s", request_id, e)
            if e.status == RequestTimeout.status:
                abort_connection(scope)  # past its deadline: not one more byte, and no wait on a full socket
            if status and not complete and e.status != 500:
                status, complete = e.status, True  # recorded as it ended (a timeout), not as a failure of ours
        finally:
            path = scope.get("path", "")
            route = path if path in self.routes else "other"
            if status and not complete:  # the headers went out but not the whole body
                status = 499 if client_gone else 500
            self.on_response(route, status or 499)
            logger.info(
                '%s "%s %s" %s %.3fs',
                request_id,
                scope.get("method", ""),
                loggable_path(path if route != "other" else path[:80]),
                status or "-",
                time.monotonic() - started,
            )

    async def _past_deadline(self, scope: Scope, send: Send, request_id: str, started: bool) -> None:
        logger.warning("request %s: cut at the server's deadline of %g s", request_id, self.timeout)
        if started:
            abort_connection(scope)
            return
        error = RequestTimeout(f"request took longer than the limit of {self.timeout:g} s")
        with anyio.move_on_after(1.0) as cut:
            await send_error(send, error, request_id)
        if cut.cancelled_caught:
            abort_connection(scope)

    @staticmethod
    def _request_id(scope: Scope) -> str:
        given = dict(scope.get("headers", [])).get(b"x-request-id", b"").decode("latin-1")
        return given if _CLIENT_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex

    async def _websocket_handshake(self, scope: Scope, receive: Receive, send: Send, request_id: str) -> None:
        """A handshake: refused in the error shape (404 where no route takes WebSockets, 403 where the route closes
        before accepting), with an access line like any request."""
        started = time.monotonic()
        scope.setdefault("state", {})["request_id"] = request_id
        status = 0

        async def send_checked(message: Message) -> None:
            nonlocal status
            if message["type"] == "websocket.close" and not status:
                known = scope.get("path") in self.websocket_paths
                error: ApiError = (
                    ApiError("WebSocket connection refused", code="websocket_refused")
                    if known
                    else NotFound(f"no WebSocket endpoint at {loggable_path(scope.get('path', ''))[:80]}")
                )
                if known:
                    error.status, error.type = 403, "permission_error"
                status = error.status
                await deny_websocket(scope, send, error, request_id)
                return
            if message["type"] == "websocket.accept":
                status = 101
            elif message["type"] == "websocket.http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_checked)
        finally:
            logger.info(
                '%s "WEBSOCKET %s" %s %.3fs',
                request_id,
                loggable_path(scope.get("path", ""))[:80],
                status or "-",
                time.monotonic() - started,
            )


class ApiKeyMiddleware:
    """Bearer API keys, compared as SHA-256 digests in constant time; `public` paths and CORS preflight pass.

    A WebSocket handshake on one of `token_paths` without an Authorization header (a browser cannot set one) is let
    through with `scope["state"]["api_key_check"]`, the key check, which its route must apply to the key the client
    sends as its first message."""

    def __init__(self, app: ASGIApp, keys: list[str], public: Iterable[str], token_paths: Iterable[str] = ()):
        self.app = app
        self.digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        self.public = set(public)
        self.token_paths = set(token_paths)

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        return self.key_ok(token)

    def key_ok(self, token: str) -> bool:
        """Whether `token` is one of the keys."""
        if not token.strip():
            return False
        given = hashlib.sha256(token.strip().encode("utf-8", "surrogatepass")).digest()
        # Compare against every key (no early exit) so timing does not tell which one is close.
        ok = False
        for digest in self.digests:
            ok |= secrets.compare_digest(given, digest)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or not self.digests or scope.get("path") in self.public:
            await self.app(scope, receive, send)
            return
        if kind == "http" and scope.get("method") == "OPTIONS":  # CORS preflight carries no credentials
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
        if kind == "websocket" and not header and scope.get("path") in self.token_paths:
            scope.setdefault("state", {})["api_key_check"] = self.key_ok
            await self.app(scope, receive, send)
            return
        if self._authorized(header):
            await self.app(scope, receive, send)
            return
        message = "missing API key (send 'Authorization: Bearer <key>')" if not header else "invalid API key"
        error = Unauthorized(message, headers={"WWW-Authenticate": "Bearer"})
        request_id = scope.get("state", {}).get("request_id", "")
        if kind == "websocket":
            await deny_websocket(scope, send, error, request_id)
        else:
            await send_error(send, error, request_id)


class UploadBudget:
    """Bytes of upload bodies in flight, in all (read, parsed, decoded, enrolled): each upload holds its declared size
    (or the per-upload limit when it declares none) from before its first byte is read until its response."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.held = 0

    def try_take(self, n: int) -> bool:
        if self.held + n > self.max_bytes:
            return False
        self.held += n
        return True

    def give_back(self, n: int) -> None:
        self.held -= n


@dataclass(frozen=True)
class BodyLimit:
    """A path's own body limit, with what its 413 says beyond the number: where the limit comes from, and the
    request field the bytes are for."""

    max_bytes: int
    reason: str = ""
    param: str | None = None

    def error(self) -> PayloadTooLarge:
        why = f" ({self.reason})" if self.reason else ""
        return PayloadTooLarge(
            f"request body is larger than the limit of {self.max_bytes} bytes{why}", param=self.param
        )


class BodyLimitMiddleware:
    """Reads the whole request body up front (our bodies are small JSON) and answers 413 past `max_bytes`, or
    408 if it does not arrive within `timeout` s (a trickling client cannot hold a connection forever),
    before any route code runs; then replays it, and passes later messages (disconnects) through.

    `per_path`: paths with their own size limit (the voice upload's clip), whose bodies also draw on `budget` (429
    with Retry-After when it is spent). `refused`: POST paths answered with their error before any of the body is
    read (the upload route while uploads are off: 403, not a 413 about a body nobody would read)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout: float,
        per_path: dict[str, int | BodyLimit] | None = None,
        budget: UploadBudget | None = None,
        refused: dict[str, ApiError] | None = None,
        retry_after: int = 1,
    ):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.per_path = {p: v if isinstance(v, BodyLimit) else BodyLimit(v) for p, v in (per_path or {}).items()}
        self.budget = budget
        self.refused = refused or {}
        self.retry_after = retry_after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        request_id = scope.get("state", {}).get("request_id", "")
        path = scope.get("path", "")
        if scope.get("method") == "POST" and path in self.refused:  # other methods get the route's 405
            await send_error(send, self.refused[path], request_id)
            return
        limit = self.per_path.get(path, BodyLimit(self.max_bytes))
        max_bytes, too_large = limit.max_bytes, limit.error()
        declared = dict(scope.get("headers", [])).get(b"content-length")
        size = max_bytes
        if declared is not None:
            with contextlib.suppress(ValueError):  # h11 has checked it is digits; keep the limit if not
                size = int(declared)
            if size > max_bytes:
                await send_error(send, too_large, request_id)
                return
        held = 0
        if path in self.per_path and self.budget is not None:
            if not self.budget.try_take(size):
                busy = Overloaded(
                    f"too many uploads in progress ({self.budget.max_bytes} bytes in flight at most); retry later",
                    code="uploads_in_flight",
                    headers={"Retry-After": str(self.retry_after)},
                )
                await send_error(send, busy, request_id)
                return
            held = size
        try:
            await self._read_and_call(scope, receive, send, max_bytes, too_large, request_id)
        finally:
            if held:
                self.budget.give_back(held)

    async def _read_and_call(
        self, scope: Scope, receive: Receive, send: Send, max_bytes: int, too_large: ApiError, request_id: str
    ) -> None:
        body = bytearray()
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                late = BodyTimeout(f"request body not received within {self.timeout:g} s")
                await send_error(send, late, request_id)
                return
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            body += message.get("body", b"")
            if len(body) > max_bytes:
                await send_error(send, too_large, request_id)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class JsonCORSMiddleware(CORSMiddleware):
    """Starlette's CORS middleware, with a refused preflight answered in the API's JSON error shape (Starlette
    answers it in plain text)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "OPTIONS":
            headers = Headers(scope=scope)
            if "origin" in headers and "access-control-request-method" in headers:
                response = self.preflight_response(request_headers=headers)
                if response.status_code == 400:
                    reason = response.body.decode(errors="replace")  # "Disallowed CORS origin, method"
                    request_id = scope.get("state", {}).get("request_id", "")
                    keep = {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}
                    body = error_body(400, f"CORS preflight refused: {reason}", "invalid_request_error", "cors_refused",
                                      None, request_id)  # fmt: skip
                    response = JSONResponse(body, status_code=400, headers=keep)
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
