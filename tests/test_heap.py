"""The startup heap is frozen out of the garbage collector's full collections, and thawed when an engine is
replaced (tts_server/heap.py): what serving allocates must not make each full collection walk torch and the app."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwen_tts.engines.fake import FakeEngine
from server_helpers import clean_settings, write_voice
from tts_server import recovery
from tts_server.heap import freeze_startup_heap, thaw_and_collect
from tts_server.recovery import EngineSupervisor
from tts_server.runtime import Runtime

DIM = 16


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector can free it


def walked(obj: object) -> bool:
    """Whether a full collection looks at `obj` (gc.get_objects lists generations 0-2, not the frozen one)."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture
def thawed() -> Iterator[None]:
    """Leave this test process's heap as collectable as it found it."""
    yield
    gc.unfreeze()


def test_objects_alive_at_the_freeze_are_out_of_full_collections_later_ones_are_not(thawed) -> None:
    before = Node()
    assert walked(before)
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() > 0
    after = Node()
    assert not walked(before)
    assert walked(after)


def test_garbage_startup_left_is_collected_before_the_freeze_not_kept(thawed) -> None:
    dropped = weakref.ref(Node())
    assert dropped() is not None  # a cycle: reference counting alone does not free it
    freeze_startup_heap()
    assert dropped() is None


def test_a_frozen_cycle_outlives_collections_until_thawed(thawed) -> None:
    node = Node()
    ref = weakref.ref(node)
    freeze_startup_heap()
    del node
    gc.collect()
    assert ref() is not None  # why an engine replacement must thaw: its old cycles would stay (device memory)
    thaw_and_collect()
    assert ref() is None


def fault_raised_in(engine: object) -> Exception:
    """An exception raised in a frame that holds `engine` (as the engine loop's own error is): its traceback keeps
    the engine alive for as long as something keeps the exception."""

    def loop(self: object) -> None:
        raise MemoryError("out of memory in the loop")

    try:
        loop(engine)
    except MemoryError as e:
        return e
    raise AssertionError("unreachable")


@pytest.fixture
def voices(tmp_path: Path) -> Path:
    root = tmp_path / "voices"
    write_voice(root, "alice", DIM)
    return root


async def test_an_engine_restart_frees_the_old_engine_even_in_a_cycle_and_freezes_again(
    voices: Path, thawed, monkeypatch
) -> None:
    released = []
    monkeypatch.setattr(recovery, "release_device_memory", lambda device: released.append(device))
    rt = await Runtime.start(clean_settings(profiles_dir=voices), engine=FakeEngine(xvector_dim=DIM))
    supervisor = EngineSupervisor(rt, lambda reason: None, restart_delay=0.0, max_restarts=3)
    try:
        old = rt.engine
        old.me = old  # type: ignore[attr-defined]  # engines hold cycles (threads, callbacks, modules)
        old.fault = fault_raised_in(old)  # type: ignore[attr-defined]  # as a dead engine's loop leaves it
        ref = weakref.ref(old)
        freeze_startup_heap()  # as the server does before it serves
        await old.stop()  # the engine dies: not ready any more (the runtime alone holds it now)
        del old
        freed_before_next = []
        rt.engine_factory = lambda: (freed_before_next.append(ref() is None), FakeEngine(xvector_dim=DIM))[1]
        supervisor.start()
        for _ in range(200):
            if rt.engine_restarts:
                break
            await asyncio.sleep(0.01)
        assert rt.engine_restarts == 1 and rt.engine.ready
        # Freed before the next engine was built (its device memory is needed for that), not left frozen
        assert freed_before_next == [True] and ref() is None
        assert not walked(rt.engine)  # the new engine is out of full collections again
        assert released == [rt.engine.device]  # then the CUDA libraries' per-stream memory of its device handed back
    finally:
        await supervisor.stop()
        await rt.stop()


async def test_a_restart_leaves_the_device_memory_of_an_old_engine_that_was_not_freed(
    voices: Path, thawed, monkeypatch
):
    """An old engine something still holds (a thread of it that did not stop, say) may still launch work on its
    streams: the restart goes on, but the CUDA libraries' per-stream workspaces are not handed back."""
    released = []
    monkeypatch.setattr(recovery, "release_device_memory", lambda device: released.append(device))
    rt = await Runtime.start(clean_settings(profiles_dir=voices), engine=FakeEngine(xvector_dim=DIM))
    supervisor = EngineSupervisor(rt, lambda reason: None, restart_delay=0.0, max_restarts=3)
    try:
        rt.engine_factory = lambda: FakeEngine(xvector_dim=DIM)
        held = [rt.engine]
        await held[0].stop()
        supervisor.start()
        for _ in range(200):
            if rt.engine_restarts:
                break
            await asyncio.sleep(0.01)
        assert rt.engine_restarts == 1 and rt.engine.ready and rt.engine is not held[0]
        assert released == []
    finally:
        await supervisor.stop()
        await rt.stop()


async def test_a_stand_in_keeps_an_engines_facts_refuses_work_and_holds_no_reference_to_it() -> None:
    """While an engine is replaced the runtime holds a stand-in: the old engine's x-vector width, languages, rate,
    device and model info for the routes, never ready, submit refused as a stopped engine refuses it (503 upstream),
    and nothing that keeps the old engine (and its device memory) alive."""
    import torch

    from qwen_tts.engine_api import EngineNotReadyError, SynthesisRequest
    from tts_server.recovery import EngineStandIn

    old = FakeEngine(xvector_dim=DIM)
    await old.start()
    await old.stop()
    stand_in = EngineStandIn(old)
    ref = weakref.ref(old)
    facts = (old.xvector_dim, old.languages, old.sample_rate, old.device, old.model_info)
    del old
    gc.collect()
    assert ref() is None
    assert (stand_in.xvector_dim, stand_in.languages, stand_in.sample_rate) == facts[:3]
    assert stand_in.device == facts[3] and stand_in.model_info == facts[4]
    assert not stand_in.ready and stand_in.num_running == stand_in.num_waiting == 0 and stand_in.fault is None
    with pytest.raises(EngineNotReadyError, match="restarting"):
        stand_in.submit(SynthesisRequest(text="hi", xvector=torch.zeros(DIM)))
    await stand_in.stop()  # as the runtime's shutdown calls it
