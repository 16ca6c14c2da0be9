"""Long input: split the text at sentence boundaries into pieces the model handles comfortably, synthesize them in
order with the same voice and seed, and join them into one stream.

Splitting uses `sentencex` (Wikimedia's rule-based segmenter, ~300 languages, it knows 。！？ and their full-width
kin); sentences are then packed greedily into pieces of at most `PIECE_BYTES` UTF-8 bytes, which bounds both the
speech per piece (about 20 s of English, 100 Chinese characters) and the text tokens (a byte-level tokenizer makes
at most one token per byte). A sentence longer than that is cut at clause punctuation, then at spaces, then hard.

`PieceChain` looks like a `RequestHandle` to the routes (async iteration, `stats`, `finished`, `collect`): it
submits the first piece at once (so refusals surface as they do for one request), the next piece as soon as the
current one yields audio (its prefill runs while the current piece decodes), and at most two pieces are in the
engine at a time. Joins are click-free: the last `FADE_SAMPLES` of a piece fade out to zero and the first of the
next fade in from zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import re
import time
from collections.abc import AsyncIterator

import numpy as np
from sentencex import segment

from qwen_tts.engine_api import (
    Engine,
    FinishReason,
    QueueFullError,
    RequestFailedError,
    RequestHandle,
    RequestStats,
    SynthesisRequest,
)

PIECE_BYTES = 300
FADE_SAMPLES = 240  # 10 ms at 24 kHz
RETRY_S = 0.05  # a later piece that finds the engine queue full waits this long and tries again

# The engine's language names -> sentencex's codes. Auto (and anything else) uses English rules, which also end
# sentences at the CJK terminators.
_LANG_CODES = {
    "chinese": "zh",
    "japanese": "ja",
    "korean": "ko",
    "english": "en",
    "french": "fr",
    "german": "de",
    "spanish": "es",
    "italian": "it",
    "portuguese": "pt",
    "russian": "ru",
}
_CLAUSE_END = re.compile(r"(?<=[,;:，、；：])")
_SPACE = re.compile(r"(?<=\s)")


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


def _hard_cut(text: str, limit: int) -> list[str]:
    out, current = [], ""
    for ch in text:
        if current and _size(current + ch) > limit:
            out.append(current)
            current = ""
        current += ch
    return [*out, current] if current else out


def _pack(parts: list[str], limit: int, finer: list[re.Pattern]) -> list[str]:
    """Greedily join consecutive `parts` into pieces of at most `limit` bytes; a part that alone is too long is
    split by the next pattern in `finer` (and finally character by character)."""
    pieces: list[str] = []
    current = ""
    for part in parts:
        if _size(part) > limit:
            if current:
                pieces.append(current)
                current = ""
            if finer:
                sub = [p for p in finer[0].split(part) if p]
                pieces.extend(_pack(sub, limit, finer[1:]))
            else:
                pieces.extend(_hard_cut(part, limit))
            continue
        if current and _size(current + part) > limit:
            pieces.append(current)
            current = ""
        current += part
    if current:
        pieces.append(current)
    return pieces


def split_text(text: str, language: str = "auto", limit: int = PIECE_BYTES) -> list[str]:
    """Pieces of `text` in order, each at most `limit` UTF-8 bytes, cut at sentence boundaries where possible.
    Paragraph breaks always end a piece. Whitespace-only pieces are dropped."""
    code = _LANG_CODES.get(language.strip().lower(), "en")
    pieces: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        if not paragraph.strip():
            continue
        sentences = [s for s in segment(code, paragraph) if s]
        pieces.extend(_pack(sentences, limit, [_CLAUSE_END, _SPACE]))
    return [p.strip() for p in pieces if p.strip()]


def needs_split(text: str, limit: int = PIECE_BYTES) -> bool:
    return _size(text) > limit or bool(re.search(r"\n\s*\n", text.strip()))


_END = object()


class PieceChain:
    """The pieces of one long request as one handle: audio in piece order, faded at the joins.

    Each submitted piece has a reader task that drains its engine handle into the piece's queue as the engine
    produces it (not at the client's pace), and a feeder submits piece k+1 as soon as piece k has produced audio
    and piece k-1 has finished: the next prefill overlaps the current decode, and at most two pieces of a chain
    are in the engine at once. `stats` adds up the pieces' (frames, budgets); `samples` counts what was yielded.
    """

    def __init__(self, engine: Engine, request: SynthesisRequest, pieces: list[str], fade: int = FADE_SAMPLES):
        if request.seed is None:
            request.seed = random.getrandbits(62)  # one seed for every piece: the same voice throughout
        self.request = request
        self.request_id = request.request_id
        self.stats = RequestStats(request.request_id)
        self._engine = engine
        self._requests = [
            dataclasses.replace(request, text=text, request_id=f"{request.request_id}-p{i}")
            for i, text in enumerate(pieces)
        ]
        n = len(pieces)
        self._fade = fade
        self._handles: list[RequestHandle] = []
        self._queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(n)]
        self._started = [asyncio.Event() for _ in range(n)]  # produced audio, or ended
        self._ended = [asyncio.Event() for _ in range(n)]
        self._tasks: list[asyncio.Task] = []
        self._cancelled = False
        self._finished = False
        self._submit(0)  # the first piece: QueueFullError / ValueError reach the caller as for one request
        if n > 1:
            self._tasks.append(asyncio.get_running_loop().create_task(self._feed()))
        self._chunks = self._run()

    @property
    def pieces(self) -> list[str]:
        return [r.text for r in self._requests]

    @property
    def finished(self) -> bool:
        return self._finished

    def cancel(self) -> None:
        """Cancel every piece still in the engine and every task of the chain; nothing more is submitted."""
        self._cancelled = True
        for task in self._tasks:
            if not task.done():
                task.cancel()
        for handle in self._handles:
            if not handle.finished and handle.stats.finish_reason is None:
                self._engine.cancel(handle)

    def _submit(self, k: int) -> None:
        handle = self._engine.submit(self._requests[k])
        self._handles.append(handle)
        self.stats.frame_budget += handle.stats.frame_budget
        self._tasks.append(asyncio.get_running_loop().create_task(self._read(k, handle)))

    async def _read(self, k: int, handle: RequestHandle) -> None:
        queue = self._queues[k]
        try:
            async for chunk in handle:
                queue.put_nowait(chunk)
                self._started[k].set()
            queue.put_nowait(_END)
        except RequestFailedError as e:
            queue.put_nowait(e)
        finally:
            self._started[k].set()
            self._ended[k].set()

    async def _feed(self) -> None:
        """Submit pieces 1.. in turn: piece k once piece k-1 is producing audio and piece k-2 has finished.
        A full engine queue is waited out (the chain already holds its place in the server's admission)."""
        for k in range(1, len(self._requests)):
            await self._started[k - 1].wait()
            if k >= 2:
                await self._ended[k - 2].wait()
            while not self._cancelled:
                try:
                    self._submit(k)
                    break
                except QueueFullError:
                    await asyncio.sleep(RETRY_S)
                except Exception as e:  # the engine refused the piece or stopped: the request fails there
                    self._queues[k].put_nowait(RequestFailedError(f"piece {k}: {e}"))
                    return
            if self._cancelled:
                return

    def _absorb(self, handle: RequestHandle) -> None:
        s, p = self.stats, handle.stats
        if s.started_at is None:
            s.started_at = p.started_at
        if s.first_audio_at is None:
            s.first_audio_at = p.first_audio_at
        s.frames += p.frames

    def _finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.stats.finish_reason = reason
        self.stats.error = error
        self.stats.finished_at = time.monotonic()
        self._finished = True

    async def _pieces(self, k: int) -> AsyncIterator[np.ndarray]:
        queue = self._queues[k]
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            if self.stats.first_audio_at is None:
                self.stats.first_audio_at = self._handles[k].stats.first_audio_at
            yield np.asarray(item, dtype=np.float32)

    async def _run(self) -> AsyncIterator[np.ndarray]:
        n, fade = len(self._requests), self._fade
        ramp = np.arange(fade, dtype=np.float32) / fade  # ramp[0] = 0: a join starts from silence
        reason = FinishReason.EOS
        try:
            for i in range(n):
                last = i == n - 1
                pos = 0  # samples of this piece seen
                tail = np.zeros(0, np.float32)  # held back: faded out once the piece is known to end
                async for chunk in self._pieces(i):
                    if i > 0 and pos < fade:
                        chunk = chunk.copy()
                        k = min(fade - pos, chunk.shape[0])
                        chunk[:k] *= ramp[pos : pos + k]
                    pos += chunk.shape[0]
                    if not last:
                        buf = np.concatenate([tail, chunk])
                        cut = max(0, buf.shape[0] - fade)
                        chunk, tail = buf[:cut], buf[cut:]
                    if chunk.shape[0]:
                        yield chunk
                self._absorb(self._handles[i])
                if tail.shape[0]:
                    yield (tail * ramp[::-1][fade - tail.shape[0] :]).astype(np.float32)  # ends at 0
                piece_reason = self._handles[i].stats.finish_reason
                if piece_reason is FinishReason.CANCELLED:
                    reason = piece_reason
                    break
                if piece_reason is FinishReason.BUDGET:
                    reason = FinishReason.BUDGET
        except RequestFailedError as e:
            self._finish(FinishReason.ERROR, str(e))
            self.cancel()
            raise
        self._finish(reason)
        self.cancel()  # nothing is left running; this only ends the chain's finished tasks

    # --- the RequestHandle surface the server uses ---------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        return self

    async def __anext__(self) -> np.ndarray:
        if self._finished:
            raise StopAsyncIteration
        chunk = await self._chunks.__anext__()
        self.stats.samples += chunk.shape[0]
        return chunk

    async def collect(self) -> np.ndarray:
        chunks = [c async for c in self]
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
