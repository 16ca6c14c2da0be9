"""The native engine's scheduler: the wait queue, the KV-cache slots, frame budgets and the typed state the
engine keeps for each request, and every decision of a loop turn, returned as plain plans:
  - `admit`: whether admission is held (steps slower than admission_step_budget_ms) and which waiting requests
    get a slot (`Admission`);
  - `schedule`: which live rows step this turn (cancellations, decoder errors and spent budgets end first; a row
    `decode_lookahead` chunks ahead of its audio waits, a streamed row whose next text token has not arrived is
    held) and whether the loop waits for the decoder or for text (`StepPlan`);
  - `poll_waiting`, `poll_running`: what streamed requests' text streams brought (text_feed.py): their committed
    ids, a budget that grows with them, the requests whose text ended empty or grew too long;
  - `retire`: which ended rows leave, and why (`Retire`), once their audio is out.
The runner executes the plans; the loop delivers the outcome. Pure Python: no tensor work, no device.

Thread-safe through `cv`: the event loop submits and cancels, the engine's worker thread admits and releases.
A request's state belongs to the engine; the caller's `RequestHandle` carries none of it.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch

from qwen_tts.engine_api import FinishReason, QueueFullError, RequestHandle, SynthesisRequest
from qwen_tts.model.prompt import Prompt

from .icl_cache import IclVoice
from .text_feed import TextFeed, TextTooLongError

# Frame budget from the text length: ~3 frames per text token is normal speech; allow well over twice that.
BUDGET_BASE_FRAMES = 25
BUDGET_FRAMES_PER_TOKEN = 8


def chunk_schedule(first: int, chunk: int, growth: int) -> list[int]:
    """The streaming chunk sizes in frames: `first`, then each at most `growth` times the one before, up to `chunk`,
    which repeats (the last entry). chunk_schedule(3, 12, 2) == [3, 6, 12]."""
    sizes = [first]
    while sizes[-1] < chunk:
        sizes.append(min(chunk, sizes[-1] * growth))
    return sizes


def frame_budget(request: SynthesisRequest, text_tokens: int, max_frames: int) -> int:
    """Frames a request may generate: from its text length, raised to its min_frames, capped by its own and the
    engine's max_frames. A caller that asks for at least min_frames gets them (still capped): min == max fixes the
    length."""
    cap = max_frames if request.max_frames is None else min(request.max_frames, max_frames)
    text_budget = BUDGET_BASE_FRAMES + BUDGET_FRAMES_PER_TOKEN * text_tokens
    return max(1, min(cap, max(text_budget, request.min_frames)))


@dataclass(eq=False)
class RequestState:
    """What the engine knows about one request, from submission to its end."""

    handle: RequestHandle
    text_ids: list[int]
    language: str
    budget: int
    cancelled: bool = False  # set by cancel(); the worker acts on it at the next step
    feed: TextFeed | None = None  # the streamed text's committed ids (a request with a text_stream)
    # Rows of the trailing text track known (frames f < text_rows may step); None: all of it (teos, then tpad).
    text_rows: int | None = None
    held: bool = False  # waiting for its next text token this turn (schedule)
    ref_ids: list[int] | None = None  # an ICL request's reference transcript ids (request.icl); None: x-vector mode
    # A streamed request's committed ids its prefill needs (`icl_cache.stream_prefill_ids`), unless its text ends first.
    prefill_ids: int = 1
    # Set at admission, when the request gets a KV-cache slot.
    slot: int = -1
    prompt: Prompt | None = None
    icl_voice: IclVoice | None = None  # an ICL request's cached voice (its decoder starts from the reference)
    pos: int = 0  # next cache position to write
    frames: int = 0  # frames generated so far
    pending: list[torch.Tensor] = field(default_factory=list)  # (16,) frames not yet handed to the decoder
    queued: int = 0  # frames handed to the decoder (engine loop)
    decoded: int = 0  # frames already turned into audio (decoder)
    decode_error: str | None = None  # set by the decoder when a chunk of this request failed
    done: FinishReason | None = None
    error: str | None = None

    @property
    def request(self) -> SynthesisRequest:
        return self.handle.request

    @property
    def admissible(self) -> bool:
        """It can take a slot: the text its prefill holds is known (a streamed request's first `prefill_ids` ids, or
        all of its text once the stream has ended with fewer), or it was cancelled (admission finishes it)."""
        feed = self.feed
        if feed is None or self.cancelled:
            return True
        return bool(feed.ids) and (feed.ended or len(feed.ids) >= self.prefill_ids)

    def text_ready(self, frame: int) -> bool:
        """Frame `frame`'s text-track row is known."""
        return self.text_rows is None or frame < self.text_rows


class DecoderProgress(Protocol):
    """What the scheduler reads of the decoder (decoder.py's DecodeWorker)."""

    def inflight(self, row: RequestState) -> int:
        """The row's chunks handed to the decoder and not yet decoded."""

    @property
    def busy(self) -> bool:
        """Some chunk is in the decoder."""


@dataclass
class Admission:
    """The admission decision of one loop turn."""

    admitted: list[RequestState]  # popped from the queue, each with its slot: the runner prefills them
    held: bool  # a waiting request stays queued: the running ones step slower than admission_step_budget_ms


@dataclass
class StepPlan:
    """The frame step of one loop turn."""

    rows: list[RequestState]  # live rows that step (each at its next frame)
    stepping: set[int]  # ids of rows in the step launched before and not read yet: this step is their next frame
    wait_for_decoder: bool  # no row can step and nothing is in flight: wait until the decoder catches up
    wait_for_text: bool = False  # no row can step, nothing is in flight, and some row waits for its next text token


@dataclass
class Retire:
    """A row that leaves: its audio is out (or dropped) and its slot is freed."""

    state: RequestState
    reason: FinishReason
    error: str | None


class Scheduler:
    """Admission to `max_slots` KV-cache slots with at most `max_queue` requests waiting beyond the free ones, and
    the decisions of each loop turn (see the module docstring). `decode_lookahead`: chunks a row may have in the
    decoder and still step; `step_budget_ms`: admission_step_budget_ms (0: admit whenever a slot is free)."""

    def __init__(
        self,
        max_slots: int,
        max_queue: int,
        *,
        decode_lookahead: int = 2,
        step_budget_ms: float = 0.0,
        max_frames: int = 2048,
    ):
        self.max_slots = max_slots
        self.max_frames = max_frames  # the engine's cap, for the budgets of streamed text
        self.max_queue = max_queue
        self.decode_lookahead = decode_lookahead
        self.step_budget_ms = step_budget_ms
        self.cv = threading.Condition()
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.running: dict[int, RequestState] = {}  # slot -> state; touched by the worker thread only
        self._free_slots: list[int] = list(range(max_slots))[::-1]
        self._states: dict[RequestHandle, RequestState] = {}  # every request not yet finished
        # Seconds between frame steps while requests run: a moving average (admission_step_budget_ms).
        self._step_interval: float | None = None
        self._last_step_at: float | None = None
        # Bumped (under cv) by every event the loop may wait for: a submission, a cancel, text arriving (`wake`).
        self.events = 0

    @property
    def has_work(self) -> bool:
        """Something runs, or a waiting request can be admitted or has new text to read (cv held)."""
        return bool(self.running) or any(s.admissible or (s.feed and s.feed.stale) for s in self.waiting)

    def wake(self) -> None:
        """An event for the loop (text arrived on a stream): any thread; holds cv only to notify."""
        with self.cv:
            self.events += 1
            self.cv.notify_all()

    def enqueue(self, state: RequestState) -> None:
        """Queue a request; raises QueueFullError when the wait queue is full."""
        with self.cv:
            if len(self.waiting) >= self.max_queue + len(self._free_slots):
                raise QueueFullError(f"{len(self.waiting)} requests waiting (limit {self.max_queue})")
            self.waiting.append(state)
            self._states[state.handle] = state
            self.events += 1
            self.cv.notify()

    def cancel(self, handle: RequestHandle) -> RequestState | None:
        """Mark a request cancelled. Returns its state if it was still waiting (it has left the queue, and the
        caller finishes it); a running request stops at the worker's next step."""
        with self.cv:
            state = self._states.get(handle)
            if state is not None:
                state.cancelled = True
            try:
                self.waiting.remove(state)
            except ValueError:
                state = None
            else:
                del self._states[handle]
            self.events += 1
            self.cv.notify()
            return state

    def cancel_all(self) -> None:
        with self.cv:
            for state in self._states.values():
                state.cancelled = True
            self.cv.notify_all()

    @property
    def can_admit(self) -> bool:
        """A request is waiting, admissible, and a slot is free for it (cv held, or a racy hint)."""
        return bool(self._free_slots) and any(s.admissible for s in self.waiting)

    def take_admissions(self) -> list[RequestState]:
        """Pop admissible waiting requests into free slots (FIFO; a streamed request still waiting for the text of
        its prefill keeps its place and lets the ones behind it pass); each gets its `slot`."""
        with self.cv:
            admitted = []
            for state in list(self.waiting):
                if not self._free_slots:
                    break
                if state.admissible:
                    self.waiting.remove(state)
                    state.slot = self._free_slots.pop()
                    admitted.append(state)
            return admitted

    def _read_text(self, state: RequestState) -> bool:
        """Poll a streamed request's text: True when ids were committed or it ended (its budget then grows with the
        ids, and is final at the end). Raises TextTooLongError."""
        if state.feed is None or not state.feed.poll():
            return False
        state.budget = frame_budget(state.request, len(state.feed.ids), self.max_frames)
        state.handle.stats.frame_budget = state.budget
        return True

    def poll_waiting(self) -> list[Retire]:
        """Read the text of streamed requests waiting to be admitted (worker thread; outside cv, as the streams are
        read). Those whose text ended empty (no audio, EOS) or grew too long (ERROR) leave the queue: returned for
        the caller to finish."""
        with self.cv:
            streamed = [s for s in self.waiting if s.feed is not None and s.feed.stale]
        out = []
        for state in streamed:
            try:
                self._read_text(state)
            except (TextTooLongError, RuntimeError) as e:
                out.append(Retire(state, FinishReason.ERROR, str(e)))
                continue
            if state.feed.ended and not state.feed.ids:
                out.append(Retire(state, FinishReason.EOS, None))
        with self.cv:
            gone = [r for r in out if r.state in self.waiting]
            for r in gone:
                self.waiting.remove(r.state)
                self._states.pop(r.state.handle, None)
        return gone

    def poll_running(self) -> list[RequestState]:
        """Read the text of streamed running rows (worker thread): those with new ids or the end, for the runner to
        extend their text track. A row whose text grew too long ends with an error."""
        out = []
        for lv in self.running.values():
            if lv.feed is None or lv.done is not None:
                continue
            try:
                if self._read_text(lv):
                    out.append(lv)
            except (TextTooLongError, RuntimeError) as e:
                lv.done, lv.error = FinishReason.ERROR, str(e)
        return out

    def drain_waiting(self) -> list[RequestState]:
        """Remove and return every waiting request (the engine is dying)."""
        with self.cv:
            out = list(self.waiting)
            self.waiting.clear()
            for state in out:
                self._states.pop(state.handle, None)
            return out

    def release(self, state: RequestState) -> None:
        """The request is over: free its slot (if it had one) and forget it."""
        with self.cv:
            if state.slot >= 0:
                if self.running.get(state.slot) is state:
                    del self.running[state.slot]
                self._free_slots.append(state.slot)
                state.slot = -1
            self._states.pop(state.handle, None)

    def start(self, state: RequestState) -> None:
        """A prefilled request runs in its slot (worker thread)."""
        self.running[state.slot] = state

    # ------------------------------------------------------------------ decisions (worker thread)
    def idle(self) -> None:
        """No request runs: the pause before the next one is no frame step; the step interval is measured afresh."""
        self._last_step_at = self._step_interval = None

    def note_step(self, now: float) -> None:
        """A frame step starts: fold the time since the last one into the moving average (worker thread)."""
        if self._last_step_at is not None:
            dt = now - self._last_step_at
            self._step_interval = (
                dt if self._step_interval is None else self._step_interval + 0.25 * (dt - self._step_interval)
            )
        self._last_step_at = now

    def admission_held(self) -> bool:
        """Whether waiting requests stay queued: requests run and get their frames slower than the budget."""
        budget = self.step_budget_ms
        if not budget or not self.running:
            return False
        return self._step_interval is not None and self._step_interval * 1e3 > budget

    def admit(self) -> Admission:
        """Which waiting requests enter free slots this turn (none while admission is held)."""
        with self.cv:
            held = self.admission_held()
            admitted = [] if held else self.take_admissions()
            return Admission(admitted, held and bool(self.waiting))

    def schedule(self, ahead: list[RequestState] | None, decoder: DecoderProgress) -> StepPlan:
        """The rows that step this turn. `ahead`: the rows of the step launched before and not read yet (or None).

        Requests that were cancelled, failed in the decoder or ran out of budget end here, before any work is done.
        """
        for lv in self.running.values():
            if lv.cancelled:
                lv.done = FinishReason.CANCELLED
            elif lv.decode_error is not None:
                lv.done, lv.error = FinishReason.ERROR, lv.decode_error
                lv.pending.clear()
            elif lv.done is None and lv.frames >= lv.budget:
                lv.done = FinishReason.BUDGET
        lookahead = self.decode_lookahead
        stepping = {id(lv) for lv in ahead} if ahead is not None else set()  # one frame more once read
        rows = []
        held = False
        for lv in self.running.values():
            frame = lv.frames + (id(lv) in stepping)
            # Held: its next frame's text token has not arrived. It is left out of the step like a row waiting for
            # the decoder: nothing of its slot is read or written until the token comes.
            lv.held = lv.done is None and not lv.text_ready(frame)
            held |= lv.held
            if lv.done is None and not lv.held and decoder.inflight(lv) < lookahead and frame < lv.budget:
                rows.append(lv)
        idle = not rows and ahead is None
        wait = idle and decoder.busy  # nothing to step until the decoder catches up
        return StepPlan(rows, stepping, wait, idle and held and not wait)

    def cancel_running(self) -> None:
        """The engine stops: every running request ends cancelled."""
        for lv in self.running.values():
            lv.done = FinishReason.CANCELLED

    def retire(self, decoder: DecoderProgress) -> list[Retire]:
        """The ended rows that leave now: a decoder error ends a row; an ended row leaves once its frames are
        handed to the decoder (EOS, budget) and its audio is out."""
        out = []
        for lv in list(self.running.values()):
            if lv.decode_error is not None and lv.done not in (FinishReason.CANCELLED, FinishReason.ERROR):
                lv.done, lv.error = FinishReason.ERROR, lv.decode_error
                lv.pending.clear()
            if lv.done is None:
                continue
            if lv.done in (FinishReason.EOS, FinishReason.BUDGET) and lv.pending:
                continue  # flushed by the next decode_due
            if decoder.inflight(lv):
                continue  # its audio is still in the decoder
            out.append(Retire(lv, lv.done, lv.error))
        return out
