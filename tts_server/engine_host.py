"""The engine process's side of the channel (channel.py): the real engine, served to the API front-end processes.

`EngineHost` accepts one connection per front-end on a Unix domain socket, tells each the engine's facts, submits
their requests to `runtime.engine` (whichever engine the in-process supervisor, recovery.py, has running now), and
forwards each request's chunks under its credit window, then its stats (FINISH). A front-end's CANCEL, or its
connection closing, cancels the engine work. Readiness and load go to every front-end as STATE whenever they change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from qwen_tts.engine_api import (
    Engine,
    EngineNotReadyError,
    QueueFullError,
    RequestFailedError,
    RequestHandle,
)
from qwen_tts.text_stream import TextStream, TextStreamClosedError

from .channel import (
    CREDIT_WINDOW,
    JSON_LENGTH,
    ChannelClosed,
    FrameWriter,
    Kind,
    chunk_frame,
    decode_request,
    json_frame,
    read_frame,
    stats_body,
)
from .runtime import Runtime

logger = logging.getLogger("tts_server")
_STATE_POLL_S = 0.05


class _Forward:
    """One request of one front-end: the engine handle's chunks out under the credit window, then FINISH."""

    def __init__(
        self, conn: _Connection, number: int, engine: Engine, handle: RequestHandle, stream: TextStream | None
    ):
        self.conn = conn
        self.number = number
        self.engine = engine
        self.handle = handle
        self.stream = stream
        self.credit = conn.host.credit_window
        self.cancelled = False
        self._wake = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run())

    def add_credit(self, n: int) -> None:
        self.credit += n
        self._wake.set()

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.engine.cancel(self.handle)
            if self.stream is not None:
                self.stream.end()
            self._wake.set()

    def text(self, body: dict[str, Any]) -> None:
        if self.stream is None:
            return
        with contextlib.suppress(TextStreamClosedError):
            if "push" in body:
                self.stream.push(str(body["push"]))
            if body.get("end"):
                self.stream.end()

    async def _run(self) -> None:
        try:
            async for chunk in self.handle:
                while self.credit <= 0 and not self.cancelled:
                    self._wake.clear()
                    await self._wake.wait()
                if self.cancelled:
                    continue  # the engine stops at its next step; what it still hands over is dropped
                self.credit -= 1
                await self.conn.send(chunk_frame(self.number, chunk, self.handle.stats))
        except RequestFailedError:
            pass  # the stats carry the error
        except ChannelClosed:
            self.cancel()
        finally:
            self.conn.forwards.pop(self.number, None)
            with contextlib.suppress(ChannelClosed):
                await self.conn.send(json_frame(Kind.FINISH, self.number, stats_body(self.handle.stats)))


class _Connection:
    def __init__(self, host: EngineHost, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.host = host
        self.reader = reader
        self.writer = writer
        self.out = FrameWriter(writer)
        self.forwards: dict[int, _Forward] = {}

    async def send(self, data: bytes) -> None:
        self.out.write(data)
        await self.out.drain()

    async def run(self) -> None:
        try:
            await self.send(json_frame(Kind.FACTS, 0, self.host.facts()))
            while True:
                kind, number, payload = await read_frame(self.reader)
                if kind is Kind.SUBMIT:
                    await self._submit(number, payload)
                    continue
                forward = self.forwards.get(number)
                if forward is None:
                    continue  # finished meanwhile
                if kind is Kind.CREDIT:
                    forward.add_credit(JSON_LENGTH.unpack_from(payload)[0])
                elif kind is Kind.TEXT:
                    forward.text(json.loads(payload))
                elif kind is Kind.CANCEL:
                    forward.cancel()
        except ChannelClosed:
            pass
        finally:
            for forward in list(self.forwards.values()):
                forward.cancel()
            self.writer.close()

    async def _submit(self, number: int, payload: bytes) -> None:
        request, streamed = decode_request(payload)
        engine = self.host.runtime.engine
        refusal = None
        if self.host.draining:
            refusal = ("not_ready", "engine is draining for shutdown")
        else:
            request.xvector = request.xvector.to(engine.device)
            stream = request.text_stream = TextStream(request.text) if streamed else None
            try:
                handle = engine.submit(request)
            except QueueFullError as e:
                refusal = ("queue_full", str(e))
            except EngineNotReadyError as e:
                refusal = ("not_ready", str(e))
            except ValueError as e:
                refusal = ("invalid", str(e))
            except Exception as e:  # a bug in the engine's submit: this request fails, as it would in one process
                logger.exception("submit failed")
                refusal = ("failed", f"{type(e).__name__}: {e}")
        if refusal is not None:
            await self.send(json_frame(Kind.REFUSED, number, {"kind": refusal[0], "message": refusal[1]}))
            return
        self.forwards[number] = _Forward(self, number, engine, handle, stream)


class EngineHost:
    """Serves `runtime.engine` to front-end connections; `draining` refuses new requests and lets the rest finish."""

    def __init__(self, runtime: Runtime, credit_window: int = CREDIT_WINDOW):
        self.runtime = runtime
        self.credit_window = credit_window
        self.connections: set[_Connection] = set()
        self.draining = False
        self._state: dict[str, Any] = {}
        self._watch: asyncio.Task | None = None

    def facts(self) -> dict[str, Any]:
        engine = self.runtime.engine
        return {
            "xvector_dim": engine.xvector_dim,
            "languages": list(engine.languages),
            "sample_rate": engine.sample_rate,
            "model_info": engine.model_info,
            "state": self.state(),
        }

    def state(self) -> dict[str, Any]:
        rt = self.runtime
        return {
            "ready": rt.ready and not self.draining,
            "restarting": rt.recovering and not self.draining,
            "running": rt.engine.num_running,
            "waiting": rt.engine.num_waiting,
        }

    @property
    def in_flight(self) -> int:
        return sum(len(c.forwards) for c in self.connections)

    async def connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection(self, reader, writer)
        self.connections.add(conn)
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_state(), name="engine-state")
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)

    def begin_drain(self) -> None:
        self.draining = True
        self.runtime.begin_drain()

    async def _watch_state(self) -> None:
        while True:
            await asyncio.sleep(_STATE_POLL_S)
            state = self.state()
            if state != self._state:
                self._state = state
                data = json_frame(Kind.STATE, 0, state)
                for conn in list(self.connections):
                    with contextlib.suppress(ChannelClosed):
                        conn.out.write(data)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for conn in list(self.connections):
            for forward in list(conn.forwards.values()):
                forward.cancel()
            conn.writer.close()
