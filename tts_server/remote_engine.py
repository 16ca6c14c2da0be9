"""`RemoteEngine`: the `Engine` an API front-end process serves from, the real one living in the engine process.

It connects to the engine process's channel (channel.py) once, learns the engine's facts there (x-vector width,
languages, rate, model info, readiness), and then implements the interface over the connection: `submit` sends the
request and returns a `RemoteHandle` fed by the connection's reader task, `cancel` sends a cancel, a request's
streamed text follows as TEXT messages, and its stats come back with its FINISH. The handle's iteration acknowledges
every chunk it hands out (CREDIT), which is what lets the engine process send more of that request.

Refusals that only the engine can decide (a full queue, an option it rejects) come back after `submit` has returned;
the handle then raises the same exception (`QueueFullError`, `EngineNotReadyError`, `ValueError`) at its first
iteration. A lost connection (the engine process died) fails every request in flight as an engine failure
(`RequestFailedError`); the engine is then not ready (`restarting_itself`) until the engine process that the
supervisor starts in its place accepts the connection again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import numpy as np
import torch

from qwen_tts.engine_api import (
    Engine,
    EngineNotReadyError,
    FinishReason,
    QueueFullError,
    RequestFailedError,
    RequestHandle,
    SynthesisRequest,
)
from qwen_tts.text_stream import TextStream

from .channel import (
    JSON_LENGTH,
    ChannelClosed,
    FrameWriter,
    Kind,
    apply_stats,
    encode_request,
    frame,
    json_frame,
    read_chunk,
    read_frame,
)

logger = logging.getLogger("tts_server")
ENGINE_LOST = "the engine process exited"
_REFUSALS: dict[str, type[Exception]] = {
    "queue_full": QueueFullError,
    "not_ready": EngineNotReadyError,
    "invalid": ValueError,
    "failed": RequestFailedError,
}


class RemoteHandle(RequestHandle):
    """A request handle fed from the channel: chunks arrive on the front-end's loop; each one taken is credited."""

    def __init__(self, request: SynthesisRequest, engine: RemoteEngine, number: int):
        super().__init__(request)
        self._engine = engine
        self.number = number
        self.refusal: Exception | None = None
        self.sent_text = 0  # characters of the text stream sent so far
        self.sent_end = False

    async def __anext__(self) -> np.ndarray:
        try:
            chunk = await super().__anext__()  # StopAsyncIteration, RequestFailedError
        except RequestFailedError:
            if self.refusal is not None:  # refused by the engine: the exception its submit would have raised
                raise self.refusal from None
            raise
        self._engine._send(frame(Kind.CREDIT, self.number, JSON_LENGTH.pack(1)))
        return chunk

    def refuse(self, error: Exception) -> None:
        self.refusal = error
        self.finish_threadsafe(FinishReason.ERROR, str(error))


class RemoteEngine(Engine):
    """The engine process's engine, seen from a front-end. `connect` before anything else (the facts come from it)."""

    reconnect_s = 0.1  # between attempts to reach the engine process

    def __init__(self, path: str):
        self.path = path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._out: FrameWriter | None = None
        self._facts: dict[str, Any] = {}
        self._state: dict[str, Any] = {}
        self._handles: dict[int, RemoteHandle] = {}
        self._next = 0
        self._task: asyncio.Task | None = None
        self._reconnecting: asyncio.Task | None = None
        self._lost = False
        self._accepting = False
        self.fault: BaseException | None = None

    async def connect(self, timeout: float = 30.0) -> None:
        """Open the connection and read the engine's facts (FACTS, the first frame the engine process sends)."""
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path), timeout)
        try:
            kind, _, payload = await asyncio.wait_for(read_frame(reader), timeout)
            if kind is not Kind.FACTS:
                raise ChannelClosed(f"expected the engine's facts, got {kind.name}")
        except BaseException:
            writer.close()
            raise
        self._reader, self._writer, self._out = reader, writer, FrameWriter(writer)
        self._facts = json.loads(payload)
        self._state = dict(self._facts["state"])
        self._lost = False
        self._task = asyncio.get_running_loop().create_task(self._read(), name="engine-channel")

    async def _reconnect(self) -> None:
        """After the engine process is lost: connect to its successor (processes.py starts one) once it listens."""
        while self._accepting:
            await asyncio.sleep(self.reconnect_s)
            try:
                await self.connect()
            except (OSError, ChannelClosed, asyncio.TimeoutError):
                continue
            logger.info("connected to the engine process again")
            return

    # --- Engine ------------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._writer is None:
            await self.connect()
        self._accepting = True

    async def stop(self, drain_timeout: float = 0.0) -> None:
        self._accepting = False
        pending = [h for h in self._handles.values() if not h.finished]
        if pending and drain_timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._until_done(), drain_timeout)
        for handle in list(self._handles.values()):
            self.cancel(handle)
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
        for task in (self._task, self._reconnecting):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _until_done(self) -> None:
        while any(not h.finished for h in self._handles.values()):
            await asyncio.sleep(0.05)

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        if not self.ready:
            raise EngineNotReadyError("engine is not accepting requests")
        if request.language.lower() not in self.languages:
            raise ValueError(f"unsupported language {request.language!r}")
        if tuple(request.xvector.shape) != (self.xvector_dim,):
            raise ValueError(f"xvector must have shape ({self.xvector_dim},), got {tuple(request.xvector.shape)}")
        self._next += 1
        number = self._next
        handle = RemoteHandle(request, self, number)
        self._handles[number] = handle
        stream = request.text_stream
        if stream is not None:
            handle.sent_text = len(request.text)
            stream.add_listener(lambda: handle._loop.call_soon_threadsafe(self._forward_text, handle, stream))
        self._send(frame(Kind.SUBMIT, number, encode_request(request)))
        if stream is not None:
            self._forward_text(handle, stream)  # what arrived between the request's text and the listener
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        if isinstance(handle, RemoteHandle) and self._handles.get(handle.number) is handle and not handle.finished:
            self._send(frame(Kind.CANCEL, handle.number))

    @property
    def ready(self) -> bool:
        return self._accepting and not self._lost and bool(self._state.get("ready"))

    @property
    def restarting_itself(self) -> bool:
        """The engine process is restarting its engine, or is being replaced (the front-end reconnects)."""
        return self._accepting and (self._lost or bool(self._state.get("restarting")))

    @property
    def xvector_dim(self) -> int:
        return int(self._facts["xvector_dim"])

    @property
    def languages(self) -> list[str]:
        return list(self._facts["languages"])

    @property
    def sample_rate(self) -> int:
        return int(self._facts["sample_rate"])

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # x-vectors travel as bytes; the engine process puts them on its device

    @property
    def model_info(self) -> dict[str, Any]:
        return dict(self._facts["model_info"])

    @property
    def num_running(self) -> int:
        return int(self._state.get("running", 0))

    @property
    def num_waiting(self) -> int:
        return int(self._state.get("waiting", 0))

    # --- the connection ----------------------------------------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        if self._out is not None and not self._lost and not self._out.writer.is_closing():
            self._out.write(data)

    def _forward_text(self, handle: RemoteHandle, stream: TextStream) -> None:
        """Send what the request's text stream has gained since the last call (on the front-end's loop)."""
        if handle.finished or handle.sent_end:
            return
        snap = stream.snapshot()
        if len(snap.text) > handle.sent_text:
            body = {"push": snap.text[handle.sent_text :]}
            handle.sent_text = len(snap.text)
            self._send(json_frame(Kind.TEXT, handle.number, body))
        if snap.ended:
            handle.sent_end = True
            self._send(json_frame(Kind.TEXT, handle.number, {"end": True}))

    async def _read(self) -> None:
        assert self._reader is not None
        try:
            while True:
                kind, number, payload = await read_frame(self._reader)
                if kind is Kind.CHUNK:
                    handle = self._handles.get(number)
                    if handle is not None:
                        chunk = read_chunk(payload, handle.stats)
                        handle.stats.samples += chunk.shape[0]
                        if handle.stats.first_audio_at is None:
                            handle.stats.first_audio_at = time.monotonic()
                        handle._queue.put_nowait(chunk)
                elif kind is Kind.FINISH:
                    handle = self._handles.pop(number, None)
                    if handle is not None:
                        reason, error = apply_stats(json.loads(payload), handle.stats)
                        handle.finish_threadsafe(reason, error)
                elif kind is Kind.REFUSED:
                    handle = self._handles.pop(number, None)
                    if handle is not None:
                        body = json.loads(payload)
                        handle.refuse(_REFUSALS.get(body["kind"], EngineNotReadyError)(body["message"]))
                elif kind is Kind.STATE:
                    self._state = json.loads(payload)
        except ChannelClosed as e:
            if self._accepting:
                logger.error("lost the engine process (%s): failing %d request(s) in flight", e, len(self._handles))
                self.fault = e
        finally:
            self._lost = True
            for handle in self._handles.values():
                handle.finish_threadsafe(FinishReason.ERROR, ENGINE_LOST)
            self._handles.clear()
            if self._accepting:
                self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect(), name="engine-reconnect")
