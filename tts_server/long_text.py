"""Long input: split the text at sentence boundaries into pieces the model handles comfortably, synthesize them in
order with the same voice and seed, and join them into one stream.

Splitting uses `sentencex` (Wikimedia's rule-based segmenter, ~300 languages, it knows 。！？ and their full-width
kin); sentences are then packed greedily into pieces of at most `PIECE_BYTES` UTF-8 bytes, which bounds both the
speech per piece (about 20 s of English, 100 Chinese characters) and the text tokens (a byte-level tokenizer makes
at most one token per byte). A sentence longer than that is cut at clause punctuation, then at spaces, then hard.
Short paragraphs share a piece (a paragraph break is the preferred cut, once a piece holds `MIN_PIECE_BYTES`), so
a text of many tiny paragraphs is a few pieces, not one engine request each.

`PieceChain` is an `AudioHandle`, as a `RequestHandle` is (async iteration, `stats`, `finished`, `collect`): it
submits the first piece at once (so refusals surface as they do for one request), the next piece as soon as the
current one yields audio (its prefill runs while the current piece decodes), and at most two pieces are in the
engine at a time. Joins are click-free: the last `FADE_SAMPLES` of a piece fade out to zero and the first of the
next fade in from zero. The request's frame cap (`max_frames`: max_new_tokens) holds for the whole chain, not for
each piece.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator

import numpy as np
from sentencex import segment

from qwen_tts.engine_api import (
    FRAME_SAMPLES,
    AudioHandle,
    Engine,
    FinishReason,
    QueueFullError,
    RequestFailedError,
    RequestHandle,
    SynthesisRequest,
    draw_seed,
)

logger = logging.getLogger("tts_server.long_text")

PIECE_BYTES = 300
# A piece ends at a paragraph break only once it holds this much (about 6 s of English): short paragraphs share a
# piece instead of each paying a prefill, a text budget and a join.
MIN_PIECE_BYTES = 100
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


def _sentences(paragraph: str, code: str, limit: int) -> list[str]:
    """The paragraph's sentences (with their trailing whitespace), a sentence over `limit` bytes cut into parts of
    at most `limit` at clause punctuation, then at spaces, then anywhere."""
    out: list[str] = []
    for sentence in segment(code, paragraph):
        if not sentence:
            continue
        out.extend(_pack([sentence], limit, [_CLAUSE_END, _SPACE]) if _size(sentence) > limit else [sentence])
    return out


def split_text(
    text: str, language: str = "auto", limit: int = PIECE_BYTES, min_size: int = MIN_PIECE_BYTES
) -> list[str]:
    """Pieces of `text` in order, each at most `limit` UTF-8 bytes, cut at sentence boundaries where possible.

    Paragraphs (blank-line separated) are packed together while they fit in one piece, so many short paragraphs
    make few pieces, not one each. A paragraph break is the preferred cut: a piece of at least `min_size` bytes
    ends there when the next paragraph does not fit whole; a smaller one goes on with the next paragraph's
    sentences. Paragraphs in one piece are joined by a newline. Whitespace-only pieces are dropped."""
    code = _LANG_CODES.get(language.strip().lower(), "en")
    pieces: list[str] = []
    current = ""
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        if current:
            if _size(current) + 1 + _size(paragraph) <= limit:  # the whole paragraph fits: pack it
                current = f"{current}\n{paragraph}"
                continue
            if _size(current) >= min_size:  # big enough: cut at the paragraph break
                pieces.append(current)
                current = ""
            else:  # too small to stand alone: fill it up with the paragraph's first sentences
                current += "\n"
        for sentence in _sentences(paragraph, code, limit):
            if current.strip() and _size(current + sentence) > limit:
                pieces.append(current)
                current = ""
            current += sentence
    pieces.append(current)
    return [p.strip() for p in pieces if p.strip()]


def needs_split(text: str, limit: int = PIECE_BYTES) -> bool:
    return _size(text) > limit or bool(re.search(r"\n\s*\n", text.strip()))


_END = object()


class PieceChain(AudioHandle):
    """The pieces of one long request as one handle: audio in piece order, faded at the joins.

    Each submitted piece has a reader task that drains its engine handle into the piece's queue as the engine
    produces it (not at the client's pace), and a feeder submits piece k+1 as soon as piece k has produced audio
    and piece k-1 has finished: the next prefill overlaps the current decode, and at most two pieces of a chain
    are in the engine at once. `stats` adds up the pieces' (frames, budgets); `samples` counts what was yielded.

    The request's `max_frames` (max_new_tokens) caps the whole chain, not each piece: each piece's own budget still
    comes from its text (the engine's), and the chain's audio stops at `max_frames` frames in all, finishing with
    FinishReason.BUDGET. A later piece is submitted with at most the frames not yet produced by the pieces before it
    (nothing is submitted once none are left); as those may still be producing, a piece is also cancelled as soon as
    the pieces before it and its own audio reach the cap (it cannot contribute more), and the audio is cut there.
    """

    def __init__(self, engine: Engine, request: SynthesisRequest, pieces: list[str], fade: int = FADE_SAMPLES):
        if request.seed is None:
            request.seed = draw_seed()  # one seed for every piece: the same voice throughout
        super().__init__(request)
        self._engine = engine
        self._requests = [
            dataclasses.replace(request, text=text, request_id=f"{request.request_id}-p{i}")
            for i, text in enumerate(pieces)
        ]
        n = len(pieces)
        self._fade = fade
        self._cap = request.max_frames  # frames for the whole request; None: only each piece's own budget
        self._cap_samples = None if self._cap is None else self._cap * FRAME_SAMPLES
        self._handles: list[RequestHandle] = []
        self._got = [0] * n  # samples each piece has produced so far
        self._last: int | None = None  # the last piece whose audio can be heard, once the cap is reached
        self._queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(n)]
        self._started = [asyncio.Event() for _ in range(n)]  # produced audio, or ended
        self._ended = [asyncio.Event() for _ in range(n)]
        self._tasks: list[asyncio.Task] = []
        self._cancelled = False
        self._submit(0)  # the first piece: QueueFullError / ValueError reach the caller as for one request
        if n > 1:
            self._tasks.append(asyncio.get_running_loop().create_task(self._feed()))
        self._chunks = self._run()

    @property
    def pieces(self) -> list[str]:
        return [r.text for r in self._requests]

    @property
    def submitted(self) -> int:
        """Pieces submitted to the engine so far."""
        return len(self._handles)

    def cancel(self) -> None:
        """Cancel every piece still in the engine and every task of the chain; nothing more is submitted."""
        self._cancelled = True
        for task in self._tasks:
            if not task.done():
                task.cancel()
        for handle in self._handles:
            self._cancel_handle(handle)

    def _cancel_handle(self, handle: RequestHandle) -> None:
        if not handle.finished and handle.stats.finish_reason is None:
            self._engine.cancel(handle)

    def frames_left(self, k: int) -> int | None:
        """Frames piece k may produce at most: the cap less what the pieces before it have produced so far (they
        may produce more; see `_check_cap`). None without a cap."""
        if self._cap is None:
            return None
        return self._cap - sum(self._got[:k]) // FRAME_SAMPLES

    def _submit(self, k: int) -> None:
        request = self._requests[k]
        left = self.frames_left(k)
        if left is not None:
            request.max_frames = left if request.max_frames is None else min(request.max_frames, left)
        handle = self._engine.submit(request)
        self._handles.append(handle)
        self.stats.frame_budget += handle.stats.frame_budget
        if self._cap is not None:
            self.stats.frame_budget = min(self.stats.frame_budget, self._cap)
        self._tasks.append(asyncio.get_running_loop().create_task(self._read(k, handle)))

    def _check_cap(self) -> None:
        """Once the audio of pieces 0..j reaches the cap, whatever comes after it is never heard: cancel piece j
        (it has produced all it can contribute: the pieces before it only grow) and every piece after it, and
        submit nothing more."""
        if self._cap_samples is None:
            return
        before = 0
        for j, got in enumerate(self._got):
            if before + got >= self._cap_samples:
                if self._last is None or j < self._last:  # an earlier piece can now reach it on its own
                    self._last = j
                    for handle in self._handles[j:]:
                        self._cancel_handle(handle)
                return
            before += got

    async def _read(self, k: int, handle: RequestHandle) -> None:
        queue = self._queues[k]
        try:
            async for chunk in handle:
                self._got[k] += chunk.shape[0]
                queue.put_nowait(chunk)
                self._started[k].set()
                self._check_cap()
            queue.put_nowait(_END)
        except RequestFailedError as e:
            queue.put_nowait(e)
        finally:
            self._started[k].set()
            self._ended[k].set()

    def _stop_feeding(self, k: int) -> None:
        """Pieces k.. are never submitted: their queues end empty, so nothing waits for them."""
        for i in range(k, len(self._requests)):
            self._queues[i].put_nowait(_END)
            self._started[i].set()
            self._ended[i].set()

    async def _feed(self) -> None:
        """Submit pieces 1.. in turn: piece k once piece k-1 is producing audio and piece k-2 has finished, with
        at most the frames left. A full engine queue is waited out (the chain already holds its place in the
        server's admission)."""
        for k in range(1, len(self._requests)):
            await self._started[k - 1].wait()
            if k >= 2:
                await self._ended[k - 2].wait()
            if self._last is not None or (self._cap is not None and self.frames_left(k) <= 0):
                self._stop_feeding(k)  # the cap is reached: piece k would never be heard
                return
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

    def _finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.stats.finish_reason = reason
        self.stats.error = error
        self.stats.finished_at = time.monotonic()
        self._finished = True
        logger.debug(
            "request %s: %d of %d pieces submitted, %d frames (cap %s), %s",
            self.request_id,
            len(self._handles),
            len(self._requests),
            self.stats.frames,
            self._cap,
            reason.value,
        )

    async def _run(self) -> AsyncIterator[np.ndarray]:
        n, fade = len(self._requests), self._fade
        ramp = np.arange(fade, dtype=np.float32) / fade  # ramp[0] = 0: a join starts from silence
        room = self._cap_samples  # samples the request may still yield (None: no cap)
        reason = FinishReason.EOS
        produced = 0
        try:
            for i in range(n):
                last = i == n - 1
                pos = 0  # samples of this piece seen
                tail = np.zeros(0, np.float32)  # held back: faded out once the piece is known to end
                queue = self._queues[i]
                cut = False
                while not cut:
                    item = await queue.get()
                    if item is _END:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    if self.stats.first_audio_at is None:
                        self.stats.started_at = self._handles[i].stats.started_at
                        self.stats.first_audio_at = self._handles[i].stats.first_audio_at
                    chunk = np.asarray(item, dtype=np.float32)
                    if room is not None and chunk.shape[0] > room - pos:
                        chunk, cut = chunk[: room - pos], True  # the request's cap: its audio ends here
                    if i > 0 and pos < fade:
                        chunk = chunk.copy()
                        k = min(fade - pos, chunk.shape[0])
                        chunk[:k] *= ramp[pos : pos + k]
                    pos += chunk.shape[0]
                    if not last:
                        buf = np.concatenate([tail, chunk])
                        keep = max(0, buf.shape[0] - fade)
                        chunk, tail = buf[:keep], buf[keep:]
                    if chunk.shape[0]:
                        yield chunk
                produced += pos
                if room is not None:
                    room -= pos
                if tail.shape[0]:
                    yield (tail * ramp[::-1][fade - tail.shape[0] :]).astype(np.float32)  # ends at 0
                if cut or i >= len(self._handles):  # cut at the cap, or never submitted: the cap came before it
                    reason = FinishReason.BUDGET
                    break
                piece_reason = self._handles[i].stats.finish_reason
                if room == 0:  # the cap is used up exactly at this piece's end
                    ended_itself = piece_reason in (FinishReason.EOS, FinishReason.BUDGET)
                    reason = piece_reason if last and ended_itself else FinishReason.BUDGET
                    break
                if piece_reason is FinishReason.CANCELLED:
                    reason = piece_reason
                    break
                if piece_reason is FinishReason.BUDGET:
                    reason = FinishReason.BUDGET
        except RequestFailedError as e:
            self.stats.frames = -(-produced // FRAME_SAMPLES)
            self._finish(FinishReason.ERROR, str(e))
            self.cancel()
            raise
        if self.stats.started_at is None:
            self.stats.started_at = self._handles[0].stats.started_at
        self.stats.frames = -(-produced // FRAME_SAMPLES)
        self._finish(reason)
        self.cancel()  # stops pieces past the cap; otherwise this only ends the chain's finished tasks

    # --- AudioHandle: the chain's audio, one chunk at a time ---------------------------------------------
    async def __anext__(self) -> np.ndarray:
        if self._finished:
            raise StopAsyncIteration
        chunk = await self._chunks.__anext__()
        self.stats.samples += chunk.shape[0]
        return chunk
