"""A WebSocket client for driving the app in process over ASGI (no socket): the messages each side sends are queues,
and `reading` can be switched off to play a client that stops reading (the app's sends then block)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np

from qwen_tts.engine_api import FRAME_SAMPLES
from tts_server.realtime import WS_PATH


class WsClosed(Exception):
    """The app closed the connection (or refused the handshake); `message` is what it sent."""

    def __init__(self, message: dict[str, Any]):
        super().__init__(message)
        self.message = message


class AsgiWebSocket:
    def __init__(
        self,
        app: Any,
        path: str = WS_PATH,
        headers: list[tuple[bytes, bytes]] | None = None,
        client: tuple[str, int] = ("127.0.0.1", 5000),
    ):
        self.app = app
        self.to_app: asyncio.Queue = asyncio.Queue()
        self.from_app: asyncio.Queue = asyncio.Queue()
        self.reading = asyncio.Event()
        self.reading.set()
        self.scope = {
            "type": "websocket",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "scheme": "ws",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"testserver"), *(headers or [])],
            "client": client,
            "server": ("testserver", 80),
            "subprotocols": [],
            "extensions": {"websocket.http.response": {}},
        }
        self.task: asyncio.Task | None = None
        self.accepted = False

    async def _receive(self) -> dict[str, Any]:
        return await self.to_app.get()

    async def _send(self, message: dict[str, Any]) -> None:
        await self.reading.wait()
        await self.from_app.put(message)

    async def connect(self, timeout: float = 5.0) -> dict[str, Any]:
        """The handshake: returns the accept message; raises WsClosed with the denial (the HTTP response start,
        its body under `body`) or the close."""
        self.task = asyncio.ensure_future(self.app(self.scope, self._receive, self._send))
        await self.to_app.put({"type": "websocket.connect"})
        first = await asyncio.wait_for(self.from_app.get(), timeout)
        if first["type"] == "websocket.http.response.start":
            body = await asyncio.wait_for(self.from_app.get(), timeout)
            raise WsClosed({**first, "body": json.loads(body["body"])})
        if first["type"] != "websocket.accept":
            raise WsClosed(first)
        self.accepted = True
        return first

    async def send_json(self, obj: Any) -> None:
        await self.to_app.put({"type": "websocket.receive", "text": json.dumps(obj)})

    async def send_text(self, text: str) -> None:
        await self.to_app.put({"type": "websocket.receive", "text": text})

    async def send_bytes(self, data: bytes) -> None:
        await self.to_app.put({"type": "websocket.receive", "bytes": data})

    async def disconnect(self, code: int = 1001) -> None:
        await self.to_app.put({"type": "websocket.disconnect", "code": code})

    async def next(self, timeout: float = 5.0) -> dict[str, Any] | bytes:
        """The next thing the app sent: a JSON event as a dict, a binary frame as bytes; WsClosed on a close."""
        message = await asyncio.wait_for(self.from_app.get(), timeout)
        if message["type"] == "websocket.close":
            raise WsClosed(message)
        assert message["type"] == "websocket.send", message
        if message.get("bytes") is not None:
            return message["bytes"]
        return json.loads(message["text"])

    async def event(self, timeout: float = 5.0) -> dict[str, Any]:
        item = await self.next(timeout)
        assert isinstance(item, dict), f"expected an event, got {len(item)} bytes"
        return item

    async def until(self, kind: str, timeout: float = 10.0) -> tuple[dict[str, Any], list[dict[str, Any] | bytes]]:
        """Read until an event of type `kind`; it and everything before it."""
        seen: list[dict[str, Any] | bytes] = []
        while True:
            item = await self.next(timeout)
            if isinstance(item, dict) and item.get("type") == kind:
                return item, seen
            seen.append(item)

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            await self.disconnect()
            self.reading.set()
            await asyncio.wait_for(self.task, 5.0)


async def end_paced(
    ws: AsgiWebSocket, pieces: list[str], pace: float, timeout: float = 120.0
) -> tuple[dict[str, Any], list[dict[str, Any] | bytes]]:
    """Send the rest of an utterance's text a piece at a time, `pace` seconds apart (an LLM's pace), end it and
    wait for its done event: (done, everything before it)."""
    for piece in pieces:
        await ws.send_json({"type": "text", "text": piece})
        await asyncio.sleep(pace)
    await ws.send_json({"type": "end"})
    return await ws.until("done", timeout=timeout)


def done_pcm(done: dict[str, Any], seen: list[dict[str, Any] | bytes], cap: int) -> np.ndarray:
    """An utterance's int16 PCM (its binary frames), checked against its done event: 1 to `cap` frames, their
    samples, and not silent."""
    assert 0 < done["frames"] <= cap and done["samples"] == done["frames"] * FRAME_SAMPLES, done
    pcm = np.frombuffer(b"".join(x for x in seen if isinstance(x, bytes)), "<i2")
    assert pcm.size == done["samples"] and np.abs(pcm).max() > 0
    return pcm
