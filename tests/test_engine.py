"""Native engine on the tiny random checkpoint: streaming, batching, cancellation, budgets, isolation."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from qwen_tts import engine as engine_mod
from qwen_tts.checkpoint import write_random_checkpoint
from qwen_tts.engine import EngineConfig, NativeEngine
from qwen_tts.engine_api import FinishReason, QueueFullError, RequestFailedError, SynthesisRequest
from qwen_tts.loading import load_model

TEXTS = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog.",
    "A short one.",
    "Streaming audio should start quickly.",
    "Numbers like 42 and 7.",
    "Guten Tag, wie geht es?",
    "Batching must not change the result.",
    "Last request in the batch.",
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", size="tiny", seed=0)
    return load_model(path, device="cpu")


def make_engine(model, **kw) -> NativeEngine:
    cfg = EngineConfig(model_path=str(model.path), device="cpu", warmup=False, **kw)
    return NativeEngine(cfg, model=model)


def xvec(model, seed: int) -> torch.Tensor:
    return torch.randn(model.config.xvector_dim, generator=torch.Generator().manual_seed(seed))


def req(model, text: str, seed: int = 0, **kw) -> SynthesisRequest:
    kw.setdefault("return_codes", True)
    return SynthesisRequest(text=text, xvector=xvec(model, seed), seed=seed, **kw)


async def run(engine: NativeEngine, requests: list[SynthesisRequest]):
    handles = [engine.submit(r) for r in requests]
    audio = await asyncio.gather(*(h.collect() for h in handles))
    return handles, audio


def codes_of(handle) -> torch.Tensor:
    return torch.cat(handle.codes) if handle.codes else torch.zeros(0, 16, dtype=torch.long)


async def test_stream_equals_whole_decode(tiny_model):
    eng = make_engine(tiny_model, first_chunk_frames=2, chunk_frames=5)
    await eng.start()
    try:
        (h,), (audio,) = await run(eng, [req(tiny_model, TEXTS[1], greedy=True, max_frames=23)])
    finally:
        await eng.stop()
    codes = codes_of(h)
    assert codes.shape == (23, 16)
    assert h.stats.finish_reason is FinishReason.BUDGET
    assert audio.shape == (23 * 1920,)
    with torch.inference_mode():
        whole = tiny_model.code2wav(codes.T[None])[0].numpy()
    np.testing.assert_allclose(audio, whole, rtol=1.3e-6, atol=1e-5)
    assert np.abs(audio).mean() > 1e-3  # real audio, not silence


async def test_chunks_small_first_then_large(tiny_model):
    eng = make_engine(tiny_model, first_chunk_frames=3, chunk_frames=12)
    await eng.start()
    try:
        h = eng.submit(req(tiny_model, TEXTS[0], greedy=True, max_frames=30))
        sizes = [c.shape[0] // 1920 async for c in h]
    finally:
        await eng.stop()
    assert sizes == [3, 12, 12, 3]
    assert h.stats.time_to_first_audio is not None and h.stats.time_to_first_audio > 0


@pytest.mark.parametrize("greedy", [True, False])
async def test_batch_invariance(tiny_model, greedy):
    eng = make_engine(tiny_model, max_slots=8)
    await eng.start()
    try:
        target = req(tiny_model, TEXTS[1], seed=5, greedy=greedy, max_frames=20)
        (alone,), _ = await run(eng, [target])
        others = [req(tiny_model, t, seed=100 + i, greedy=greedy, max_frames=12 + i) for i, t in enumerate(TEXTS[:7])]
        handles, _ = await run(
            eng, [*others[:3], req(tiny_model, TEXTS[1], seed=5, greedy=greedy, max_frames=20), *others[3:]]
        )
    finally:
        await eng.stop()
    assert torch.equal(codes_of(alone), codes_of(handles[3]))
    assert codes_of(alone).shape[0] > 0


async def test_different_inputs_give_different_codes(tiny_model):
    eng = make_engine(tiny_model, max_slots=4)
    await eng.start()
    try:
        hs, _ = await run(
            eng,
            [
                req(tiny_model, TEXTS[0], seed=1, greedy=True, max_frames=16),
                req(tiny_model, TEXTS[1], seed=1, greedy=True, max_frames=16),
                req(tiny_model, TEXTS[0], seed=2, greedy=True, max_frames=16),
                req(tiny_model, TEXTS[0], seed=1, greedy=True, max_frames=16, language="german"),
            ],
        )
    finally:
        await eng.stop()
    c = [codes_of(h) for h in hs]
    assert not torch.equal(c[0], c[1])  # text
    assert not torch.equal(c[0], c[2])  # x-vector
    assert not torch.equal(c[0], c[3])  # language


async def test_cancel_frees_slot(tiny_model):
    eng = make_engine(tiny_model, max_slots=1, max_queue=4, first_chunk_frames=2, chunk_frames=2)
    await eng.start()
    try:
        h = eng.submit(req(tiny_model, TEXTS[1], max_frames=2000))
        first = await h.__anext__()
        assert first.shape == (2 * 1920,)
        eng.cancel(h)
        rest = [c async for c in h]
        assert h.stats.finish_reason is FinishReason.CANCELLED
        assert h.stats.frames < 2000 and len(rest) < 50
        # The single slot is free again: a new request runs to completion.
        (h2,), (a2,) = await run(eng, [req(tiny_model, TEXTS[0], max_frames=4)])
        assert h2.stats.finish_reason is FinishReason.BUDGET and a2.shape == (4 * 1920,)
        assert eng.num_running == 0 and eng.num_waiting == 0
    finally:
        await eng.stop()


async def test_budget_from_text_length_and_cap(tiny_model):
    eng = make_engine(tiny_model, max_frames=80)
    await eng.start()
    try:
        # min_frames holds end-of-speech off so the budget is what stops both requests.
        (a, b), (wa, wb) = await run(
            eng, [req(tiny_model, "Hi.", min_frames=10_000), req(tiny_model, TEXTS[1] * 3, min_frames=10_000)]
        )
    finally:
        await eng.stop()
    n_tokens = len(tiny_model.tokenizer.text_ids("Hi."))
    expected_a = min(80, engine_mod.BUDGET_BASE_FRAMES + engine_mod.BUDGET_FRAMES_PER_TOKEN * n_tokens)
    assert a.stats.finish_reason is FinishReason.BUDGET and a.stats.frames == expected_a
    assert wa.shape == (expected_a * 1920,)
    assert b.stats.finish_reason is FinishReason.BUDGET and b.stats.frames == 80  # capped by max_frames
    assert wb.shape == (80 * 1920,)


async def test_many_concurrent_requests_through_few_slots(tiny_model):
    eng = make_engine(tiny_model, max_slots=4, max_queue=64, chunk_frames=6)
    await eng.start()
    try:
        rs = [req(tiny_model, TEXTS[i % len(TEXTS)], seed=i, max_frames=4 + i % 9) for i in range(32)]
        hs, audio = await run(eng, rs)
    finally:
        await eng.stop()
    for r, h, a in zip(rs, hs, audio, strict=True):
        assert h.stats.finish_reason in (FinishReason.EOS, FinishReason.BUDGET)
        assert 1 <= h.stats.frames <= r.max_frames
        assert a.shape == (h.stats.frames * 1920,)
        assert codes_of(h).shape == (h.stats.frames, 16)
    assert eng.num_running == 0


async def test_failure_in_one_request_leaves_others_intact(tiny_model, monkeypatch):
    eng = make_engine(tiny_model, max_slots=4)
    await eng.start()
    real = eng._generate

    def flaky(rows):
        if any(lv.handle.request.text == "boom" for lv in rows):
            raise RuntimeError("injected")
        return real(rows)

    monkeypatch.setattr(eng, "_generate", flaky)
    try:
        good = [req(tiny_model, t, seed=i, greedy=True, max_frames=10) for i, t in enumerate(TEXTS[:3])]
        hs = [eng.submit(r) for r in [good[0], req(tiny_model, "boom", max_frames=10), *good[1:]]]
        results = await asyncio.gather(*(h.collect() for h in hs), return_exceptions=True)
    finally:
        await eng.stop()
    assert isinstance(results[1], RequestFailedError)
    assert hs[1].stats.finish_reason is FinishReason.ERROR
    for i in (0, 2, 3):
        assert hs[i].stats.finish_reason is FinishReason.BUDGET
        assert results[i].shape == (10 * 1920,)


async def test_prefill_failure_is_isolated(tiny_model, monkeypatch):
    eng = make_engine(tiny_model, max_slots=2)
    await eng.start()
    real = engine_mod.build_prompt

    def bad_prompt(cfg, talker, text_ids, *a, **k):
        if len(text_ids) == len(tiny_model.tokenizer.text_ids("boom boom boom")):
            raise RuntimeError("injected")
        return real(cfg, talker, text_ids, *a, **k)

    monkeypatch.setattr(engine_mod, "build_prompt", bad_prompt)
    try:
        hs = [
            eng.submit(req(tiny_model, "boom boom boom", max_frames=5)),
            eng.submit(req(tiny_model, TEXTS[1], max_frames=5)),
        ]
        results = await asyncio.gather(*(h.collect() for h in hs), return_exceptions=True)
    finally:
        await eng.stop()
    assert isinstance(results[0], RequestFailedError)
    assert results[1].shape == (5 * 1920,)
    assert eng.num_running == 0


async def test_queue_full_is_refused(tiny_model):
    eng = make_engine(tiny_model, max_slots=1, max_queue=1)
    await eng.start()
    try:
        with eng._cv:  # hold the worker off so admission is decided by the counts alone
            h1 = eng.submit(req(tiny_model, TEXTS[0], max_frames=3))
            h2 = eng.submit(req(tiny_model, TEXTS[0], max_frames=3))
            with pytest.raises(QueueFullError):
                eng.submit(req(tiny_model, TEXTS[0], max_frames=3))
        await asyncio.gather(h1.collect(), h2.collect())
    finally:
        await eng.stop()


async def test_bad_requests_are_rejected(tiny_model):
    eng = make_engine(tiny_model, max_text_tokens=16)
    await eng.start()
    try:
        with pytest.raises(ValueError, match="language"):
            eng.submit(req(tiny_model, "hi", language="klingon"))
        with pytest.raises(ValueError, match="xvector"):
            eng.submit(SynthesisRequest(text="hi", xvector=torch.zeros(7)))
        with pytest.raises(ValueError, match="NaN"):
            eng.submit(SynthesisRequest(text="hi", xvector=torch.full((tiny_model.config.xvector_dim,), float("nan"))))
        with pytest.raises(ValueError, match="empty"):
            eng.submit(req(tiny_model, "   "))
        with pytest.raises(ValueError, match="limit is 16"):
            eng.submit(req(tiny_model, "word " * 100))
    finally:
        await eng.stop()


async def test_stop_drains_then_cancels(tiny_model):
    eng = make_engine(tiny_model, max_slots=2)
    await eng.start()
    short = eng.submit(req(tiny_model, TEXTS[0], max_frames=4))
    long = eng.submit(req(tiny_model, TEXTS[1], max_frames=2000, min_frames=10_000))
    await eng.stop(drain_timeout=0.5)
    a = await short.collect()
    await long.collect()
    assert short.stats.finish_reason is FinishReason.BUDGET and a.shape == (4 * 1920,)
    assert long.stats.finish_reason is FinishReason.CANCELLED
    assert not eng.ready
