"""Pure-ASGI middleware: request ids and access accounting, API keys, body size limit, stream aborts.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect messages pass through untouched.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import secrets
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ApiError, BodyTimeout, PayloadTooLarge, Unauthorized, error_body

logger = logging.getLogger("tts_server.access")

_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def loggable_path(path: str) -> str:
    """The path re-encoded as it travels in a URL: a client cannot forge log lines with %0a or write raw NULs."""
    return urllib.parse.quote(path, safe="/!$&'()*+,;=:@-._~")


class StreamAborted(Exception):
    """Raised inside a streaming body to end the connection without a clean end of stream (so the client
    knows its audio is incomplete)."""


async def send_error(send: Send, exc: ApiError, request_id: str) -> None:
    import json

    body = json.dumps(error_body(exc.status, exc.message, exc.type, exc.code, exc.param, request_id)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestContextMiddleware:
    """Outermost layer: assigns the request id (echoes a safe client X-Request-Id), adds it to every response,
    counts responses by route and status, logs one access line, and turns StreamAborted into a cut
    connection instead of an 'unhandled exception' traceback."""

    def __init__(self, app: ASGIApp, on_response: Callable[[str, int], None], routes: Iterable[str]):
        self.app = app
        self.on_response = on_response
        self.routes = set(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", [])).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _CLIENT_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        started = time.monotonic()
        state = scope.setdefault("state", {})
        state["request_id"], state["received_at"] = request_id, started
        status = 0
        complete = client_gone = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode()))
                message["headers"] = headers
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        async def watch_receive() -> Message:
            nonlocal client_gone
            message = await receive()
            if message["type"] == "http.disconnect" and not complete:
                client_gone = True
            return message

        try:
            await self.app(scope, watch_receive, send_with_id)
        except StreamAborted as e:
            logger.warning("request %s: stream aborted: %s", request_id, e)
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


class ApiKeyMiddleware:
    """Bearer API keys, compared as SHA-256 digests in constant time; `public` paths and CORS preflight pass."""

    def __init__(self, app: ASGIApp, keys: list[str], public: Iterable[str]):
        self.app = app
        self.digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        self.public = set(public)

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        given = hashlib.sha256(token.strip().encode()).digest()
        # Compare against every key (no early exit) so timing does not tell which one is close.
        ok = False
        for digest in self.digests:
            ok |= secrets.compare_digest(given, digest)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.digests or scope.get("path") in self.public:
            await self.app(scope, receive, send)
            return
        if scope.get("method") == "OPTIONS":  # CORS preflight carries no credentials
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
        if self._authorized(header):
            await self.app(scope, receive, send)
            return
        message = "missing API key (send 'Authorization: Bearer <key>')" if not header else "invalid API key"
        error = Unauthorized(message, headers={"WWW-Authenticate": "Bearer"})
        await send_error(send, error, scope.get("state", {}).get("request_id", ""))


class BodyLimitMiddleware:
    """Reads the whole request body up front (our bodies are small JSON) and answers 413 past `max_bytes`, or
    408 if it does not arrive within `timeout` s (a trickling client cannot hold a connection forever),
    before any route code runs; then replays it, and passes later messages (disconnects) through."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float, per_path: dict[str, int] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.per_path = per_path or {}  # paths with their own limit (the voice upload's clip)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        request_id = scope.get("state", {}).get("request_id", "")
        max_bytes = self.per_path.get(scope.get("path", ""), self.max_bytes)
        too_large = PayloadTooLarge(f"request body is larger than the limit of {max_bytes} bytes")
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None:
            try:
                if int(declared) > max_bytes:
                    await send_error(send, too_large, request_id)
                    return
            except ValueError:
                pass
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
