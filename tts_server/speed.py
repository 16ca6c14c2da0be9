"""`speed`: a pitch-preserving time-stretch of the synthesized audio, whole or streamed.

The stretch is Rubber Band's, through Spotify's `pedalboard` (`pedalboard.time_stretch`): of the libraries measured
(pedalboard, pytsmod's WSOLA and phase vocoder, audiotsm's WSOLA; docs/speed.md has the figures) it is the one
still maintained, its lengths are exact, its output keeps the level (the phase vocoders lose ~1 dB and smear), and
it ships as a wheel with the library inside (no binary to install). pedalboard is GPL-3.0, so it is an optional
extra (`pip install .[speed]`); without it a `speed` other than 1.0 is refused with a 422 that says so.

Streaming: Rubber Band here is a whole-buffer call, so the stream is stretched in blocks. Each block is stretched
with `CONTEXT` samples of the input before it, and the part of its output that belongs to that context is
cross-faded with the held-back end of the previous block's output: the edges of every call fall inside a
cross-fade, and the stream's length is the whole stretch's to within a few samples.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

try:
    import pedalboard
except ImportError:  # the optional 'speed' extra
    pedalboard = None

MIN_SPEED, MAX_SPEED = 0.25, 4.0
CONTEXT = 2400  # input samples (100 ms at 24 kHz) each block is stretched with, cross-faded away
MIN_BLOCK = 4800  # new input samples (200 ms) before a block is stretched: the first chunk (240 ms) goes at once


def available() -> bool:
    return pedalboard is not None


def is_identity(speed: float) -> bool:
    return abs(speed - 1.0) < 1e-9


def stretch(pcm: np.ndarray, rate: int, speed: float) -> np.ndarray:
    """`pcm` (float32 mono) played `speed` times faster at the same pitch: about len(pcm) / speed samples."""
    if is_identity(speed) or pcm.shape[0] == 0:
        return pcm
    if pedalboard is None:
        raise RuntimeError("time-stretching needs the optional 'speed' extra (pedalboard)")
    x = np.ascontiguousarray(pcm, dtype=np.float32)[None, :]
    return pedalboard.time_stretch(x, float(rate), stretch_factor=float(speed), high_quality=True)[0]


class StreamStretcher:
    """Stretch a stream chunk by chunk: `feed` returns what is ready, `close` the rest."""

    def __init__(self, rate: int, speed: float, context: int = CONTEXT, min_block: int = MIN_BLOCK):
        self.rate, self.speed = rate, speed
        self.context, self.min_block = context, min_block
        self._pending = np.zeros(0, np.float32)  # input not yet stretched
        self._left = np.zeros(0, np.float32)  # the last `context` input samples already stretched
        self._held = np.zeros(0, np.float32)  # output of `_left`, cross-faded into the next block

    def _block(self, new: np.ndarray) -> np.ndarray:
        segment = np.concatenate([self._left, new])
        out = stretch(segment, self.rate, self.speed)
        overlap = min(self._held.shape[0], round(self._left.shape[0] / self.speed), out.shape[0])
        if overlap:
            fade = np.linspace(0.0, 1.0, overlap, endpoint=False, dtype=np.float32)
            head = self._held[:overlap] * (1.0 - fade) + out[:overlap] * fade
            out = np.concatenate([self._held[overlap:], head, out[overlap:]])  # _held beyond overlap: rounding
        else:
            out = np.concatenate([self._held, out])
        self._left = segment[-self.context :]
        keep = min(out.shape[0], round(self._left.shape[0] / self.speed))
        self._held = out[out.shape[0] - keep :]
        return out[: out.shape[0] - keep]

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        self._pending = np.concatenate([self._pending, np.asarray(chunk, dtype=np.float32)])
        if self._pending.shape[0] < self.min_block:
            return np.zeros(0, np.float32)
        new, self._pending = self._pending, np.zeros(0, np.float32)
        return self._block(new)

    def close(self) -> np.ndarray:
        out = self._block(self._pending) if self._pending.shape[0] else np.zeros(0, np.float32)
        self._pending = np.zeros(0, np.float32)
        tail, self._held = self._held, np.zeros(0, np.float32)
        return np.concatenate([out, tail])


class StretchedSource:
    """A chunk source (tts_server.synthesis.ChunkSource: one engine request or a long-text chain) whose audio comes
    out `speed` times faster, same pitch.

    `stats` stays the model's (frames and samples generated); `cancel` reaches the engine work underneath."""

    def __init__(self, inner: Any, rate: int, speed: float):
        self.inner = inner
        self.request_id = inner.request_id
        self.stats = inner.stats
        self._stretcher = StreamStretcher(rate, speed)
        self._chunks = self._run()
        self._finished = False

    @property
    def finished(self) -> bool:
        return self._finished

    def cancel(self) -> None:
        self.inner.cancel()

    async def _run(self) -> AsyncIterator[np.ndarray]:
        # Rubber Band runs in a worker thread: a block is milliseconds, but the event loop serves everyone.
        async for chunk in self.inner:
            out = await asyncio.to_thread(self._stretcher.feed, chunk)
            if out.shape[0]:
                yield out
        out = await asyncio.to_thread(self._stretcher.close)
        if out.shape[0]:
            yield out

    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        return self

    async def __anext__(self) -> np.ndarray:
        if self._finished:
            raise StopAsyncIteration
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            self._finished = True
            raise

    async def collect(self) -> np.ndarray:
        """The whole utterance, stretched in one call (no blocks, no cross-fades)."""
        pcm = await self.inner.collect()
        self._finished = True
        return await asyncio.to_thread(stretch, pcm, self._stretcher.rate, self._stretcher.speed)
