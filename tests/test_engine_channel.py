"""The channel between API front-ends and the engine process (tts_server/channel.py, engine_host.py,
remote_engine.py), both ends in this process over a real Unix socket: what a request, its audio, its stats, its
cancel, its streamed text and its ICL reference become on the other side, and the per-request credit window."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from qwen_tts.engine_api import (
    EngineNotReadyError,
    FinishReason,
    QueueFullError,
    RequestFailedError,
    SynthesisRequest,
)
from qwen_tts.engines.fake import FakeEngine
from qwen_tts.icl import IclReference
from qwen_tts.text_stream import TextStream
from qwen_tts.voices import VoiceRegistry
from server_helpers import clean_settings
from tts_server.channel import CREDIT_WINDOW, decode_request, encode_request
from tts_server.engine_host import EngineHost
from tts_server.processes import SharedAdmission
from tts_server.remote_engine import ENGINE_LOST, RemoteEngine
from tts_server.runtime import Runtime


@dataclass
class Pair:
    fake: FakeEngine
    host: EngineHost
    remote: RemoteEngine
    server: asyncio.AbstractServer


@contextlib.asynccontextmanager
async def channel(tmp_path: Path, fake: FakeEngine) -> AsyncIterator[Pair]:
    await fake.start()
    runtime = Runtime(clean_settings(), fake, VoiceRegistry(tmp_path / "voices", xvector_dim=fake.xvector_dim))
    host = EngineHost(runtime)
    path = str(tmp_path / "engine.sock")
    server = await asyncio.start_unix_server(host.connected, path=path)
    remote = RemoteEngine(path)
    await remote.connect()
    await remote.start()
    try:
        yield Pair(fake, host, remote, server)
    finally:
        await remote.stop()
        server.close()
        await host.close()
        await fake.stop()


def request(text: str, **kw: object) -> SynthesisRequest:
    return SynthesisRequest(text=text, xvector=torch.arange(16, dtype=torch.float32), seed=3, **kw)  # type: ignore[arg-type]


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_a_request_survives_its_encoding_field_for_field() -> None:
    codes = torch.randint(0, 2048, (5, 16), generator=torch.Generator().manual_seed(1))
    icl = IclReference(codes=codes, text="reference words", key="abc123")
    sent = request("héllo wörld", language="german", temperature=0.7, top_k=12, max_frames=99, min_frames=4, icl=icl)
    got, streamed = decode_request(encode_request(sent))
    assert not streamed
    for name in ("text", "language", "temperature", "top_k", "max_frames", "min_frames", "seed", "request_id"):
        assert getattr(got, name) == getattr(sent, name), name
    assert torch.equal(got.xvector, sent.xvector)
    assert got.icl is not None and torch.equal(got.icl.codes, codes)
    assert (got.icl.text, got.icl.key) == ("reference words", "abc123")


async def test_a_request_streams_through_the_channel_with_the_engines_audio_and_stats(tmp_path: Path) -> None:
    async with channel(tmp_path, FakeEngine(first_chunk_frames=2, chunk_frames=5)) as p:
        assert (p.remote.xvector_dim, p.remote.languages, p.remote.ready) == (16, p.fake.languages, True)
        codes = torch.randint(0, 2048, (4, 16), generator=torch.Generator().manual_seed(2))
        req = request("x" * 23, icl=IclReference(codes=codes, text="the reference", key="k1"))
        handle = p.remote.submit(req)
        pcm = await handle.collect()
        (engine_side,) = p.fake.submitted
        np.testing.assert_array_equal(pcm, p.fake.tone(engine_side, 0, 23))
        assert torch.equal(engine_side.xvector, req.xvector) and engine_side.request_id == req.request_id
        assert engine_side.icl is not None and torch.equal(engine_side.icl.codes, codes)
        assert (engine_side.icl.text, engine_side.icl.key) == ("the reference", "k1")
        assert handle.stats.finish_reason is FinishReason.EOS
        assert (handle.stats.frames, handle.stats.samples, handle.stats.frame_budget) == (23, pcm.shape[0], 23)
        assert handle.stats.time_to_first_audio is not None and handle.stats.queue_time is not None


async def test_a_streamed_text_reaches_the_engine_fragment_by_fragment(tmp_path: Path) -> None:
    async with channel(tmp_path, FakeEngine(first_chunk_frames=1, chunk_frames=1)) as p:
        stream = TextStream("Hello")
        handle = p.remote.submit(request("Hello", text_stream=stream, non_streaming_text=False))
        first = await handle.__anext__()
        assert first.shape[0] > 0
        stream.push(", world")
        stream.push(".")
        stream.end()
        rest = [c async for c in handle]
        total = first.shape[0] + sum(c.shape[0] for c in rest)
        assert total == len("Hello, world.") * 1920
        assert handle.stats.finish_reason is FinishReason.EOS


async def test_a_reader_that_stops_holds_at_most_the_credit_window(tmp_path: Path) -> None:
    async with channel(tmp_path, FakeEngine(first_chunk_frames=1, chunk_frames=1)) as p:
        handle = p.remote.submit(request("x" * 60))
        await eventually(lambda: p.fake.num_running == 0 and not p.fake._tasks)  # the engine has made all 60
        await asyncio.sleep(0.1)
        assert handle._queue.qsize() == CREDIT_WINDOW  # the rest waits in the engine process for credit
        taken = [await handle.__anext__() for _ in range(3)]
        await eventually(lambda: handle._queue.qsize() == CREDIT_WINDOW)
        rest = [c async for c in handle]
        assert len(taken) + len(rest) == 60
        assert handle.stats.finish_reason is FinishReason.EOS


async def test_cancel_stops_the_engines_work_even_when_nothing_is_read(tmp_path: Path) -> None:
    async with channel(tmp_path, FakeEngine(first_chunk_frames=1, chunk_frames=1, frame_delay=0.01)) as p:
        handle = p.remote.submit(request("x" * 2000))
        await eventually(lambda: handle._queue.qsize() == CREDIT_WINDOW)
        p.remote.cancel(handle)
        await eventually(lambda: handle.request_id in p.fake.cancelled and not p.fake._tasks)
        chunks = [c async for c in handle]
        assert len(chunks) == CREDIT_WINDOW
        assert handle.stats.finish_reason is FinishReason.CANCELLED
        assert handle.stats.frames < 2000


async def test_refusals_come_back_as_the_exceptions_the_engine_raised(tmp_path: Path) -> None:
    async with channel(tmp_path, FakeEngine(max_slots=1, max_queue=0, frame_delay=0.01)) as p:
        busy = p.remote.submit(request("x" * 500))
        full = p.remote.submit(request("hello"))
        with pytest.raises(QueueFullError):
            await full.__anext__()
        p.remote.cancel(busy)
        await busy.collect()
        assert busy.stats.finish_reason is FinishReason.CANCELLED and busy.stats.frames < 500
        failed = p.remote.submit(request("[fail] now"))
        with pytest.raises(RequestFailedError, match="simulated failure"):
            await failed.collect()
        p.host.begin_drain()
        drained = p.remote.submit(request("hello"))
        with pytest.raises(EngineNotReadyError):
            await drained.__anext__()
        await eventually(lambda: not p.remote.ready)


async def test_a_lost_engine_process_fails_requests_in_flight_and_is_not_ready(tmp_path: Path) -> None:
    async with channel(tmp_path, FakeEngine(frame_delay=0.01)) as p:
        handle = p.remote.submit(request("x" * 500))
        await handle.__anext__()
        p.server.close()
        await p.host.close()  # as the engine process dying closes its end
        with pytest.raises(RequestFailedError, match=ENGINE_LOST):
            async for _ in handle:
                pass
        assert not p.remote.ready and p.remote.restarting_itself
        with pytest.raises(EngineNotReadyError):
            p.remote.submit(request("hello"))


def _take(limit: int, count: object, n: int, results: object) -> None:
    admission = SharedAdmission(limit, count)  # type: ignore[arg-type]
    results.put(sum(admission.try_acquire() for _ in range(n)))  # type: ignore[attr-defined]


def test_shared_admission_holds_one_limit_over_processes() -> None:
    ctx = multiprocessing.get_context("spawn")
    count, results = ctx.Value("q", 0), ctx.Queue()
    procs = [ctx.Process(target=_take, args=(5, count, 4, results)) for _ in range(3)]
    for proc in procs:
        proc.start()
    taken = sorted(results.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(30)
    assert sum(taken) == 5 and count.value == 5
    here = SharedAdmission(5, count)
    assert not here.try_acquire() and here.active == 5
    here.release()
    assert here.active == 4 and here.try_acquire()
