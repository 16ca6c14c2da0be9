"""The native engine's scheduler: the wait queue, the KV-cache slots, frame budgets, admission and cancellation,
and the typed state the engine keeps for each request.

Thread-safe through `cv`: the event loop submits and cancels, the engine's worker thread admits and releases.
A request's state belongs to the engine; the caller's `RequestHandle` carries none of it.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

import torch

from qwen_tts.engine_api import FinishReason, QueueFullError, RequestHandle, SynthesisRequest
from qwen_tts.model.prompt import Prompt

# Frame budget from the text length: ~3 frames per text token is normal speech; allow well over twice that.
BUDGET_BASE_FRAMES = 25
BUDGET_FRAMES_PER_TOKEN = 8


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
    # Set at admission, when the request gets a KV-cache slot.
    slot: int = -1
    prompt: Prompt | None = None
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


class Scheduler:
    """Admission to `max_slots` KV-cache slots with at most `max_queue` requests waiting beyond the free ones."""

    def __init__(self, max_slots: int, max_queue: int):
        self.max_slots = max_slots
        self.max_queue = max_queue
        self.cv = threading.Condition()
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.running: dict[int, RequestState] = {}  # slot -> state; touched by the worker thread only
        self._free_slots: list[int] = list(range(max_slots))[::-1]
        self._states: dict[RequestHandle, RequestState] = {}  # every request not yet finished

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def enqueue(self, state: RequestState) -> None:
        """Queue a request; raises QueueFullError when the wait queue is full."""
        with self.cv:
            if len(self.waiting) >= self.max_queue + len(self._free_slots):
                raise QueueFullError(f"{len(self.waiting)} requests waiting (limit {self.max_queue})")
            self.waiting.append(state)
            self._states[state.handle] = state
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
            self.cv.notify()
            return state

    def cancel_all(self) -> None:
        with self.cv:
            for state in self._states.values():
                state.cancelled = True
            self.cv.notify_all()

    @property
    def can_admit(self) -> bool:
        """A request is waiting and a slot is free for it (cv held, or a racy hint)."""
        return bool(self.waiting and self._free_slots)

    def take_admissions(self) -> list[RequestState]:
        """Pop waiting requests into free slots (FIFO); each gets its `slot`."""
        with self.cv:
            admitted = []
            while self.waiting and self._free_slots:
                state = self.waiting.popleft()
                state.slot = self._free_slots.pop()
                admitted.append(state)
            return admitted

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
