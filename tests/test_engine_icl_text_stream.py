"""Native engine: ICL requests (`SynthesisRequest.icl`) with streamed text (`text_stream`) on the tiny random
checkpoint. The streaming-mode ICL prompt holds the reference transcript and the first k = frames + 1 - transcript
tokens of the target text beside the reference code block, the rest trails one token per frame: a streamed ICL
request waits in the queue for those k tokens (or the end of its text), then is fed and held as an x-vector row.
Its codes are those of the whole text in streaming-text mode, greedy and sampled, for a reference with k > 0 and one
with k == 0; a held ICL row changes no other row's codes; its audio is the decode-and-cut; a cancel while it waits
ends it at once; its budget grows with the text."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
from test_engine_icl import loop_audio, reference
from test_engine_text_stream import (
    cancel_while_waiting,
    count_held_turns,
    cuda_graphs_engine,
    no_eos,
    produce,
    random_split,
    wait_until,
)

from qwen_tts.engine_api import FinishReason, SynthesisRequest
from qwen_tts.engines.native.engine import NativeEngine
from qwen_tts.engines.native.scheduler import frame_budget
from qwen_tts.icl import IclReference
from qwen_tts.model.icl_prompt import icl_prefill_tokens, ref_text_ids
from qwen_tts.text_stream import TextStream
from tests.test_engine import codes_of, make_engine, started, xvec

TEXT = "The quick brown fox jumps over the lazy dog, then naps."
# A long reference with a short transcript: the prefill holds the first target tokens (k > 0).
LONG_REF = reference(20, "Hi.", "sha256:long-ref", 11)
# A short reference with a long transcript: the prefill holds no target token, the transcript's rest trails (k == 0).
SHORT_REF = reference(6, "What the first clip says.", "sha256:short-ref", 12)
VOICES = {"k>0": LONG_REF, "k=0": SHORT_REF}
SETUPS = {
    "in-turn": dict(),
    # The fixed-shape step and padded decode that CUDA graphs replay, run eagerly, each step launched one turn ahead.
    "padded-overlapped": dict(frame_step="padded", overlap_steps=True),
}


@pytest.fixture(scope="module")
def tiny_model(tiny_qwen3tts):
    return tiny_qwen3tts


def prefill_tokens(model, voice: IclReference) -> int:
    return icl_prefill_tokens(len(ref_text_ids(model.tokenizer, voice.text)), voice.frames)


def whole(model, text: str, voice: IclReference | None, seed: int, **kw) -> SynthesisRequest:
    """The whole text in streaming-text mode."""
    return SynthesisRequest(
        text=text, xvector=xvec(model, seed), seed=seed, icl=voice, non_streaming_text=False, return_codes=True, **kw
    )


def streamed(model, stream: TextStream, voice: IclReference, seed: int, **kw) -> SynthesisRequest:
    return whole(model, stream.snapshot().text, voice, seed, text_stream=stream, **kw)


def count_prefills(eng: NativeEngine) -> list[tuple[int, bool]]:
    """(committed ids, text ended) of every streamed request when the runner builds its prompt (admit wrapped)."""
    runner, seen = eng._runner, []
    admit = runner.admit

    def recording(admitted):
        seen.extend((len(lv.feed.ids), lv.feed.ended) for lv in admitted if lv.feed is not None)
        return admit(admitted)

    runner.admit = recording
    return seen


async def produce_staged(eng: NativeEngine, stream: TextStream, text: str, need: int, rng: random.Random) -> None:
    """Push `text` up to the first word boundary where `need` tokens are committed, wait until the request has left
    the queue (prefilled), then push the rest in random pieces (mid-word cuts included) and end."""
    tok, words = eng._runner.tokenizer, text.split(" ")
    j = next(i for i in range(1, len(words)) if len(tok.text_ids(" ".join(words[:i]))) >= need)
    stream.push(" ".join(words[:j]) + " ")  # a space after the last word: all of it committed
    await wait_until(lambda: eng.num_waiting == 0)
    await produce(stream, random_split(" ".join(words[j:]), rng, mid_word=True), rng, 0.02, eng)


def test_the_references_cover_both_prompt_shapes(tiny_model):
    n_text = len(tiny_model.tokenizer.text_ids(TEXT))
    assert 0 < prefill_tokens(tiny_model, LONG_REF) < n_text  # some of the text in the prefill, the rest trails
    assert prefill_tokens(tiny_model, SHORT_REF) == 0  # the transcript alone fills T[:T2]
    assert len(ref_text_ids(tiny_model.tokenizer, SHORT_REF.text)) > SHORT_REF.frames + 1  # and part of it trails


@pytest.mark.parametrize("voice", list(VOICES))
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("setup", list(SETUPS))
async def test_streamed_text_gives_the_codes_and_audio_of_the_whole_text(tiny_model, voice, greedy, setup):
    icl = VOICES[voice]
    k = prefill_tokens(tiny_model, icl)
    rng = random.Random(f"{voice}-{greedy}-{setup}")
    eng = make_engine(tiny_model, first_chunk_frames=2, chunk_frames=4, **SETUPS[setup])
    held = count_held_turns(eng)
    prefills = count_prefills(eng)
    async with started(eng):
        with no_eos(tiny_model):  # every frame runs: all of the text is read
            ref = eng.submit(whole(tiny_model, TEXT, icl, 7, greedy=greedy, max_frames=24))
            ref_audio = await ref.collect()
            ref_codes = codes_of(ref)
            assert ref_codes.shape == (24, 16) and ref.stats.finish_reason is FinishReason.BUDGET
            for staged, mid_word in ((True, True), (False, False), (False, True)):
                stream = TextStream()
                h = eng.submit(streamed(tiny_model, stream, icl, 7, greedy=greedy, max_frames=24))
                if staged:  # surely prefilled before the text ends: its prefill's text first, the rest once it runs
                    feed = produce_staged(eng, stream, TEXT, max(k, 1), rng)
                else:
                    pieces = random_split(TEXT, rng, mid_word=mid_word)
                    feed = produce(stream, pieces, rng, 0.02, eng)
                audio, _ = await asyncio.gather(h.collect(), feed)
                assert torch.equal(codes_of(h), ref_codes), (staged, mid_word, stream.snapshot().text)
                assert h.stats.finish_reason is FinishReason.BUDGET and h.stats.frames == 24
                assert h.stats.frame_budget == ref.stats.frame_budget
                # the decode-and-cut (the voice's Code2Wav prime), as the whole text's
                assert audio.shape == ref_audio.shape
                np.testing.assert_allclose(audio, loop_audio(tiny_model, h.request, ref_codes), rtol=1.3e-6, atol=1e-5)
        # With end-of-speech sampled as usual: the same end at the same frame.
        ref = eng.submit(whole(tiny_model, TEXT, icl, 3, greedy=greedy, min_frames=12, max_frames=40))
        await ref.collect()
        stream = TextStream()
        h = eng.submit(streamed(tiny_model, stream, icl, 3, greedy=greedy, min_frames=12, max_frames=40))
        await asyncio.gather(produce(stream, random_split(TEXT, rng, True), rng, 0.02, eng), h.collect())
        assert torch.equal(codes_of(h), codes_of(ref))
        assert h.stats.finish_reason is ref.stats.finish_reason
    assert held[0] > 0  # rows really waited for their text
    # Each streamed request was prefilled once the prompt's k target tokens (at least the first) were committed, or
    # its whole text; the staged one before its text ended.
    assert len(prefills) == 4 and all(n >= max(k, 1) or ended for n, ended in prefills), prefills
    assert not prefills[0][1], prefills


async def test_a_text_shorter_than_the_prefills_share_waits_for_its_end(tiny_model):
    """k > 0 and the whole text has fewer tokens: the prompt is the whole text + teos padded with tpad (nothing
    trails), so the request waits in the queue until the stream ends, then gives the whole text's codes."""
    short = "A short one."
    n = len(tiny_model.tokenizer.text_ids(short))
    assert 1 < n < prefill_tokens(tiny_model, LONG_REF)
    eng = make_engine(tiny_model)
    prefills = count_prefills(eng)
    async with started(eng):
        with no_eos(tiny_model):
            ref = eng.submit(whole(tiny_model, short, LONG_REF, 4, greedy=True, max_frames=16))
            await ref.collect()
            stream = TextStream(short)  # all of it there, but not ended: more could come
            h = eng.submit(streamed(tiny_model, stream, LONG_REF, 4, greedy=True, max_frames=16))
            await asyncio.sleep(0.2)
            assert (eng.num_waiting, eng.num_running) == (1, 0) and h.stats.frames == 0
            stream.end()
            await h.collect()
    assert codes_of(ref).shape == (16, 16) and torch.equal(codes_of(h), codes_of(ref))
    assert prefills == [(n, True)]


async def test_the_request_waits_in_the_queue_for_k_tokens_then_runs(tiny_model):
    k = prefill_tokens(tiny_model, LONG_REF)
    ids = tiny_model.tokenizer.text_ids(TEXT)
    words = TEXT.split(" ")
    # the longest word prefix with fewer than k committed tokens (its last word is not committed yet)
    cut = max(i for i in range(1, len(words)) if len(tiny_model.tokenizer.text_ids(" ".join(words[:i]))) < k)
    eng = make_engine(tiny_model)
    async with started(eng):
        with no_eos(tiny_model):
            stream = TextStream(" ".join(words[: cut + 1]))  # its last word may still grow: words[:cut] committed
            h = eng.submit(streamed(tiny_model, stream, LONG_REF, 2, max_frames=20))
            await asyncio.sleep(0.2)
            assert (eng.num_waiting, eng.num_running) == (1, 0) and eng.timings["steps"] == 0
            stream.push(" " + " ".join(words[cut + 1 :]))  # now k tokens and more are there
            await wait_until(lambda: eng.num_running == 1)
            stream.end()
            await h.collect()
            ref = eng.submit(whole(tiny_model, TEXT, LONG_REF, 2, max_frames=20))
            await ref.collect()
    assert len(ids) > k and torch.equal(codes_of(h), codes_of(ref))


@pytest.mark.parametrize("setup", list(SETUPS))
async def test_a_held_icl_row_changes_no_other_rows_codes(tiny_model, setup):
    eng = make_engine(tiny_model, **SETUPS[setup])
    held = count_held_turns(eng)
    others = [("Another request runs beside the streamed one.", None), ("An ICL row beside it.", SHORT_REF)]
    async with started(eng):
        with no_eos(tiny_model):
            alone = []
            for i, (text, voice) in enumerate(others):
                h = eng.submit(whole(tiny_model, text, voice, 20 + i, max_frames=30))
                await h.collect()
                alone.append(codes_of(h))
            ref = eng.submit(whole(tiny_model, TEXT, LONG_REF, 2, max_frames=30))
            await ref.collect()

            k = prefill_tokens(tiny_model, LONG_REF)
            words = TEXT.split(" ")
            first = next(i for i in range(len(words)) if len(tiny_model.tokenizer.text_ids(" ".join(words[:i]))) > k)
            stream = TextStream(" ".join(words[: first + 1]))  # k tokens and a few more: it runs, then starves
            starved = eng.submit(streamed(tiny_model, stream, LONG_REF, 2, max_frames=30))
            await wait_until(lambda: any(lv.held for lv in eng._live.values()))
            beside = [eng.submit(whole(tiny_model, text, voice, 20 + i, max_frames=30)) for i, (text, voice) in
                      enumerate(others)]  # fmt: skip
            await asyncio.gather(*(b.collect() for b in beside))  # all of them while the streamed row starves
            assert not stream.ended and starved.stats.frames < 30
            stream.push(" " + " ".join(words[first + 1 :]))
            stream.end()
            await starved.collect()
    for b, a in zip(beside, alone, strict=True):
        assert torch.equal(codes_of(b), a)
    assert torch.equal(codes_of(starved), codes_of(ref))
    assert held[0] > 0


async def test_cancel_while_waiting_for_the_prefills_text_ends_at_once(tiny_model):
    eng = make_engine(tiny_model)
    async with started(eng):
        stream = TextStream("The quick brown ")  # committed, but fewer than k tokens
        assert 0 < len(tiny_model.tokenizer.text_ids("The quick brown")) < prefill_tokens(tiny_model, LONG_REF)
        h = eng.submit(streamed(tiny_model, stream, LONG_REF, 0))
        await asyncio.sleep(0.1)
        await cancel_while_waiting(eng, h, stream)
        assert eng.num_waiting == 0
        assert eng._runner.icl.misses == 0  # never admitted: no code block built


async def test_the_budget_grows_with_the_target_text(tiny_model):
    long_text = TEXT + " And a second sentence makes the text longer still."
    tok = tiny_model.tokenizer
    eng = make_engine(tiny_model)
    async with started(eng):
        with no_eos(tiny_model):
            stream = TextStream("The ")
            h = eng.submit(streamed(tiny_model, stream, SHORT_REF, 5, max_frames=80))
            first = h.stats.frame_budget
            assert first == frame_budget(h.request, len(tok.text_ids("The")), eng.config.max_frames)
            rng = random.Random(0)
            await asyncio.gather(produce(stream, random_split(long_text[4:], rng, False), rng, 0.01), h.collect())
            ref = eng.submit(whole(tiny_model, long_text, SHORT_REF, 5, max_frames=80))
            await ref.collect()
    final = frame_budget(h.request, len(tok.text_ids(long_text)), eng.config.max_frames)  # the target text only
    assert h.stats.frame_budget == ref.stats.frame_budget == final == 80 > first
    assert h.stats.frames == final and h.stats.finish_reason is FinishReason.BUDGET
    assert torch.equal(codes_of(h), codes_of(ref))


@pytest.mark.parametrize("voice", ["xvector", "icl"])
async def test_a_held_rows_audio_is_its_codes_decoded_on_the_padded_decoder(tiny_model, voice):
    """A held row hands out its audio so far; on the decoder that pads chunks to fixed lengths (the CUDA-graph
    shapes) only unpadded chunks go out before the request ends, as padding would enter the row's stream state."""
    icl = LONG_REF if voice == "icl" else None
    eng = make_engine(tiny_model, first_chunk_frames=2, chunk_frames=8, frame_step="padded")
    held = count_held_turns(eng)
    rng = random.Random(voice)
    async with started(eng):
        with no_eos(tiny_model):
            stream = TextStream()
            h = eng.submit(streamed(tiny_model, stream, icl, 9, max_frames=30))
            need = prefill_tokens(tiny_model, LONG_REF) if icl is not None else 1
            audio, _ = await asyncio.gather(h.collect(), produce_staged(eng, stream, TEXT, max(need, 1), rng))
    assert held[0] > 0 and codes_of(h).shape == (30, 16)
    np.testing.assert_allclose(audio, loop_audio(tiny_model, h.request, codes_of(h)), rtol=1.3e-6, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
async def test_on_cuda_graphs_streamed_icl_text_is_exact_and_changes_no_other_rows_codes(tiny_model, greedy):
    """The GPU's default path (fused kernels, frame steps and prefills replayed from CUDA graphs captured at start):
    streamed ICL rows of both prompt shapes give the whole text's codes, and an x-vector row decoding beside them
    the codes it gets alone. End-of-speech is masked to the budget (min_frames)."""
    model, eng, held = cuda_graphs_engine(tiny_model)
    rng = random.Random(f"cuda-{greedy}")
    other_text = "Another request runs beside the streamed one."
    fixed = dict(greedy=greedy, min_frames=24, max_frames=24)
    async with started(eng):
        assert eng.model_info["cuda_graphs"]
        alone = eng.submit(whole(model, other_text, None, 1, **fixed))
        await alone.collect()
        for icl in VOICES.values():
            ref = eng.submit(whole(model, TEXT, icl, 7, **fixed))
            await ref.collect()
            assert codes_of(ref).shape == (24, 16)
            stream = TextStream()
            h = eng.submit(streamed(model, stream, icl, 7, **fixed))
            beside = eng.submit(whole(model, other_text, None, 1, **fixed))
            feed = produce_staged(eng, stream, TEXT, max(prefill_tokens(model, icl), 1), rng)
            await asyncio.gather(feed, h.collect(), beside.collect())
            assert torch.equal(codes_of(h), codes_of(ref))
            assert torch.equal(codes_of(beside), codes_of(alone))
    assert held[0] > 0
