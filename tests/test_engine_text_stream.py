"""Native engine with streamed text (SynthesisRequest.text_stream) on the tiny random checkpoint: the codes of text
fed fragment by fragment are those of the whole text in streaming-text mode, a row waiting for text changes no other
row's codes, budgets grow with the text, cancels end waiting and held requests at once."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import pytest
import torch

from qwen_tts.engine_api import EngineSettings, FinishReason, RequestFailedError, SynthesisRequest
from qwen_tts.engines.native.engine import NativeEngine
from qwen_tts.engines.native.scheduler import frame_budget
from qwen_tts.model.loading import load_model
from qwen_tts.text_stream import TextStream
from tests.test_engine import codes_of, make_engine, started, xvec

TEXT = "The quick brown fox jumps over the lazy dog, then naps."
SETUPS = {
    "in-turn": dict(),
    "overlapped": dict(overlap_steps=True),
    # The fixed-shape step that CUDA graphs replay, run eagerly: held rows are rows left out of its batch.
    "padded": dict(frame_step="padded", overlap_steps=True),
}


@pytest.fixture(scope="module")
def tiny_model(tiny_qwen3tts):
    return tiny_qwen3tts


@contextlib.contextmanager
def no_eos(model):
    """End-of-speech never sampled: every request runs to its budget, so all of its text is read."""
    eos = model.config.talker.codec_eos_token_id

    def hook(_module, _inputs, out):
        out = out.clone()
        out[..., eos] = -1e4
        return out

    handle = model.talker.codec_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def whole(model, text: str, seed: int, **kw) -> SynthesisRequest:
    return SynthesisRequest(
        text=text, xvector=xvec(model, seed), seed=seed, non_streaming_text=False, return_codes=True, **kw
    )


def streamed(model, stream: TextStream, seed: int, **kw) -> SynthesisRequest:
    return whole(model, stream.snapshot().text, seed, text_stream=stream, **kw)


def random_split(text: str, rng: random.Random, mid_word: bool) -> list[str]:
    """`text` in pieces cut at random word boundaries (before a space) or, with `mid_word`, anywhere."""
    places = list(range(1, len(text))) if mid_word else [i for i, ch in enumerate(text) if ch == " "]
    cuts = sorted(rng.sample(places, min(len(places), rng.randint(2, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


async def produce(
    stream: TextStream, pieces: list[str], rng: random.Random, max_delay: float, eng: NativeEngine | None = None
) -> None:
    """Push `pieces` after random delays, then end; with `eng`, before about half of them wait until the engine has
    run out of text (a row held, or none running): the stream then starves the request for sure."""
    for piece in [*pieces, None]:
        await asyncio.sleep(rng.uniform(0, max_delay))
        if eng is not None and rng.random() < 0.5:
            await wait_until(lambda: any(lv.held for lv in eng._live.values()) or not eng._live)
        if piece is None:
            stream.end()
        else:
            stream.push(piece)


def count_held_turns(eng: NativeEngine) -> list[int]:
    """A counter of loop turns in which some running row was held for its text (schedule wrapped)."""
    sched, held = eng._scheduler, [0]
    schedule = sched.schedule

    def counting(*args):
        plan = schedule(*args)
        held[0] += any(lv.held for lv in sched.running.values())
        return plan

    sched.schedule = counting
    return held


async def cancel_while_waiting(eng: NativeEngine, h, stream: TextStream) -> None:
    """Cancel a request that waits in the queue for its stream's text: it ends at once, with no audio and no turn
    of the loop, and the engine lets go of the stream."""
    assert (eng.num_waiting, eng.num_running) == (1, 0)
    steps = eng.timings["steps"]
    t0 = time.monotonic()
    eng.cancel(h)
    audio = await asyncio.wait_for(h.collect(), 2)
    assert h.stats.finish_reason is FinishReason.CANCELLED and audio.size == 0
    assert time.monotonic() - t0 < 1.0 and eng.timings["steps"] == steps
    assert stream._listeners == []


async def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("setup", list(SETUPS))
async def test_streamed_text_gives_the_codes_of_the_whole_text(tiny_model, greedy, setup):
    rng = random.Random(f"{greedy}-{setup}")
    eng = make_engine(tiny_model, first_chunk_frames=2, chunk_frames=4, **SETUPS[setup])
    held = count_held_turns(eng)
    async with started(eng):
        with no_eos(tiny_model):  # all of the text is read: max_frames is well past its length
            ref = eng.submit(whole(tiny_model, TEXT, 7, greedy=greedy, max_frames=24))
            await ref.collect()
            ref_codes = codes_of(ref)
            assert ref_codes.shape == (24, 16) and ref.stats.finish_reason is FinishReason.BUDGET
            for i in range(3):  # word boundaries, then mid-word
                stream = TextStream()
                h = eng.submit(streamed(tiny_model, stream, 7, greedy=greedy, max_frames=24))
                pieces = random_split(TEXT, rng, mid_word=i >= 1)
                await asyncio.gather(produce(stream, pieces, rng, 0.02, eng), h.collect())
                assert torch.equal(codes_of(h), ref_codes), pieces
                assert h.stats.finish_reason is FinishReason.BUDGET and h.stats.frames == 24
        # With end-of-speech sampled as usual: the same end at the same frame.
        ref = eng.submit(whole(tiny_model, TEXT, 3, greedy=greedy, min_frames=12, max_frames=40))
        await ref.collect()
        stream = TextStream()
        h = eng.submit(streamed(tiny_model, stream, 3, greedy=greedy, min_frames=12, max_frames=40))
        await asyncio.gather(produce(stream, random_split(TEXT, rng, mid_word=True), rng, 0.02, eng), h.collect())
        assert torch.equal(codes_of(h), codes_of(ref))
        assert h.stats.finish_reason is ref.stats.finish_reason
    assert held[0] > 0  # rows really waited for their text


@pytest.mark.parametrize("setup", list(SETUPS))
async def test_a_row_waiting_for_text_changes_no_other_rows_codes(tiny_model, setup):
    eng = make_engine(tiny_model, **SETUPS[setup])
    held = count_held_turns(eng)
    other_text = "Another request runs beside the streamed one."
    async with started(eng):
        with no_eos(tiny_model):
            alone = eng.submit(whole(tiny_model, other_text, 1, max_frames=40))
            await alone.collect()
            ref = eng.submit(whole(tiny_model, TEXT, 2, max_frames=40))
            await ref.collect()

            stream = TextStream("The quick brown")
            starved = eng.submit(streamed(tiny_model, stream, 2, max_frames=40))
            await wait_until(lambda: any(lv.held for lv in eng._live.values()))  # it ran out of text
            beside = eng.submit(whole(tiny_model, other_text, 1, max_frames=40))
            await beside.collect()  # all of it while the streamed row starves
            assert not stream.ended and starved.stats.frames < 40
            stream.push(TEXT.removeprefix("The quick brown"))
            stream.end()
            await starved.collect()
    assert torch.equal(codes_of(beside), codes_of(alone))
    assert torch.equal(codes_of(starved), codes_of(ref))
    assert held[0] > 0


async def test_cancel_while_waiting_for_the_first_token_and_while_held_ends_at_once(tiny_model):
    eng = make_engine(tiny_model)
    async with started(eng):
        # No committed token yet: the request waits in the queue, without a slot, and the loop does not turn.
        stream = TextStream("Hel")
        h = eng.submit(streamed(tiny_model, stream, 0))
        await asyncio.sleep(0.1)
        await cancel_while_waiting(eng, h, stream)

        # Held: it ran out of text after a few frames.
        stream = TextStream("Hello there, my friend")
        h = eng.submit(streamed(tiny_model, stream, 0, min_frames=50))
        await wait_until(lambda: any(lv.held for lv in eng._live.values()))
        await asyncio.sleep(0.1)
        frames = h.stats.frames
        t0 = time.monotonic()
        eng.cancel(h)
        await asyncio.wait_for(h.collect(), 2)
        assert h.stats.finish_reason is FinishReason.CANCELLED
        assert time.monotonic() - t0 < 1.0
        assert 0 < frames <= len(tiny_model.tokenizer.text_ids("Hello there, my"))  # stopped where the text did
        await wait_until(lambda: eng.num_running == 0)
        assert stream._listeners == []


async def test_the_loop_waits_instead_of_turning_while_every_row_is_held(tiny_model):
    eng = make_engine(tiny_model)
    turns = count_held_turns(eng)
    async with started(eng):
        stream = TextStream("Hello there, my")
        h = eng.submit(streamed(tiny_model, stream, 0, min_frames=50))
        await wait_until(lambda: any(lv.held for lv in eng._live.values()))
        before = turns[0]
        await asyncio.sleep(0.5)
        # Woken only by the wait's timeout: a handful of turns in half a second, not thousands.
        assert turns[0] - before <= 10
        t0 = time.monotonic()
        frames = h.stats.frames
        stream.push(" friend, and more text")  # text arrives: the row steps again at once
        await wait_until(lambda: any(lv.frames > frames for lv in eng._live.values()), timeout=0.08)
        assert time.monotonic() - t0 < 0.08
        stream.end()
        await h.collect()


async def test_the_budget_grows_with_the_text_and_is_final_at_its_end(tiny_model):
    long_text = TEXT + " And a second sentence makes the text longer still."
    ids = tiny_model.tokenizer.text_ids(long_text)
    eng = make_engine(tiny_model)
    async with started(eng):
        with no_eos(tiny_model):
            stream = TextStream("The ")
            h = eng.submit(streamed(tiny_model, stream, 5, max_frames=80))  # the cap: a shorter test
            first = h.stats.frame_budget
            assert first == frame_budget(h.request, len(tiny_model.tokenizer.text_ids("The")), eng.config.max_frames)
            rng = random.Random(0)
            await asyncio.gather(produce(stream, random_split(long_text[4:], rng, False), rng, 0.01), h.collect())
            ref = eng.submit(whole(tiny_model, long_text, 5, max_frames=80))
            await ref.collect()
    final = frame_budget(h.request, len(ids), eng.config.max_frames)
    assert h.stats.frame_budget == ref.stats.frame_budget == final == 80 > first
    assert h.stats.frames == final and h.stats.finish_reason is FinishReason.BUDGET  # not cut at `first`
    assert torch.equal(codes_of(h), codes_of(ref))


async def test_a_stream_that_ends_with_no_text_finishes_with_no_audio(tiny_model):
    eng = make_engine(tiny_model)
    async with started(eng):
        ended = TextStream()
        ended.end()
        h = eng.submit(streamed(tiny_model, ended, 0))
        assert (await h.collect()).size == 0 and h.stats.finish_reason is FinishReason.EOS
        for text in ("", "  "):  # ended after submission, with nothing to say
            stream = TextStream(text)
            h = eng.submit(streamed(tiny_model, stream, 0))
            await asyncio.sleep(0.05)
            assert not h.finished and eng.num_waiting == 1
            stream.end()
            audio = await asyncio.wait_for(h.collect(), 2)
            assert audio.size == 0 and h.stats.frames == 0
            assert h.stats.finish_reason is FinishReason.EOS and h.stats.error is None
            assert stream._listeners == []
        assert eng.num_waiting == eng.num_running == 0


async def test_streamed_requests_are_checked(tiny_model):
    eng = make_engine(tiny_model, max_text_tokens=8)
    async with started(eng):
        x = xvec(tiny_model, 0)
        with pytest.raises(ValueError, match="non_streaming_text=False"):
            eng.submit(SynthesisRequest(text="", xvector=x, text_stream=TextStream()))
        with pytest.raises(ValueError, match="what the text_stream held"):
            eng.submit(SynthesisRequest(text="Hi", xvector=x, text_stream=TextStream(), non_streaming_text=False))
        too_long = TextStream("one two three four five six seven eight nine ten eleven ")
        with pytest.raises(ValueError, match="limit is 8"):
            eng.submit(streamed(tiny_model, too_long, 0))
        assert too_long._listeners == []
        # Growing past the limit while it is spoken: the request ends with an error that says so.
        stream = TextStream("one two ")
        h = eng.submit(streamed(tiny_model, stream, 0, min_frames=40))
        await wait_until(lambda: any(lv.held for lv in eng._live.values()))
        stream.push("three four five six seven eight nine ten eleven twelve ")
        with pytest.raises(RequestFailedError, match=r"grew to \d+ tokens, the limit is 8"):
            await asyncio.wait_for(h.collect(), 5)
        assert h.stats.finish_reason is FinishReason.ERROR


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_graphs_engine(tiny_model) -> tuple:
    """(the tiny model on CUDA, an engine on its default path, CUDA graphs captured at start, the held-turn count)."""
    model = load_model(tiny_model.path, device="cuda")
    cfg = EngineSettings(model_path=str(model.path), device="cuda", max_slots=4, first_chunk_frames=2, chunk_frames=4)
    eng = NativeEngine(cfg, model=model)
    return model, eng, count_held_turns(eng)


@needs_cuda
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
async def test_on_cuda_graphs_streamed_text_is_exact_and_changes_no_other_rows_codes(tiny_model, greedy):
    """The GPU's default path (fused kernels, the frame step replayed from CUDA graphs captured at start): a row held
    for its text is a row left out of a replayed graph; its codes are still those of the whole text, and a request
    decoding beside it gets the codes it gets alone. End-of-speech is masked to the budget (min_frames), which also
    holds on the graphed path."""
    model, eng, held = cuda_graphs_engine(tiny_model)
    rng = random.Random(f"cuda-{greedy}")
    other_text = "Another request runs beside the streamed one."
    fixed = dict(greedy=greedy, min_frames=24, max_frames=24)
    async with started(eng):
        assert eng.model_info["cuda_graphs"] and eng._runner._frame_step.num_graphs > 1
        ref = eng.submit(whole(model, TEXT, 7, **fixed))
        alone = eng.submit(whole(model, other_text, 1, **fixed))
        await ref.collect()
        await alone.collect()
        assert codes_of(ref).shape == (24, 16)
        for mid_word in (False, True):
            stream = TextStream()
            h = eng.submit(streamed(model, stream, 7, **fixed))
            beside = eng.submit(whole(model, other_text, 1, **fixed))
            pieces = random_split(TEXT, rng, mid_word=mid_word)
            await asyncio.gather(produce(stream, pieces, rng, 0.02, eng), h.collect(), beside.collect())
            assert torch.equal(codes_of(h), codes_of(ref)), pieces
            assert torch.equal(codes_of(beside), codes_of(alone)), pieces
    assert held[0] > 0  # rows really waited for their text
