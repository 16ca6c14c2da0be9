"""The native engine's scheduler decides each turn without a model or a device: which live rows step, which end
and leave (and why), whether admission is held, which waiting requests get a slot."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from qwen_tts.engine_api import FinishReason, QueueFullError, RequestHandle, SynthesisRequest
from qwen_tts.engines.native.scheduler import Admission, RequestState, Retire, Scheduler


class FakeDecoder:
    """The decoder as the scheduler sees it: chunks in flight per row."""

    def __init__(self) -> None:
        self.chunks: dict[int, int] = {}

    def inflight(self, row: RequestState) -> int:
        return self.chunks.get(id(row), 0)

    @property
    def busy(self) -> bool:
        return any(self.chunks.values())


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()  # the handles' consumer side; nothing here runs on it
    yield loop
    loop.close()


def state(loop: asyncio.AbstractEventLoop, budget: int = 10) -> RequestState:
    request = SynthesisRequest(text="hi", xvector=torch.zeros(4))
    return RequestState(RequestHandle(request, loop=loop), [1, 2], "auto", budget)


def running(sched: Scheduler, *states: RequestState) -> None:
    """Admit and start each request, as the loop does after its prefill."""
    for s in states:
        sched.enqueue(s)
    for s in sched.admit().admitted:
        sched.start(s)


def test_a_spent_budget_ends_the_row_before_it_steps(loop):
    sched, dec = Scheduler(4, 4), FakeDecoder()
    spent, fresh = state(loop, budget=5), state(loop, budget=5)
    running(sched, spent, fresh)
    spent.frames = 5
    plan = sched.schedule(None, dec)
    assert plan.rows == [fresh] and spent.done is FinishReason.BUDGET and fresh.done is None
    assert sched.retire(dec) == [Retire(spent, FinishReason.BUDGET, None)]


def test_a_cancelled_row_ends_before_any_work_and_its_frames_are_dropped(loop):
    sched, dec = Scheduler(4, 4), FakeDecoder()
    a, b = state(loop), state(loop)
    running(sched, a, b)
    a.pending.append(torch.zeros(16, dtype=torch.long))  # not handed to the decoder yet
    assert sched.cancel(a.handle) is None  # running: it stops at the next turn, not at once
    assert a.cancelled and a.done is None
    plan = sched.schedule(None, dec)
    assert plan.rows == [b] and a.done is FinishReason.CANCELLED
    assert sched.retire(dec) == [Retire(a, FinishReason.CANCELLED, None)]  # pending frames are not flushed


def test_a_waiting_request_cancelled_leaves_the_queue_at_once(loop):
    sched = Scheduler(1, 1)
    a, b = state(loop), state(loop)
    running(sched, a)
    sched.enqueue(b)
    assert sched.cancel(b.handle) is b and not sched.waiting
    assert sched.admit() == Admission([], False)


def test_a_decoder_error_ends_the_row_with_its_message(loop):
    sched, dec = Scheduler(4, 4), FakeDecoder()
    a = state(loop)
    running(sched, a)
    a.pending.append(torch.zeros(16, dtype=torch.long))
    a.decode_error = "decode failed: RuntimeError"
    plan = sched.schedule(None, dec)
    assert plan.rows == [] and a.done is FinishReason.ERROR and a.error == "decode failed: RuntimeError"
    assert a.pending == []
    assert sched.retire(dec) == [Retire(a, FinishReason.ERROR, "decode failed: RuntimeError")]


def test_a_decoder_error_after_the_end_still_ends_in_error(loop):
    sched, dec = Scheduler(4, 4), FakeDecoder()
    a = state(loop)
    running(sched, a)
    a.done = FinishReason.EOS
    a.decode_error = "decode failed: RuntimeError"
    assert sched.retire(dec) == [Retire(a, FinishReason.ERROR, "decode failed: RuntimeError")]


def test_a_row_decode_lookahead_chunks_ahead_of_its_audio_does_not_step(loop):
    sched, dec = Scheduler(4, 4, decode_lookahead=2), FakeDecoder()
    ahead, behind = state(loop), state(loop)
    running(sched, ahead, behind)
    dec.chunks = {id(ahead): 2, id(behind): 1}
    plan = sched.schedule(None, dec)
    assert plan.rows == [behind] and ahead.done is None  # it waits; it has not ended
    assert not plan.wait_for_decoder
    dec.chunks[id(behind)] = 2
    plan = sched.schedule(None, dec)
    assert plan.rows == [] and plan.wait_for_decoder  # nothing can step until the decoder catches up


def test_no_wait_for_the_decoder_while_a_step_is_in_flight_or_the_decoder_is_idle(loop):
    sched, dec = Scheduler(4, 4, decode_lookahead=1), FakeDecoder()
    a = state(loop)
    running(sched, a)
    dec.chunks = {id(a): 1}
    assert not sched.schedule([a], dec).wait_for_decoder  # the step launched before is read first
    a.done = FinishReason.EOS
    dec.chunks = {}
    assert not sched.schedule(None, dec).wait_for_decoder


def test_a_row_in_the_step_ahead_counts_that_frame_against_its_budget(loop):
    sched, dec = Scheduler(4, 4), FakeDecoder()
    last, more = state(loop, budget=5), state(loop, budget=5)
    running(sched, last, more)
    last.frames = 4  # the step ahead takes it to its budget
    more.frames = 3
    plan = sched.schedule([last, more], dec)
    assert plan.stepping == {id(last), id(more)}
    assert plan.rows == [more] and last.done is None  # not stepped past its budget; ended once that step is read


def test_an_ended_row_leaves_only_once_its_frames_and_audio_are_out(loop):
    sched, dec = Scheduler(4, 4), FakeDecoder()
    a = state(loop)
    running(sched, a)
    a.done = FinishReason.EOS
    a.pending.append(torch.zeros(16, dtype=torch.long))
    assert sched.retire(dec) == []  # its last frames go to the decoder first
    a.pending.clear()
    dec.chunks = {id(a): 1}
    assert sched.retire(dec) == []  # its audio is still in the decoder
    dec.chunks = {}
    assert sched.retire(dec) == [Retire(a, FinishReason.EOS, None)]
    sched.release(a)
    assert not sched.running and a.slot == -1


def test_admission_is_fifo_into_free_slots(loop):
    sched = Scheduler(2, 4)
    a, b, c = state(loop), state(loop), state(loop)
    for s in (a, b, c):
        sched.enqueue(s)
    plan = sched.admit()
    assert plan.admitted == [a, b] and not plan.held
    assert (a.slot, b.slot) == (0, 1) and list(sched.waiting) == [c]
    assert sched.admit() == Admission([], False)  # no slot free: waiting is not holding


def test_the_queue_refuses_beyond_free_slots_and_max_queue(loop):
    sched = Scheduler(1, 1)
    sched.enqueue(state(loop))
    sched.enqueue(state(loop))
    with pytest.raises(QueueFullError):
        sched.enqueue(state(loop))


def test_admission_is_held_while_steps_are_slower_than_the_budget(loop):
    sched = Scheduler(4, 4, step_budget_ms=10.0)
    a, b = state(loop), state(loop)
    running(sched, a)
    sched.note_step(100.0)
    sched.note_step(100.05)  # 50 ms between steps
    assert sched.admission_held()
    sched.enqueue(b)
    assert sched.admit() == Admission([], True) and list(sched.waiting) == [b]
    sched.note_step(100.055)  # the average comes down: 50 + 0.25 * (5 - 50) ms
    sched.note_step(100.06)
    sched.note_step(100.065)
    assert sched.admission_held()
    t = 100.065
    for _ in range(20):
        t += 0.005
        sched.note_step(t)
    assert not sched.admission_held()
    assert sched.admit().admitted == [b]


def test_the_step_interval_is_a_moving_average_measured_afresh_after_idle(loop):
    sched = Scheduler(4, 4, step_budget_ms=250.0)
    running(sched, state(loop))
    sched.note_step(0.0)
    sched.note_step(0.1)
    sched.note_step(0.2)
    sched.note_step(0.7)  # one slow step: the average is 0.1 + 0.25 * (0.5 - 0.1) = 0.2 s, within the budget
    assert not sched.admission_held()
    sched.note_step(1.3)  # 0.2 + 0.25 * (0.6 - 0.2) = 0.3 s
    assert sched.admission_held()
    sched.idle()
    assert not sched.admission_held()
    sched.note_step(5.0)  # the pause was no frame step: nothing measured yet
    assert not sched.admission_held()
    sched.note_step(5.1)
    assert not sched.admission_held()


def test_admission_is_never_held_without_a_budget_or_with_nothing_running(loop):
    off = Scheduler(4, 4, step_budget_ms=0.0)
    running(off, state(loop))
    off.note_step(0.0)
    off.note_step(10.0)
    assert not off.admission_held()
    empty = Scheduler(4, 4, step_budget_ms=10.0)
    empty.note_step(0.0)
    empty.note_step(10.0)
    assert not empty.admission_held()


def test_stopping_cancels_every_running_row(loop):
    sched, dec = Scheduler(4, 4), FakeDecoder()
    a, b = state(loop), state(loop)
    running(sched, a, b)
    b.done = FinishReason.EOS
    sched.cancel_running()
    assert a.done is b.done is FinishReason.CANCELLED
    assert [r.state for r in sched.retire(dec)] == [a, b]
