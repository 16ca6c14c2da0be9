"""Streamed text on vLLM-Omni: a sentence-level fallback.

The native engine holds a request between text tokens (qwen_tts/engines/native/text_feed.py); a vLLM-Omni request
cannot wait for input once it runs. So a request with a `text_stream` is served sentence by sentence: the stream's
text is cut at sentence ends (`sentencex`, which knows CJK terminators too), each complete sentence is submitted as
a request of its own as soon as it is complete (the text after the last sentence end waits for more text or the
end of the stream), and their audio is handed out in order through the one handle the caller got. Each sentence
is spoken without knowing the next, so the audio is not that of the whole text; sampled sentences get the seeds
seed, seed + 1, ...; a sentence's frame budget (and `max_frames`) is its own, and the handle's budget is their sum.
The first audio waits for the first sentence end (or the end of the stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable

from sentencex import segment

from qwen_tts.engine_api import MAX_SEED, FinishReason, RequestFailedError, RequestHandle, SynthesisRequest
from qwen_tts.languages import ISO_639_1
from qwen_tts.text_stream import TextStream

_CODES = {name: code for code, name in ISO_639_1.items()}


class SentenceCutter:
    """Complete sentences of a growing text, each once, in order."""

    def __init__(self, language: str) -> None:
        self._code = _CODES.get(language, "en")  # auto: English rules, which also end at 。！？
        self._done = 0  # characters of the text already handed out

    def take(self, text: str, ended: bool) -> list[str]:
        """The sentences of `text` not handed out yet that are complete: all but the last, which may go on (all of
        them once `ended`). Whitespace-only pieces are skipped."""
        rest = text[self._done :]
        parts = [p for p in segment(self._code, rest) if p]
        if not ended:
            parts = parts[:-1]
        out = []
        for part in parts:
            at = rest.find(part)
            if at < 0:  # the segmenter changed the text: keep it for the next call
                break
            rest = rest[at + len(part) :]
            self._done = len(text) - len(rest)
            if part.strip():
                out.append(part)
        return out


async def serve_text_stream(
    handle: RequestHandle,
    stream: TextStream,
    language: str,
    submit: Callable[[SynthesisRequest], RequestHandle],
    cancel: Callable[[RequestHandle], None],
) -> None:
    """Serve `handle` (whose request has `stream`) as one request per complete sentence, through `submit`, their
    audio forwarded in order. Cancelling the task cancels every sentence's request and ends the handle cancelled."""
    request, stats = handle.request, handle.stats
    loop = asyncio.get_running_loop()
    arrived = asyncio.Event()

    def listener() -> None:  # any thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(arrived.set)

    queue: asyncio.Queue[RequestHandle | None] = asyncio.Queue()
    parts: list[RequestHandle] = []

    async def read() -> None:
        cutter = SentenceCutter(language)
        while True:
            arrived.clear()
            snap = stream.snapshot()
            for sentence in cutter.take(snap.text, snap.ended):
                n = len(parts)
                seed = None if request.seed is None else (request.seed + n) % (MAX_SEED + 1)
                part = submit(
                    dataclasses.replace(
                        request, text=sentence, text_stream=None, seed=seed, request_id=f"{request.request_id}-{n}"
                    )
                )
                parts.append(part)
                stats.frame_budget += part.stats.frame_budget
                queue.put_nowait(part)
            if snap.ended:
                queue.put_nowait(None)
                return
            await arrived.wait()

    stream.add_listener(listener)
    reader = asyncio.create_task(read())
    reason, error = FinishReason.EOS, None  # a stream that ends with no text: no audio
    try:
        while True:
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():  # the reader failed (a sentence refused): its error ends the request
                getter.cancel()
                reader.result()
            part = getter.result()
            if part is None:
                break
            async for chunk in part:
                if stats.started_at is None:
                    stats.started_at = part.stats.started_at
                if stats.first_audio_at is None:
                    stats.first_audio_at = time.monotonic()
                stats.samples += chunk.size
                handle.put_threadsafe(chunk)
            stats.frames += part.stats.frames
            reason, error = part.stats.finish_reason, part.stats.error
            if reason is FinishReason.CANCELLED:  # cancelled inside the engine (it stops): so is the whole
                break
    except asyncio.CancelledError:
        reason, error = FinishReason.CANCELLED, None
    except RequestFailedError as e:
        reason, error = FinishReason.ERROR, str(e)
    except Exception as e:  # a sentence refused at submission (queue full, engine stopping)
        reason, error = FinishReason.ERROR, f"{type(e).__name__}: {e}"
    finally:
        stream.remove_listener(listener)
        reader.cancel()
        with contextlib.suppress(BaseException):
            await reader
        for part in parts:
            if not part.finished:
                cancel(part)
        if stats.started_at is None:
            stats.started_at = time.monotonic()
        handle.finish_threadsafe(reason, error)
