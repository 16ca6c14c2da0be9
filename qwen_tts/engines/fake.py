"""A deterministic stand-in engine: sine-tone chunks with controllable pacing and failures.

It implements `qwen_tts.engine_api.Engine` on the event loop (no model, no thread), so HTTP-level behaviour
(admission, timeouts, cancellation, failure mapping) can be tested exactly and quickly. `TTS_BACKEND=fake`
(backend "fake" of the factory) serves it, for load-testing the HTTP layer without a model. Text markers drive failures:
`[fail]` fails before any audio, `[fail-mid]` after the first chunk.

A request with a `text_stream` (streaming-text mode) gets audio in proportion to the text received so far: the
engine waits while no new text has come, grows the frame budget with the text, and finishes once the stream has
ended and its text is spoken; `cancel` wakes a wait at once.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from qwen_tts.engine_api import (
    FRAME_SAMPLES,
    SAMPLE_RATE,
    Engine,
    EngineNotReadyError,
    EngineSettings,
    FinishReason,
    QueueFullError,
    RequestHandle,
    SynthesisRequest,
)

DEFAULT_LANGUAGES = ("auto", "chinese", "english", "french", "german", "japanese", "korean", "spanish")
_DEFAULTS = EngineSettings()


class FakeEngine(Engine):
    """Frames per request = min(cap, frames_per_char * len(text)); each frame is FRAME_SAMPLES of a tone.

    The small default capacity (4 slots, 8 waiting) keeps admission tests short; the factory passes the settings'.
    """

    def __init__(
        self,
        xvector_dim: int = 16,
        max_slots: int = 4,
        max_queue: int = 8,
        max_frames: int = _DEFAULTS.max_frames,
        frames_per_char: float = 1.0,
        frame_delay: float = 0.0,
        first_chunk_frames: int = _DEFAULTS.first_chunk_frames,
        chunk_frames: int = _DEFAULTS.chunk_frames,
        start_delay: float = 0.0,
        languages: tuple[str, ...] = DEFAULT_LANGUAGES,
    ):
        self._dim = xvector_dim
        self.max_slots = max_slots
        self.max_queue = max_queue
        self.max_frames = max_frames
        self.frames_per_char = frames_per_char
        self.frame_delay = frame_delay
        self.first_chunk_frames = first_chunk_frames
        self.chunk_frames = chunk_frames
        self.start_delay = start_delay
        self._languages = list(languages)
        self._ready = False
        self._accepting = False
        self._slots: asyncio.Semaphore | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancel_requested: dict[RequestHandle, bool] = {}  # requests not yet ended
        self._wakeups: dict[RequestHandle, asyncio.Event] = {}  # streaming-text requests waiting for text
        self._running = 0
        self._waiting = 0
        self.submitted: list[SynthesisRequest] = []
        self.cancelled: list[str] = []

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> FakeEngine:
        """The fake backend of the factory: the settings' capacity and chunking, 10 ms per frame."""
        return cls(
            max_slots=settings.max_slots,
            max_queue=settings.max_queue,
            max_frames=settings.max_frames,
            first_chunk_frames=settings.first_chunk_frames,
            chunk_frames=settings.chunk_frames,
            frame_delay=0.01,
        )

    async def start(self) -> None:
        if self.start_delay:
            await asyncio.sleep(self.start_delay)
        self._slots = asyncio.Semaphore(self.max_slots)
        self._accepting = True
        self._ready = True

    async def stop(self, drain_timeout: float = 0.0) -> None:
        self._accepting = False
        self._ready = False
        tasks = list(self._tasks.values())
        if tasks and drain_timeout > 0:
            await asyncio.wait(tasks, timeout=drain_timeout)
        for task in self._tasks.values():
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()))

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def xvector_dim(self) -> int:
        return self._dim

    @property
    def languages(self) -> list[str]:
        return self._languages

    @property
    def model_info(self) -> dict:
        return {"name": "fake", "xvector_dim": self._dim, "device": "cpu", "dtype": "float32"}

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_waiting(self) -> int:
        return self._waiting

    def frames_for(self, request: SynthesisRequest, text: str | None = None) -> int:
        """The frame budget for `text` (default: the request's text at submission)."""
        cap = self.cap_for(request)
        chars = len(request.text if text is None else text)
        return max(1, min(cap, max(int(self.frames_per_char * chars), request.min_frames)))

    def cap_for(self, request: SynthesisRequest) -> int:
        """The hard cap on a request's frames: its own max_frames within the engine's."""
        return self.max_frames if request.max_frames is None else min(request.max_frames, self.max_frames)

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        if not self._accepting:
            raise EngineNotReadyError("engine is not accepting requests")
        if request.language.lower() not in self._languages:
            raise ValueError(f"unsupported language {request.language!r}")
        if request.xvector.shape != (self._dim,):
            raise ValueError(f"xvector must have shape ({self._dim},), got {tuple(request.xvector.shape)}")
        if request.text_stream is not None:
            if request.non_streaming_text:
                raise ValueError("a request with a text_stream must have non_streaming_text=False")
        elif not request.text.strip():
            raise ValueError("text is empty")
        if self._running + self._waiting >= self.max_slots + self.max_queue:
            raise QueueFullError(f"{self._waiting} requests waiting (limit {self.max_queue})")
        handle = RequestHandle(request)
        handle.stats.frame_budget = self.frames_for(request)
        self._cancel_requested[handle] = False
        self.submitted.append(request)
        self._waiting += 1
        self._tasks[request.request_id] = asyncio.get_running_loop().create_task(self._serve(handle))
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        if self._cancel_requested.get(handle) is False:
            self._cancel_requested[handle] = True
            self.cancelled.append(handle.request_id)
            wakeup = self._wakeups.get(handle)
            if wakeup is not None:
                wakeup.set()

    def tone(self, request: SynthesisRequest, start_frame: int, frames: int) -> np.ndarray:
        """The samples of frames [start_frame, start_frame + frames) of `request`: one continuous tone."""
        freq = 110.0 + 10.0 * ((request.seed or 0) % 40)
        n = np.arange(start_frame * FRAME_SAMPLES, (start_frame + frames) * FRAME_SAMPLES)
        return (0.3 * np.sin(2 * np.pi * freq * n / SAMPLE_RATE)).astype(np.float32)

    async def _serve(self, handle: RequestHandle) -> None:
        req = handle.request
        assert self._slots is not None
        waiting = True
        try:
            async with self._slots:
                self._waiting -= 1
                waiting = False
                self._running += 1
                try:
                    await self._generate(handle)
                finally:
                    self._running -= 1
        except asyncio.CancelledError:
            handle.finish_threadsafe(FinishReason.CANCELLED)
        finally:
            if waiting:
                self._waiting -= 1
            self._tasks.pop(req.request_id, None)
            self._cancel_requested.pop(handle, None)

    def _emit(self, handle: RequestHandle, done: int, n: int) -> int:
        """Hand frames done ... done + n of the request's tone to its handle, counted in its stats; the new `done`."""
        chunk = self.tone(handle.request, done, n)
        stats = handle.stats
        stats.frames = done + n
        stats.samples += chunk.shape[0]
        if stats.first_audio_at is None:
            stats.first_audio_at = time.monotonic()
        handle.put_threadsafe(chunk)
        return done + n

    async def _generate(self, handle: RequestHandle) -> None:
        req, stats = handle.request, handle.stats
        stats.started_at = time.monotonic()
        if "[fail]" in req.text:
            handle.finish_threadsafe(FinishReason.ERROR, "simulated failure")
            return
        if req.text_stream is not None:
            await self._generate_streamed_text(handle)
            return
        total, done = stats.frame_budget, 0
        while done < total:
            if self._cancel_requested.get(handle):
                handle.finish_threadsafe(FinishReason.CANCELLED)
                return
            n = min(self.first_chunk_frames if done == 0 else self.chunk_frames, total - done)
            if self.frame_delay:
                await asyncio.sleep(self.frame_delay * n)
            done = self._emit(handle, done, n)
            if "[fail-mid]" in req.text:
                handle.finish_threadsafe(FinishReason.ERROR, "simulated failure")
                return
        handle.finish_threadsafe(FinishReason.BUDGET if total == self.max_frames else FinishReason.EOS)

    async def _generate_streamed_text(self, handle: RequestHandle) -> None:
        """Streaming-text mode: frames follow the text received (frames_per_char a character), waiting while no new
        text has come; after `end()` the rest is spoken and the request finishes."""
        req, stats = handle.request, handle.stats
        stream = req.text_stream
        assert stream is not None
        loop = asyncio.get_running_loop()
        wakeup = self._wakeups[handle] = asyncio.Event()

        def on_text() -> None:  # on the producer's thread
            loop.call_soon_threadsafe(wakeup.set)

        stream.add_listener(on_text)
        cap, done = self.cap_for(req), 0
        try:
            while True:
                wakeup.clear()
                if self._cancel_requested.get(handle):
                    handle.finish_threadsafe(FinishReason.CANCELLED)
                    return
                snap = stream.snapshot()
                if "[fail]" in snap.text:
                    handle.finish_threadsafe(FinishReason.ERROR, "simulated failure")
                    return
                target = min(cap, int(self.frames_per_char * len(snap.text)))
                if snap.ended:
                    target = max(target, min(cap, req.min_frames))
                stats.frame_budget = max(target, 1)
                if done >= cap:
                    handle.finish_threadsafe(FinishReason.BUDGET)
                    return
                if done >= target:
                    if snap.ended:
                        handle.finish_threadsafe(FinishReason.EOS)
                        return
                    await wakeup.wait()  # the row is held until more text (or the end, or a cancel) comes
                    continue
                n = min(self.first_chunk_frames if done == 0 else self.chunk_frames, target - done)
                if self.frame_delay:
                    await asyncio.sleep(self.frame_delay * n)
                if self._cancel_requested.get(handle):
                    continue  # the top of the loop finishes it: no chunk after a cancel
                done = self._emit(handle, done, n)
        finally:
            stream.remove_listener(on_text)
            self._wakeups.pop(handle, None)
