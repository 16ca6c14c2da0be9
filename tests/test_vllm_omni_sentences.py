"""The vLLM-Omni backend's fallback for streamed text (qwen_tts/engines/vllm_omni/sentences.py): sentences cut from
a growing text, each submitted once it is complete, their audio in order through one handle. Driven here through
the native engine's submit on the tiny checkpoint (the module needs no vLLM)."""

from __future__ import annotations

import asyncio

import numpy as np

from qwen_tts.engine_api import FinishReason, RequestHandle, SynthesisRequest
from qwen_tts.engines.vllm_omni.sentences import SentenceCutter, serve_text_stream
from qwen_tts.text_stream import TextStream
from tests.test_engine import make_engine, started, xvec


def test_the_cutter_hands_out_complete_sentences_once_and_the_rest_at_the_end():
    cut = SentenceCutter("english")
    assert cut.take("Hello there", False) == []
    assert cut.take("Hello there. How are", False) == ["Hello there. "]
    assert cut.take("Hello there. How are you? I met Dr.", False) == ["How are you? "]
    assert cut.take("Hello there. How are you? I met Dr. Smith. ", False) == []  # the last may go on
    assert cut.take("Hello there. How are you? I met Dr. Smith. Bye", True) == ["I met Dr. Smith. ", "Bye"]
    assert cut.take("Hello there. How are you? I met Dr. Smith. Bye", True) == []
    cjk = SentenceCutter("chinese")
    assert cjk.take("你好世界。今天天气", False) == ["你好世界。"]
    assert SentenceCutter("auto").take("One.\n\n  ", True) == ["One."]  # whitespace is not a sentence


async def test_sentences_are_submitted_as_they_complete_and_their_audio_comes_in_order(tiny_qwen3tts):
    model = tiny_qwen3tts
    eng = make_engine(model, batch_invariant_decode=True)  # a request's audio: a function of its codes alone
    submitted: list[tuple[str, bool]] = []
    async with started(eng):
        stream = TextStream()

        def submit(r: SynthesisRequest) -> RequestHandle:
            submitted.append((r.text, stream.ended))
            return eng.submit(r)

        request = SynthesisRequest(
            text="", xvector=xvec(model, 0), seed=11, text_stream=stream, non_streaming_text=False, max_frames=20
        )
        handle = RequestHandle(request)
        task = asyncio.create_task(serve_text_stream(handle, stream, "english", submit, eng.cancel))
        for piece in ["Hello the", "re. How are", " you? Fi", "ne"]:
            stream.push(piece)
            await asyncio.sleep(0.05)
        stream.end()
        audio = await handle.collect()
        await task
        alone = []
        for i, text in enumerate(["Hello there. ", "How are you? ", "Fine"]):
            r = SynthesisRequest(
                text=text, xvector=xvec(model, 0), seed=11 + i, non_streaming_text=False, max_frames=20
            )
            alone.append(await eng.submit(r).collect())
    assert submitted == [("Hello there. ", False), ("How are you? ", False), ("Fine", True)]
    np.testing.assert_array_equal(audio, np.concatenate(alone))
    assert handle.stats.finish_reason in (FinishReason.EOS, FinishReason.BUDGET)
    assert handle.stats.samples == audio.size > 0 and handle.stats.frames * 1920 == audio.size
    assert stream._listeners == []


async def test_cancel_ends_the_handle_and_every_sentence_and_an_empty_stream_says_nothing(tiny_qwen3tts):
    model = tiny_qwen3tts
    eng = make_engine(model)
    async with started(eng):
        parts: list[RequestHandle] = []

        def submit(r: SynthesisRequest) -> RequestHandle:
            parts.append(eng.submit(r))
            return parts[-1]

        stream = TextStream("One sentence here. Another one. And")
        x = xvec(model, 0)
        handle = RequestHandle(SynthesisRequest(text="", xvector=x, text_stream=stream, min_frames=200))
        task = asyncio.create_task(serve_text_stream(handle, stream, "english", submit, eng.cancel))
        while not parts or parts[0].stats.first_audio_at is None:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.wait_for(task, 2)
        await asyncio.wait_for(handle.collect(), 2)
        assert handle.stats.finish_reason is FinishReason.CANCELLED and len(parts) == 2
        for part in parts:
            await asyncio.wait_for(part.collect(), 2)
            assert part.stats.finish_reason is FinishReason.CANCELLED
        assert stream._listeners == []

        empty = TextStream(" ")
        handle = RequestHandle(SynthesisRequest(text="", xvector=x, text_stream=empty))
        task = asyncio.create_task(serve_text_stream(handle, empty, "auto", submit, eng.cancel))
        empty.end()
        assert (await asyncio.wait_for(handle.collect(), 2)).size == 0
        assert handle.stats.finish_reason is FinishReason.EOS and len(parts) == 2
