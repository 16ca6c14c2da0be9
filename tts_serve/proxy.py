"""Serve's own refusals in our error shape, on Serve's HTTP proxy.

Serve's proxy answers some requests itself, in plain text: backpressure (max_queued_requests; 429 or 503 with
Retry-After from the deployment's backpressure config), no replica available (503), a replica that died while
handling the request (500). `proxy_middlewares` (named by RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, set by
the CLI before Ray starts) rewrites exactly those into the server's JSON error body with Retry-After on 429
and 503, so clients see one error shape whether a replica or the proxy refused. Responses from a replica (JSON
errors, audio) pass through untouched: a replica's error is already JSON.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tts_server.errors import error_body

CALLBACK_PATH = "tts_serve.proxy.proxy_middlewares"
RETRY_AFTER_S = "1"
_CODES = {
    429: ("rate_limit_error", "server_overloaded", "all replicas are at capacity; retry later"),
    503: ("service_unavailable", "not_ready", "no replica is available; retry later"),
    500: ("server_error", "replica_failed", "the replica serving this request failed; retry"),
}


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


class ServeErrorShape:
    """Raw ASGI middleware: a non-JSON 429/500/503 from the proxy becomes our JSON error (with its request id);
    duplicate header lines are dropped."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = ""
        for k, v in scope.get("headers", []):
            if k == b"x-request-id":
                request_id = v.decode("latin-1")[:128]
        held: dict[str, Any] = {}
        started = False

        async def send_shaped(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                # Serve's proxy repeats the replica's X-Request-Id; send each header line once.
                headers = list(dict.fromkeys((k.lower(), v) for k, v in message.get("headers", [])))
                message = {**message, "headers": headers}
                ctype = _header(headers, b"content-type") or b""
                if message["status"] in _CODES and not ctype.startswith(b"application/json"):
                    held["start"] = {**message, "headers": headers}
                    return
                await send(message)
                return
            if "start" in held and message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # the proxy's plain-text message is dropped; ours replaces it
                await send_error(held.pop("start"))
                return
            await send(message)

        async def send_error(start: Message) -> None:
            status = start["status"]
            type_, code, message = _CODES[status]
            rid = request_id or _header(start["headers"], b"x-request-id") or uuid.uuid4().hex
            rid = rid.decode("latin-1") if isinstance(rid, bytes) else rid
            body = json.dumps(error_body(status, message, type_, code, None, rid)).encode()
            headers = [(k, v) for k, v in start["headers"] if k.lower() not in (b"content-type", b"content-length")]
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            if status in (429, 503) and _header(headers, b"retry-after") is None:
                headers.append((b"retry-after", RETRY_AFTER_S.encode()))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        try:
            await self.app(scope, receive, send_shaped)
        except Exception:
            if started:
                raise  # headers are out: the connection is cut, the client sees an incomplete body
            await send_error({"status": 500, "headers": []})
            return
        if not started:
            # The replica died before answering: the proxy sends nothing (uvicorn would add a plain-text 500).
            await send_error({"status": 500, "headers": []})


def proxy_middlewares() -> list[Middleware]:
    """Serve's HTTP proxy callback: the middlewares its proxy wraps every request in."""
    return [Middleware(ServeErrorShape)]
