"""The request deadline covers every send: a response whose client has stopped reading (its `send` never returns, as
on a full socket) is cut at TTS_REQUEST_TIMEOUT, its engine work cancelled, its connection aborted; the server-wide
floor in RequestContextMiddleware does the same for any route. Driven at the ASGI level with a `send` that blocks,
which a real socket shows only once the kernel's buffers are full (tests/test_hardening_connections.py)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from qwen_tts.engines.fake import FakeEngine
from server_helpers import http_scope, in_process, write_voice
from tts_server.http_server import CONNECTION_EXTENSION
from tts_server.middleware import RequestContextMiddleware

TIMEOUT = 1.0


class BlockedClient:
    """An ASGI peer that sends one request, takes the response head and then stops reading: every later send waits
    for ever. Records whether the server aborted the connection."""

    def __init__(self, body: dict[str, Any], reads: int = 1):
        self.body = json.dumps(body).encode()
        self.reads = reads
        self.sent: list[dict] = []
        self.aborted = asyncio.Event()
        self._asked = False

    def scope(self, path: str) -> dict[str, Any]:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(self.body)).encode())]
        return http_scope(path, headers, extensions={CONNECTION_EXTENSION: self})

    def abort(self) -> None:
        self.aborted.set()

    async def receive(self) -> dict[str, Any]:
        if not self._asked:
            self._asked = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.aborted.wait()  # the client is still there: no disconnect until the connection is cut
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if len(self.sent) >= self.reads:
            await asyncio.Event().wait()  # a full socket: never drains
        self.sent.append(message)


LONG = {"speaker_id": "alice", "text": "x" * 400, "min_new_tokens": 400, "max_new_tokens": 400}


@pytest.mark.parametrize(("path", "reads"), [("/synthesize/stream", 2), ("/synthesize", 1), ("/v1/audio/speech", 2)])
async def test_a_response_blocked_on_send_is_cut_at_the_request_timeout(tmp_path, path: str, reads: int) -> None:
    write_voice(tmp_path, "alice", 16)
    engine = FakeEngine(frame_delay=0.0005)
    async with in_process(engine, profiles_dir=tmp_path, request_timeout=TIMEOUT) as s:
        body = {**LONG, "model": "tts-1", "voice": "alice", "input": LONG["text"]} if path.startswith("/v1") else LONG
        if path.startswith("/v1"):
            body = {k: v for k, v in body.items() if k not in ("speaker_id", "text")} | {"response_format": "pcm"}
        client = BlockedClient(body, reads=reads)
        started = time.monotonic()
        # Not bounded by the test: the server must return on its own, by the deadline and its grace.
        await asyncio.wait_for(s.app(client.scope(path), client.receive, client.send), timeout=TIMEOUT + 10)
        took = time.monotonic() - started
        assert client.sent[0]["type"] == "http.response.start" and client.sent[0]["status"] == 200, client.sent
        assert client.aborted.is_set()
        assert TIMEOUT <= took < TIMEOUT + 5
        assert s.runtime.admission.active == 0
        # A whole file was synthesized in time and then not taken; a stream's synthesis itself ran out of time.
        whole = path == "/synthesize"
        assert s.runtime.metrics.syntheses.labels("timeout")._value.get() == (0 if whole else 1)
        assert s.runtime.metrics.syntheses.labels("ok")._value.get() == (1 if whole else 0)
        if not whole:
            assert engine.cancelled  # its engine work was still running, and was cancelled
        assert s.runtime.metrics.requests.labels(path, "504")._value.get() == 1


async def test_the_server_wide_deadline_cuts_any_route_blocked_on_send() -> None:
    async def app(scope, receive, send) -> None:  # answers at once, then its client stops reading
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b"})

    statuses: list[int] = []
    guarded = RequestContextMiddleware(app, on_response=lambda route, status: statuses.append(status), routes=[],
                                       timeout=0.5)  # fmt: skip
    client = BlockedClient({}, reads=1)
    await asyncio.wait_for(guarded(client.scope("/anything"), client.receive, client.send), timeout=5)
    assert client.aborted.is_set() and statuses == [504]

    async def slow(scope, receive, send) -> None:  # nothing sent before the deadline: 504 in the error shape
        await asyncio.sleep(30)

    statuses.clear()
    guarded = RequestContextMiddleware(slow, on_response=lambda route, status: statuses.append(status), routes=[],
                                       timeout=0.5)  # fmt: skip
    client = BlockedClient({}, reads=2)
    await asyncio.wait_for(guarded(client.scope("/anything"), client.receive, client.send), timeout=5)
    assert statuses == [504] and client.sent[0]["status"] == 504
    doc = json.loads(client.sent[1]["body"])
    assert doc["error"]["code"] == "request_timeout" and "0.5 s" in doc["error"]["message"]
    assert not client.aborted.is_set()
