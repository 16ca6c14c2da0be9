"""Native engine on the tiny random checkpoint: streaming, batching, cancellation, budgets, isolation."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
import torch

from qwen_tts.engine_api import (
    EngineSettings,
    EngineSettingsError,
    FinishReason,
    QueueFullError,
    RequestFailedError,
    SynthesisRequest,
)
from qwen_tts.engines.checkpoint import FiniteCheck
from qwen_tts.engines.native import frame_step as cuda_graph
from qwen_tts.engines.native import runner as runner_mod
from qwen_tts.engines.native import scheduler as scheduler_mod
from qwen_tts.engines.native.engine import NativeEngine
from qwen_tts.fastpath.options import FastPath, FastPathError
from qwen_tts.model.loading import load_model
from qwen_tts.model.random_checkpoint import write_random_checkpoint
from qwen_tts.model.sampling import suppress_mask

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


# Both step orders on the CPU: in turn (the CPU default) and overlapped (overlap_steps, the CUDA default).
OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])


def make_engine(model, fault_hook=None, **kw) -> NativeEngine:
    fast, kw = FastPath.split(kw)
    cfg = EngineSettings(model_path=str(model.path), device="cpu", warmup=False, **kw)
    return NativeEngine(cfg, model=model, fast_path=fast, fault_hook=fault_hook)


def xvec(model, seed: int) -> torch.Tensor:
    return torch.randn(model.config.xvector_dim, generator=torch.Generator().manual_seed(seed))


def req(model, text: str, seed: int = 0, **kw) -> SynthesisRequest:
    kw.setdefault("return_codes", True)
    return SynthesisRequest(text=text, xvector=xvec(model, seed), seed=seed, **kw)


async def run(engine: NativeEngine, requests: list[SynthesisRequest]):
    handles = [engine.submit(r) for r in requests]
    audio = await asyncio.gather(*(h.collect() for h in handles))
    return handles, audio


@contextlib.asynccontextmanager
async def started(engine: NativeEngine) -> AsyncIterator[NativeEngine]:
    """The engine started for the block, stopped after it whatever happens."""
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def codes_of(handle) -> torch.Tensor:
    return torch.cat(handle.codes) if handle.codes else torch.zeros(0, 16, dtype=torch.long)


async def test_stream_equals_whole_decode(tiny_model):
    eng = make_engine(tiny_model, first_chunk_frames=2, chunk_frames=5)
    await eng.start()
    assert eng.model_info["overlap_steps"] is False  # None: off on the CPU
    # The CUDA-only defaults report what runs here: none of them.
    info = eng.model_info
    assert (info["decoder_polyphase_dilation"], info["kernel_sampler"], info["cp_prompt_one_pass"]) == (0, False, False)
    assert not any(getattr(m, "polyphase", False) for m in eng._runner._code2wav.modules())
    assert info["decoder_snake_kernel"] is False and eng._runner._code2wav.kernels is None
    assert info["cp_input_tables"] is False and info["small_m_heads"] is False
    assert info["cp_fused_feed"] is False and info["stack_exact_rows"] == 0
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


@pytest.mark.parametrize(("growth", "expected"), [(2, [3, 6, 12, 9]), (4, [3, 12, 12, 3]), (3, [3, 9, 12, 6])])
async def test_chunks_small_first_then_growing(tiny_model, growth, expected):
    eng = make_engine(tiny_model, first_chunk_frames=3, chunk_frames=12, chunk_growth=growth)
    async with started(eng):
        h = eng.submit(req(tiny_model, TEXTS[0], greedy=True, max_frames=30))
        sizes = [c.shape[0] // 1920 async for c in h]
    assert sizes == expected
    assert h.stats.time_to_first_audio is not None and h.stats.time_to_first_audio > 0


@pytest.mark.parametrize("budget_ms", [0.0, 10.0], ids=["off", "10ms"])
async def test_admission_budget_keeps_new_requests_queued_while_frames_come_slowly(tiny_model, budget_ms):
    """Every frame step takes >= 30 ms (a slow GPU): with a 10 ms budget the second request waits until the first
    is over, instead of joining it and slowing it further; without one it joins at once."""

    def slow() -> None:  # the fault hook: runs before every frame step
        time.sleep(0.03)

    eng = make_engine(tiny_model, fault_hook=slow, max_slots=4, admission_step_budget_ms=budget_ms)
    async with started(eng):
        a = eng.submit(req(tiny_model, TEXTS[0], greedy=True, max_frames=15, min_frames=15))
        await a.__anext__()  # a's first chunk: it runs, and its steps have been timed
        b = eng.submit(req(tiny_model, TEXTS[1], greedy=True, max_frames=6, min_frames=6))
        await asyncio.gather(a.collect(), b.collect())
    assert a.stats.finish_reason is b.stats.finish_reason is FinishReason.BUDGET
    assert (a.stats.frames, b.stats.frames) == (15, 6)
    if budget_ms:
        assert b.stats.started_at > a.stats.finished_at  # admitted only once a was over
        assert eng.timings["admissions_held"] > 0
    else:
        assert b.stats.started_at < a.stats.finished_at  # ran beside a
        assert eng.timings["admissions_held"] == 0


async def test_the_loop_times_its_waits_for_a_slow_decoder(tiny_model):
    """With one chunk allowed in the decoder (decode_lookahead=1) and a decoder that takes 40 ms a chunk, the lone
    request's generation waits on every chunk: the loop counts that time as decoder_wait_s (at least 4 chunks' worth
    of the 6), and it is not counted as frame steps; the request still gets all its frames."""
    eng = make_engine(tiny_model, first_chunk_frames=1, chunk_frames=1, decode_lookahead=1)
    async with started(eng):
        dec = eng._runner.decoder.decoder
        real = dec.decode
        dec.decode = lambda *a, **k: (time.sleep(0.04), real(*a, **k))[1]
        (h,), _ = await run(eng, [req(tiny_model, TEXTS[0], greedy=True, max_frames=6, min_frames=6)])
    assert h.stats.frames == 6
    assert eng.timings["decoder_wait_s"] >= 4 * 0.04
    assert eng.timings["step_s"] < eng.timings["decoder_wait_s"]


def test_chunk_schedule_grows_to_the_chunk_size():
    chunk_schedule = scheduler_mod.chunk_schedule
    assert chunk_schedule(3, 12, 2) == [3, 6, 12]
    assert chunk_schedule(3, 12, 4) == [3, 12]
    assert chunk_schedule(3, 10, 2) == [3, 6, 10]
    assert chunk_schedule(1, 12, 2) == [1, 2, 4, 8, 12]
    assert chunk_schedule(5, 5, 2) == [5]
    with pytest.raises(EngineSettingsError, match="chunk_growth must be >= 2, not 1"):
        EngineSettings(chunk_growth=1)
    with pytest.raises(EngineSettingsError, match=r"admission_step_budget_ms must be >= 0, not -1\.0"):
        EngineSettings(admission_step_budget_ms=-1.0)


async def alone_and_among_seven(eng, model, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's codes run alone, then run again as the fourth of eight (the engine started and stopped here)."""
    async with started(eng):
        target = req(model, TEXTS[1], seed=5, greedy=greedy, max_frames=20)
        (alone,), _ = await run(eng, [target])
        others = [req(model, t, seed=100 + i, greedy=greedy, max_frames=12 + i) for i, t in enumerate(TEXTS[:7])]
        handles, _ = await run(
            eng, [*others[:3], req(model, TEXTS[1], seed=5, greedy=greedy, max_frames=20), *others[3:]]
        )
    return codes_of(alone), codes_of(handles[3])


@pytest.mark.parametrize("greedy", [True, False])
async def test_batch_invariance(tiny_model, greedy):
    alone, batched = await alone_and_among_seven(make_engine(tiny_model, max_slots=8), tiny_model, greedy)
    assert torch.equal(alone, batched)
    assert alone.shape[0] > 0


def test_fast_path_is_the_cuda_path_only(tiny_checkpoint):
    """fastpath.build (the engine's set-up of the fast path, also run by make_fixture.py's teacher-forced check) does
    nothing on the CPU: the model keeps its eager modules, the code predictor builds no input tables."""
    from qwen_tts import fastpath

    m = load_model(tiny_checkpoint, device="cpu")
    assert fastpath.build(m.talker, m.code2wav, EngineSettings(), torch.device("cpu"), 64) is None
    assert m.talker.kernels is None and m.code2wav.kernels is None
    assert m.talker.code_predictor.input_tables is None


def test_fast_path_options_name_the_field_and_its_choices():
    with pytest.raises(FastPathError, match="frame_step must be auto, eager, padded or graphs"):
        FastPath(frame_step="fast")
    for bad in (0, 9):
        with pytest.raises(FastPathError, match=f"small_m_split_k must be 1 to 8, not {bad}") as e:
            FastPath(small_m_split_k=bad)
        assert e.value.setting == "small_m_split_k"
    for bad in (-1, 4):
        with pytest.raises(FastPathError, match=f"^stack_exact_rows must be 0 to 3 rows, not {bad}$") as e:
            FastPath(stack_exact_rows=bad)
        assert e.value.setting == "stack_exact_rows"
    assert [FastPath(stack_exact_rows=n).stack_exact_rows for n in (0, 3)] == [0, 3]
    for bad in (0, 100, 8192):
        with pytest.raises(FastPathError, match=f"must be a power of two from 32 to 4096, not {bad}") as e:
            FastPath(kernel_sampler_warp_elements=bad)
        assert e.value.setting == "kernel_sampler_warp_elements"
    assert FastPath(kernel_sampler_warp_elements=2048).kernel_sampler_warp_elements == 2048
    for name in ("cp_stack_threads", "talker_stack_threads"):
        for bad in (128, 384, 1024):
            with pytest.raises(FastPathError, match=f"^{name} must be 256 or 512, not {bad}$") as e:
                FastPath(**{name: bad})
            assert e.value.setting == name
    for bad in (0, 16, 100):
        with pytest.raises(
            FastPathError, match=f"^talker_stack_chunk must be a multiple of 32 positions, not {bad}$"
        ) as e:
            FastPath(talker_stack_chunk=bad)
        assert e.value.setting == "talker_stack_chunk"
    s = FastPath()
    assert (s.cp_stack_threads, s.talker_stack_threads) == (512, 256) and s.stack_exact_rows == 1
    assert (s.talker_stack_stage, s.talker_stack_chunk) == (True, 64)
    assert FastPath(talker_stack_chunk=192).talker_stack_chunk == 192
    assert s.talker_stack_split == 32 and FastPath(talker_stack_split=0).talker_stack_split == 0
    for bad, chunk in ((16, 64), (-32, 64), (128, 64), (64, 32)):
        with pytest.raises(
            FastPathError,
            match=rf"^talker_stack_split must be 0 or a multiple of 32 positions up to talker_stack_chunk \({chunk}\), "
            rf"not {bad}$",
        ) as e:
            FastPath(talker_stack_split=bad, talker_stack_chunk=chunk)
        assert e.value.setting == "talker_stack_split"
    assert FastPath(talker_stack_chunk=192, talker_stack_split=128).talker_stack_split == 128
    assert FastPath(talker_stack_threads=512).talker_stack_threads == 512
    with pytest.raises(FastPathError, match="decoder_polyphase_dilation must be >= 0, not -1") as e:
        FastPath(decoder_polyphase_dilation=-1)
    assert e.value.setting == "decoder_polyphase_dilation" and FastPath().decoder_polyphase_dilation == 9
    with pytest.raises(FastPathError, match=r"^cp_stack_kernel must be off or cuda, not 'phases'$"):
        FastPath(cp_stack_kernel="phases")


def test_fast_path_presets_and_the_setting_that_names_them():
    assert FastPath.preset("default") == FastPath() and EngineSettings().fast_path == "default"
    one = FastPath.preset("one-stream")
    assert (one.cp_stack_kernel, one.talker_stack_kernel, one.small_m_heads) == ("cuda", "cuda", True)
    eager = FastPath.preset("eager")
    assert eager.frame_step == "eager" and not (eager.fused_kernels or eager.kernel_sampler or eager.decode_graphs)
    assert not (eager.fused_decoder or eager.decoder_snake_kernel) and eager.decoder_polyphase_dilation == 0
    with pytest.raises(EngineSettingsError, match=r"^fast_path must be default, one-stream, eager, not 'fast'$") as e:
        EngineSettings(fast_path="fast")
    assert e.value.setting == "fast_path"
    fast, rest = FastPath.split({"kernel_sampler": False, "max_slots": 2}, base=one)
    assert fast == dataclasses.replace(one, kernel_sampler=False) and rest == {"max_slots": 2}


async def test_different_inputs_give_different_codes(tiny_model):
    eng = make_engine(tiny_model, max_slots=4)
    async with started(eng):
        hs, _ = await run(
            eng,
            [
                req(tiny_model, TEXTS[0], seed=1, greedy=True, max_frames=16),
                req(tiny_model, TEXTS[1], seed=1, greedy=True, max_frames=16),
                req(tiny_model, TEXTS[0], seed=2, greedy=True, max_frames=16),
                req(tiny_model, TEXTS[0], seed=1, greedy=True, max_frames=16, language="german"),
            ],
        )
    c = [codes_of(h) for h in hs]
    assert not torch.equal(c[0], c[1])  # text
    assert not torch.equal(c[0], c[2])  # x-vector
    assert not torch.equal(c[0], c[3])  # language


@OVERLAP
async def test_cancel_frees_slot(tiny_model, overlap):
    eng = make_engine(tiny_model, overlap_steps=overlap, max_slots=1, max_queue=4, first_chunk_frames=2, chunk_frames=2)
    await eng.start()
    assert eng.model_info["overlap_steps"] is overlap
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


@OVERLAP
async def test_budget_from_text_length_and_cap(tiny_model, overlap):
    eng = make_engine(tiny_model, overlap_steps=overlap, max_frames=80)
    async with started(eng):
        assert len(tiny_model.tokenizer.text_ids("Hi.")) == 3  # "H", "i", "."
        text_budget = 49  # 25 frames + 8 per text token
        assert text_budget == scheduler_mod.BUDGET_BASE_FRAMES + scheduler_mod.BUDGET_FRAMES_PER_TOKEN * 3
        # The text budget, with the default min_frames (a missing end-of-speech cannot run past it)...
        probe = eng.submit(req(tiny_model, "Hi."))
        assert probe.stats.frame_budget == text_budget
        await probe.collect()
        # ...raised by an explicit min_frames, which holds end-of-speech off: min == budget fixes the length
        # (60 frames for a 3-character text); and capped by max_frames whatever min_frames says.
        (a, b), (wa, wb) = await run(
            eng, [req(tiny_model, "Hi.", min_frames=60), req(tiny_model, TEXTS[1] * 3, min_frames=10_000)]
        )
    assert a.stats.finish_reason is FinishReason.BUDGET and a.stats.frames == 60
    assert wa.shape == (60 * 1920,)
    assert b.stats.finish_reason is FinishReason.BUDGET and b.stats.frames == 80  # capped by max_frames
    assert wb.shape == (80 * 1920,)


@OVERLAP
async def test_many_concurrent_requests_through_few_slots(tiny_model, overlap):
    eng = make_engine(tiny_model, overlap_steps=overlap, max_slots=4, max_queue=64, chunk_frames=6)
    async with started(eng):
        rs = [req(tiny_model, TEXTS[i % len(TEXTS)], seed=i, max_frames=4 + i % 9) for i in range(32)]
        hs, audio = await run(eng, rs)
    for r, h, a in zip(rs, hs, audio, strict=True):
        assert h.stats.finish_reason in (FinishReason.EOS, FinishReason.BUDGET)
        assert 1 <= h.stats.frames <= r.max_frames
        assert a.shape == (h.stats.frames * 1920,)
        assert codes_of(h).shape == (h.stats.frames, 16)
    assert eng.num_running == 0


@OVERLAP
async def test_failure_in_one_request_leaves_others_intact(tiny_model, overlap, monkeypatch):
    eng = make_engine(tiny_model, overlap_steps=overlap, max_slots=4)
    await eng.start()
    real = eng._runner._launch

    def flaky(rows, stepping):
        if any(lv.handle.request.text == "boom" for lv in rows):
            raise RuntimeError("injected")
        return real(rows, stepping)

    monkeypatch.setattr(eng._runner, "_launch", flaky)
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
    real, real_together = runner_mod.build_prompt, runner_mod.build_text_prompts
    boom = len(tiny_model.tokenizer.text_ids("boom boom boom"))

    def bad_prompt(cfg, talker, text_ids, *a, **k):
        if len(text_ids) == boom:
            raise RuntimeError("injected")
        return real(cfg, talker, text_ids, *a, **k)

    def bad_together(cfg, talker, texts, *a):  # the burst's build fails; then each is built alone
        if any(len(t) == boom for t in texts):
            raise RuntimeError("injected")
        return real_together(cfg, talker, texts, *a)

    monkeypatch.setattr(runner_mod, "build_prompt", bad_prompt)
    monkeypatch.setattr(runner_mod, "build_text_prompts", bad_together)
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
    async with started(eng):
        with eng._cv:  # hold the worker off so admission is decided by the counts alone
            h1 = eng.submit(req(tiny_model, TEXTS[0], max_frames=3))
            h2 = eng.submit(req(tiny_model, TEXTS[0], max_frames=3))
            with pytest.raises(QueueFullError):
                eng.submit(req(tiny_model, TEXTS[0], max_frames=3))
        await asyncio.gather(h1.collect(), h2.collect())


async def test_bad_requests_are_rejected(tiny_model):
    eng = make_engine(tiny_model, max_text_tokens=16)
    async with started(eng):
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


def test_finite_check_remembers_a_tensor_until_it_is_written_to(monkeypatch):
    """A finite tensor is checked once while it lives unwritten; a write, a new tensor or an inference tensor is
    checked again (the count of torch.isfinite calls)."""
    check, calls = FiniteCheck(), []
    real = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: calls.append(1) or real(t))
    x = torch.randn(16)
    assert check(x) and check(x) and check(x)
    assert len(calls) == 1
    x[3] = float("nan")  # in place: a new version
    assert not check(x) and not check(x)
    assert len(calls) == 3
    x[3] = 0.0
    assert check(x) and check(x)
    assert len(calls) == 4
    assert not check(torch.full((16,), float("inf")))
    y = torch.randn(16)
    assert check(y) and len(calls) == 6
    with torch.inference_mode():
        z = torch.randn(16)
    assert check(z) and check(z) and len(calls) == 8
    check.LIMIT = 2  # a full memory starts over, still right
    for _ in range(5):
        assert check(torch.randn(4))
    assert len(check._seen) <= 2 and check(y)


async def test_an_accepted_xvector_written_with_nan_is_refused(tiny_model):
    eng = make_engine(tiny_model)
    async with started(eng):
        x = xvec(tiny_model, 3)
        h = eng.submit(SynthesisRequest(text="hi", xvector=x, max_frames=2))
        await h.collect()
        x[0] = float("nan")
        with pytest.raises(ValueError, match="NaN"):
            eng.submit(SynthesisRequest(text="hi", xvector=x, max_frames=2))


@OVERLAP
async def test_stop_drains_then_cancels(tiny_model, overlap):
    eng = make_engine(tiny_model, overlap_steps=overlap, max_slots=2)
    await eng.start()
    short = eng.submit(req(tiny_model, TEXTS[0], max_frames=4))
    long = eng.submit(req(tiny_model, TEXTS[1], max_frames=2000, min_frames=10_000))
    await eng.stop(drain_timeout=0.5)
    a = await short.collect()
    await long.collect()
    assert short.stats.finish_reason is FinishReason.BUDGET and a.shape == (4 * 1920,)
    assert long.stats.finish_reason is FinishReason.CANCELLED
    assert not eng.ready


# ---------------------------------------------------------------- fixed-shape (CUDA-graph) frame step

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def eos_prone_path(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt_eos") / "tiny", size="tiny", seed=0)


def load_eos_prone(path, device: str = "cpu"):
    """The tiny model with its end-of-speech logit scaled up, so requests end by EOS after a few frames."""
    model = load_model(path, device=device)
    with torch.no_grad():
        model.talker.codec_head.weight[model.config.talker.codec_eos_token_id] *= 3
    return model


def mixed_requests(model) -> list[SynthesisRequest]:
    """Greedy and sampled requests, some with a min length, that end by EOS and by budget at different frames."""
    rs = [
        req(model, TEXTS[i % len(TEXTS)], seed=i, greedy=i % 2 == 0, max_frames=40, min_frames=10 if i % 3 == 0 else 0)
        for i in range(10)
    ]
    return [*rs, req(model, TEXTS[2], seed=10, max_frames=30, min_frames=1000)]  # this one always ends by budget


async def run_codes(engine: NativeEngine, requests: list[SynthesisRequest]):
    await engine.start()
    try:
        handles, audio = await run(engine, requests)
    finally:
        await engine.stop()
    return [(h.stats.finish_reason, codes_of(h)) for h in handles], audio


def test_buckets():
    assert cuda_graph.batch_buckets(16) == [1, 2, 4, 8, 16]
    assert cuda_graph.batch_buckets(12) == [1, 2, 4, 8, 12]
    assert cuda_graph.batch_buckets(1) == [1]
    assert cuda_graph.kv_buckets(3088) == [256, 512, 1024, 2048, 3088]
    assert cuda_graph.kv_buckets(100) == [100]
    assert cuda_graph.bucket(3, [1, 2, 4]) == 4
    assert cuda_graph.bucket(2, [1, 2, 4]) == 2
    with pytest.raises(ValueError):
        cuda_graph.bucket(5, [1, 2, 4])


def test_one_row_steps_needs_both_stacks_on_the_cuda_kernel_and_the_heads_on_the_few_row_kernel():
    """A lone row's graphed step runs unpadded only where every part of it is batch invariant by itself."""
    from types import SimpleNamespace

    from qwen_tts.fastpath.step import FastStep

    def talker(stack, cp_stack, heads):
        fast = FastStep(FastPath(small_m_heads=heads), "cpu")
        t, cp = object(), object()  # the stacks, as keys
        fast._names = {"talker": t, "code_predictor": cp}
        fast._kernels = {s: object() for s, mode in ((t, stack), (cp, cp_stack)) if mode == "cuda"}
        return SimpleNamespace(kernels=fast)

    assert cuda_graph.one_row_steps(talker("cuda", "cuda", True))
    for args in ((None, "cuda", True), ("cuda", None, True), ("cuda", "cuda", False)):
        assert not cuda_graph.one_row_steps(talker(*args)), args
    assert not cuda_graph.one_row_steps(SimpleNamespace(kernels=None))


async def test_static_step_equals_eager_step(eos_prone_path, monkeypatch):
    # Small kv buckets so requests cross several of them; 10 requests through 4 slots give padded batches of 3.
    monkeypatch.setattr(cuda_graph, "MIN_KV_BUCKET", 16)
    model = load_eos_prone(eos_prone_path)
    eager, audio_eager = await run_codes(make_engine(model, max_slots=4), mixed_requests(model))
    eng = make_engine(model, max_slots=4, frame_step="padded")
    static, audio_static = await run_codes(eng, mixed_requests(model))
    assert eng._runner._frame_step is not None and eng._runner._frame_step.kv_buckets[:3] == [16, 32, 64]
    reasons = [r for r, _ in eager]
    assert FinishReason.EOS in reasons and FinishReason.BUDGET in reasons
    for (r_e, c_e), (r_s, c_s), a_e, a_s in zip(eager, static, audio_eager, audio_static, strict=True):
        assert r_e is r_s
        assert torch.equal(c_e, c_s)
        # Same codes; Code2Wav may batch chunks differently (admission timing), so audio matches to rounding.
        np.testing.assert_allclose(a_e, a_s, rtol=0, atol=1e-5)


def test_padding_rows_touch_only_the_scratch_slot(tiny_model):
    talker = tiny_model.talker
    t = tiny_model.config.talker
    S = 4  # live slots 0..3, scratch 4
    g = torch.Generator().manual_seed(0)
    cache = talker.new_cache(S + 1, 64)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    state = cuda_graph.SlotState.zeros(S + 1, t.hidden_size, t.vocab_size, torch.device("cpu"), torch.float32)
    state.h.normal_(generator=g)
    suppressed = suppress_mask(t.vocab_size, t.codebook_size, t.codec_eos_token_id)
    runner = cuda_graph.FrameStepRunner(talker, state, cache, suppressed, t.codec_eos_token_id, S, S, use_graphs=False)
    before = (cache.k.clone(), cache.v.clone(), state.h.clone(), state.seen.clone())
    text = [torch.randn(t.hidden_size, generator=g) for _ in range(3)]
    with torch.inference_mode():
        codes = runner.step([0, 2, 1], [5, 6, 7], [0, 0, 0], [10, 20, 30], text)  # 3 rows: bucket 4, one padding row
    assert codes.shape == (3, 16) and codes.device.type == "cpu"
    k, v, h, seen = before
    untouched = 3
    assert torch.equal(cache.k[:, untouched], k[:, untouched]) and torch.equal(cache.v[:, untouched], v[:, untouched])
    assert torch.equal(state.h[untouched], h[untouched]) and torch.equal(state.seen[untouched], seen[untouched])
    # Live rows wrote exactly their own position; the padding row wrote position 0 of the scratch slot.
    for slot, pos in ((0, 10), (2, 20), (1, 30), (S, 0)):
        changed = (cache.k[:, slot] != k[:, slot]).any(dim=(0, 1, 3)).nonzero().flatten().tolist()
        assert changed == [pos]
        assert not torch.equal(state.h[slot], h[slot])
    assert state.seen[[0, 2, 1], codes[:, 0]].all()


@needs_cuda
async def test_cuda_graphs_equal_eager_on_cuda(eos_prone_path):
    model = load_eos_prone(eos_prone_path, device="cuda")

    def cuda_engine(**kw) -> NativeEngine:
        # TF32 and the float16 decoder off: this test holds the streamed audio to the exact whole decode
        # (test_decoder.py checks the float16 decoder graphed against eager).
        fast, kw = FastPath.split(kw)
        cfg = EngineSettings(
            model_path=str(model.path), device="cuda", max_slots=4, decoder_tf32=False, decoder_fp16=False, **kw
        )
        return NativeEngine(cfg, model=model, fast_path=fast)

    eager, audio_eager = await run_codes(cuda_engine(frame_step="eager", warmup=False), mixed_requests(model))
    eng = cuda_engine(frame_step="graphs", warmup=True)  # warmup captures every bucket up front
    graphed, audio_graphed = await run_codes(eng, mixed_requests(model))
    # The fused path needs no kv buckets, and a lone row runs in the 2-row graph: buckets 2 and 4.
    assert eng.model_info["cuda_graphs"] and eng.model_info["fused_kernels"]
    assert eng._runner._frame_step.batch_buckets == [2, 4] and len(eng._runner._frame_step.kv_buckets) == 1
    assert eng._runner._frame_step.num_graphs == 2
    for i, ((r_e, c_e), (r_g, c_g)) in enumerate(zip(eager, graphed, strict=True)):
        assert r_e is r_g, f"request {i}"
        assert torch.equal(c_e, c_g), f"request {i}: first differing frame {(c_e != c_g).any(1).nonzero()[:1]}"
    reasons = [r for r, _ in eager]
    assert FinishReason.EOS in reasons and FinishReason.BUDGET in reasons
    for (_, c), a_e, a_g in zip(graphed, audio_eager, audio_graphed, strict=True):
        np.testing.assert_allclose(a_e, a_g, rtol=0, atol=1e-4)
        # The streamed audio equals one whole decode of the codes.
        with torch.inference_mode():
            whole = model.code2wav(c.T[None].cuda())[0].cpu().numpy() if len(c) else np.zeros(0, np.float32)
        np.testing.assert_allclose(a_g, whole, rtol=0, atol=1e-4)


def cublas_workspace_bytes() -> int:
    """What cuBLAS keeps for a stream it had not run on: the device memory one small matmul there leaves allocated
    once its product is freed (the stream's workspace)."""
    a = torch.ones(64, 64, device="cuda")
    before = torch.cuda.memory_allocated()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = a @ a
    torch.cuda.synchronize()
    del out
    return torch.cuda.memory_allocated() - before


@needs_cuda
async def test_a_stopped_engine_leaves_a_cublas_workspace_per_stream_not_per_graph(tiny_model):
    """cuBLAS keeps a workspace for each stream a matmul ran on, for the life of the process. The runners used to
    warm each graph up on a new stream, leaving a workspace per graph (0.82 GiB of the 0.6B engine's 3.08 GiB on an
    H100). Now the frame steps, the prefill and Code2Wav each warm up and capture on one stream of their own: once an
    engine with many graphs is stopped and collected, at most a workspace for each stream it ran on is left (those
    three, the steps', the decoder's, the loading thread's; by thread), and release_device_memory hands them back."""
    from qwen_tts.engines import release_device_memory

    release_device_memory()
    ws = cublas_workspace_bytes()
    if ws < 2**20:
        pytest.skip(f"this torch keeps no per-stream cuBLAS workspace ({ws} bytes)")
    release_device_memory()
    base = torch.cuda.memory_allocated()
    model = load_model(tiny_model.path, device="cuda")
    eng = NativeEngine(EngineSettings(model_path=str(model.path), device="cuda", max_slots=8), model=model)
    async with started(eng):
        await run(eng, [req(model, TEXTS[1], seed=5, max_frames=20)])
    r = eng._runner
    graphs = r._frame_step.num_graphs + r._prefiller.num_graphs + r.decoder.decoder.num_graphs
    del eng, model, r
    gc.collect()
    left = torch.cuda.memory_allocated() - base
    assert graphs >= 16  # each on a new stream, these left at least 16 workspaces
    assert left <= 8 * ws + 2**20, (left / ws, graphs)
    release_device_memory()
    assert torch.cuda.memory_allocated() - base < 2**20


@needs_cuda
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"split_attention": False, "small_m_gemm": False},
        {"split_attention": True, "small_m_gemm": False},
        {"split_attention": False, "small_m_gemm": True},
        {"small_m_split_k": 1},
        {"cp_prompt_one_pass": False},
        {"kernel_sampler": False},
        {"cp_fused_feed": False},
        {"small_m_heads": True},
    ],
    ids=[
        "default",
        "neither-kernel",
        "split-attention-only",
        "small-m-gemm-only",
        "no-split-k",
        "cp-two-passes",
        "compiled-sampler",
        "cp-unfused-feed",
        "small-m-heads",
    ],
)
@pytest.mark.parametrize("greedy", [True, False])
async def test_cuda_graphs_batch_invariance(tiny_model, greedy, variant):
    model = load_model(tiny_model.path, device="cuda")
    eng = NativeEngine(
        EngineSettings(model_path=str(model.path), device="cuda", max_slots=8, warmup=False),
        model=model,
        fast_path=FastPath(**variant),
    )
    alone, batched = await alone_and_among_seven(eng, model, greedy)
    assert eng._runner._frame_step is not None and eng._runner._frame_step.num_graphs > 1
    assert torch.equal(alone, batched)
    fast = model.talker.kernels
    for name, on in (("split_attention", fast.split_attention), ("small_m_gemm", fast.regions.small_m > 0)):
        want = variant.get(name, getattr(FastPath, name))  # the default is both kernels on
        assert on == want


@needs_cuda
@pytest.mark.parametrize("greedy", [True, False])
async def test_cuda_stack_kernel_keeps_graphs_equal_eager_and_a_request_alone_equal_in_a_pair(
    tiny_model, greedy, monkeypatch
):
    """cp_stack_kernel="cuda" (bf16 code-predictor passes of at most four rows by stack_cuda.cu): a request gives the
    same codes alone and beside another (passes of 2 and 4 rows, all by the kernel), graphed and eager alike. Past four
    rows the fused path's kernels take the passes, so this invariance holds up to two streams (docs/history/benchmarks-diary.md)."""
    from qwen_tts.fastpath.stack import stack_cuda

    model = load_model(tiny_model.path, device="cuda")
    calls = []
    real = stack_cuda.stack_pass
    monkeypatch.setattr(stack_cuda, "stack_pass", lambda *a, **k: (calls.append(a[1].shape[0]), real(*a, **k))[1])
    results = {}
    for frame_step in ("eager", "graphs"):
        eng = NativeEngine(
            EngineSettings(model_path=str(model.path), device="cuda", max_slots=2, warmup=False),
            model=model,
            fast_path=FastPath(frame_step=frame_step, cp_stack_kernel="cuda"),
        )
        async with started(eng):
            target = req(model, TEXTS[1], seed=5, greedy=greedy, max_frames=20)
            (alone,), _ = await run(eng, [target])
            (pair, _), _ = await run(
                eng, [req(model, TEXTS[1], seed=5, greedy=greedy, max_frames=20), req(model, TEXTS[2], seed=9)]
            )
        assert eng.model_info["cp_stack_kernel"] == "cuda"
        assert model.talker.kernels.kernel("code_predictor") is not None
        assert torch.equal(codes_of(alone), codes_of(pair)), frame_step
        results[frame_step] = codes_of(alone)
    assert torch.equal(results["eager"], results["graphs"])
    # Every pass by the kernel: one or two streams' rows, the prompt's two tokens as two rows of one pass.
    assert calls and max(calls) == 4 and set(calls) <= {1, 2, 4}
    assert model.talker.kernels.kernel("code_predictor").prepare("cuda") is None


@needs_cuda
@pytest.mark.parametrize(
    ("greedy", "heads", "wide", "staged", "exact"),
    [(True, False, False, True, True), (False, True, False, True, True),
     (True, True, False, True, True), (False, True, True, True, True),
     (False, True, False, False, True), (True, True, False, True, False),
     (False, True, False, True, 3)],
)  # fmt: skip
async def test_cuda_talker_stack_kernel_keeps_graphs_equal_eager_and_a_request_alone_equal_in_a_pair(
    tiny_model, greedy, heads, wide, staged, exact, monkeypatch
):
    """talker_stack_kernel="cuda" with cp_stack_kernel="cuda": the talker's one-token passes (a long cache, attention in
    chunks) and the code predictor's by stack_cuda.cu. A request gives the same codes alone and beside another, graphed
    and eager alike, and the talker's passes all went through the kernel. With the heads on the few-row kernel too
    (small_m_heads), a lone stream's graphed steps are one row, not two padded (one_row_steps), and still give the codes
    it gets beside another stream. wide: the talker's blocks of 512 threads too (talker_stack_threads). staged: the
    talker's cached keys and values staged in shared memory (the default, talker_stack_stage), else read from the cache.
    exact: one-row passes by the kernel's one-row build (stack_exact_rows 1, the default; True), passes of up to three
    rows each by its own build (3), else every pass by the four-row build (False). The request runs past 64 positions,
    where the default talker_stack_split of 32 spreads its attention over three chunks, then four."""
    from qwen_tts.fastpath.stack import stack_cuda

    widen = dict(talker_stack_threads=512) if wide else {}
    if not staged:
        widen.update(talker_stack_stage=False)

    model = load_model(tiny_model.path, device="cuda")
    calls = []
    real = stack_cuda.stack_pass
    monkeypatch.setattr(
        stack_cuda, "stack_pass", lambda *a, **k: (calls.append((a[0], a[1].shape[0])), real(*a, **k))[1]
    )
    results = {}
    for frame_step in ("eager", "graphs"):
        eng = NativeEngine(
            EngineSettings(model_path=str(model.path), device="cuda", max_slots=2, warmup=False),
            model=model,
            fast_path=FastPath(frame_step=frame_step, cp_stack_kernel="cuda", talker_stack_kernel="cuda",
                               small_m_heads=heads, stack_exact_rows=int(exact), **widen),
        )  # fmt: skip
        async with started(eng):
            fast = model.talker.kernels
            opts = dataclasses.asdict(fast.stack_options)
            # the code predictor's blocks of 512 threads (the default), the talker's of 256 unless wide
            assert opts["threads"] == 512 and opts["long_threads"] == (512 if wide else 256)
            assert opts["stage"] is staged and opts["chunk"] == 64
            assert opts["split"] == 32 and opts["exact_rows"] == int(exact)
            for sw, n in (
                (fast.kernel("talker").weights, eng._runner._cache.max_len),
                (fast.kernel("code_predictor").weights, model.talker.code_predictor.num_residual + 1),
            ):
                dev = torch.device("cuda", torch.cuda.current_device())
                lay = stack_cuda.device_layout(sw, n, dev, 1, fast.stack_options)[0]
                assert lay.rows == (1 if exact else stack_cuda.MAX_ROWS)  # a one-row pass's build
            # 64 frames at least: the talker's positions pass 64, where its attention goes from one chunk to three
            target = req(model, TEXTS[1], seed=5, greedy=greedy, max_frames=72, min_frames=64)
            calls.clear()
            (alone,), _ = await run(eng, [target])
            alone_rows = {n for sw, n in calls if sw is fast.kernel("talker").weights}
            (pair, _), _ = await run(
                eng,
                [
                    req(model, TEXTS[1], seed=5, greedy=greedy, max_frames=72, min_frames=64),
                    req(model, TEXTS[2], seed=9),
                ],
            )
        assert eng.model_info["talker_stack_kernel"] == "cuda" and eng.model_info["cp_stack_kernel"] == "cuda"
        assert eng.model_info["one_row_steps"] == heads
        assert eng.model_info["stack_exact_rows"] == int(exact)
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        blocks = eng.model_info["stack_blocks"]  # the lean grid: at most every SM
        assert set(blocks) == {"code_predictor", "talker"} and all(0 < n <= sms for n in blocks.values()), blocks
        # A lone stream's talker passes: one row eagerly (exact shapes) and with one_row_steps, else padded to two.
        assert alone_rows == ({1} if frame_step == "eager" or heads else {2}), (frame_step, alone_rows)
        assert torch.equal(codes_of(alone), codes_of(pair)), frame_step
        results[frame_step] = codes_of(alone)
    assert torch.equal(results["eager"], results["graphs"])
    talker_rows = [n for sw, n in calls if sw is model.talker.kernels.kernel("talker").weights]
    assert talker_rows and set(talker_rows) <= {1, 2}  # one or two streams' rows, every frame by the kernel
    assert len(talker_rows) < len(calls)  # the code predictor's passes too


async def test_batched_prefill_matches_prefill_alone(tiny_model, monkeypatch):
    texts = [TEXTS[0], TEXTS[1] * 2, TEXTS[4]]  # different prompt lengths: the batch is padded
    eng = make_engine(tiny_model, max_slots=4)
    async with started(eng):
        alone = []
        for i, t in enumerate(texts):
            (h,), _ = await run(eng, [req(tiny_model, t, seed=i, greedy=True, max_frames=12)])
            alone.append(codes_of(h))
        sizes = []
        real = eng._runner.admit
        monkeypatch.setattr(eng._runner, "admit", lambda adm: (sizes.append(len(adm)), real(adm)))
        with eng._cv:  # the worker sees all three at once
            hs = [eng.submit(req(tiny_model, t, seed=i, greedy=True, max_frames=12)) for i, t in enumerate(texts)]
        await asyncio.gather(*(h.collect() for h in hs))
    assert sizes == [3]
    for a, h in zip(alone, hs, strict=True):
        assert torch.equal(a, codes_of(h))


def burst_requests(model) -> list[SynthesisRequest]:
    """Requests admitted together: x-vector voices with their text in the prefill, in three languages, greedy and
    sampled, and one with its text fed a token a step (not built with the others)."""
    languages = ["english", "auto", "german", "english", "auto"]
    rs = [
        req(model, TEXTS[i], seed=i, greedy=i % 2 == 0, max_frames=10, language=languages[i])
        for i in range(len(languages))
    ]
    return [*rs, req(model, TEXTS[6], seed=9, max_frames=10, non_streaming_text=False)]


@pytest.mark.parametrize(
    "setup",
    [{}, {"overlap_steps": True}, {"frame_step": "padded", "overlap_steps": True}],
    ids=["in-turn", "overlapped", "padded"],
)
async def test_prompts_built_together_give_the_codes_of_prompts_built_one_by_one(tiny_model, monkeypatch, setup):
    """A burst's x-vector prompts are built in one call: the same codes and audio as when that call fails and each
    request's prompt is built alone (the fallback); the streamed-text request is built on its own either way."""
    calls: list[int] = []
    real = runner_mod.build_text_prompts

    def counted(cfg, talker, texts, *rest):
        calls.append(len(texts))
        return real(cfg, talker, texts, *rest)

    out = {}
    for name, builder in (("together", counted), ("one by one", lambda *a: 1 / 0)):
        monkeypatch.setattr(runner_mod, "build_text_prompts", builder)
        eng = make_engine(tiny_model, max_slots=8, **setup)
        async with started(eng):
            with eng._cv:  # one admission for the whole burst
                hs = [eng.submit(r) for r in burst_requests(tiny_model)]
            audio = await asyncio.gather(*(h.collect() for h in hs))
        reasons = [h.stats.finish_reason for h in hs]
        assert set(reasons) <= {FinishReason.EOS, FinishReason.BUDGET}, (name, reasons)
        out[name] = ([codes_of(h) for h in hs], audio, reasons)
    assert calls == [5]
    assert out["together"][2] == out["one by one"][2]
    for a, b in zip(out["together"][0], out["one by one"][0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(out["together"][1], out["one by one"][1], strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_upload_gives_the_values_in_the_dtype_on_the_device(device):
    from qwen_tts.model.layers import upload

    ids = upload([3, 1, 2], torch.long, torch.device(device))
    assert ids.device.type == device and ids.dtype == torch.long and ids.tolist() == [3, 1, 2]
    x = torch.randn(7, generator=torch.Generator().manual_seed(0))
    y = upload(x, torch.bfloat16, torch.device(device))
    assert y.dtype == torch.bfloat16 and torch.equal(y.cpu(), x.to(torch.bfloat16))
    assert torch.equal(upload(y, torch.float32, torch.device(device)).cpu(), x.to(torch.bfloat16).float())
    flags = upload([True, False], torch.bool, torch.device(device))
    assert flags.tolist() == [True, False]


async def test_a_prefill_group_gives_each_slot_its_own_request_settings(tiny_model, monkeypatch):
    """Sampling settings are written for a whole admission group at once: each slot must get its own request's, and
    the slots the requests ran in alone before are reset (`seen` too: the first request's repetition penalty), so
    each request's codes in the group equal its codes alone."""
    settings = [
        dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.3, cp_temperature=1.1, cp_top_k=5),
        dict(greedy=True),
        dict(temperature=1.2, top_k=0, top_p=0.95, repetition_penalty=1.0, cp_temperature=0.6, cp_top_p=0.5),
    ]
    texts = [TEXTS[0], TEXTS[1], TEXTS[4]]
    eng = make_engine(tiny_model, max_slots=4)
    await eng.start()
    written = []
    real = eng._runner._set_slot_params

    def spy(slots, reqs):
        real(slots, reqs)
        st = eng._runner._state
        written.append(
            {
                int(slot): (float(st.temp[slot]), int(st.top_k[slot]), float(st.top_p[slot]), float(st.rep[slot]),
                            bool(st.greedy[slot]), float(st.cp_temp[slot]), int(st.cp_top_k[slot]),
                            float(st.cp_top_p[slot]), bool(st.cp_greedy[slot]), int(st.seed[slot]))
                for slot in slots.tolist()
            }
        )  # fmt: skip

    try:
        alone = []
        for i, (t, kw) in enumerate(zip(texts, settings, strict=True)):
            (h,), _ = await run(eng, [req(tiny_model, t, seed=100 + i, max_frames=10, **kw)])
            alone.append(codes_of(h))
        monkeypatch.setattr(eng._runner, "_set_slot_params", spy)
        with eng._cv:  # the worker sees all three at once: one group
            rs = [
                req(tiny_model, t, seed=100 + i, max_frames=10, **kw)
                for i, (t, kw) in enumerate(zip(texts, settings, strict=True))
            ]
            hs = [eng.submit(r) for r in rs]
        await asyncio.gather(*(h.collect() for h in hs))
    finally:
        await eng.stop()
    assert len(written) == 1 and len(written[0]) == 3  # one group, three slots

    def f32(x: float) -> float:
        return torch.tensor(x, dtype=torch.float32).item()

    for r in rs:
        expect = (
            f32(max(r.temperature, 1e-5)), r.top_k, f32(r.top_p), f32(r.repetition_penalty), r.greedy,
            f32(max(r.cp_temperature, 1e-5)), r.cp_top_k, f32(r.cp_top_p), r.greedy, r.seed & ((1 << 62) - 1),
        )  # fmt: skip
        assert [v for v in written[0].values() if v[9] == expect[9]] == [expect]
    for a, h in zip(alone, hs, strict=True):
        assert torch.equal(a, codes_of(h))


async def test_cancel_while_queued_leaves_the_queue_at_once(tiny_model):
    eng = make_engine(tiny_model, max_slots=1, max_queue=1, first_chunk_frames=1)
    async with started(eng):
        running = eng.submit(req(tiny_model, TEXTS[1], max_frames=2000, min_frames=10_000))
        await running.__anext__()  # it holds the only slot
        queued = eng.submit(req(tiny_model, TEXTS[0], max_frames=5))
        assert eng.num_waiting == 1
        eng.cancel(queued)
        assert eng.num_waiting == 0
        assert (await queued.collect()).shape == (0,)
        assert queued.stats.finish_reason is FinishReason.CANCELLED
        # Its queue place is free again although the slot is still busy.
        again = eng.submit(req(tiny_model, TEXTS[0], max_frames=5))
        eng.cancel(running)
        assert (await again.collect()).shape == (5 * 1920,)


async def test_burst_arriving_at_an_idle_engine_shares_one_prefill(tiny_model, monkeypatch):
    eng = make_engine(tiny_model, max_slots=4, admission_window_s=0.2)
    await eng.start()
    sizes = []
    real = eng._runner.admit
    monkeypatch.setattr(eng._runner, "admit", lambda adm: (sizes.append(len(adm)), real(adm)))
    try:
        hs = [eng.submit(req(tiny_model, t, seed=i, max_frames=4)) for i, t in enumerate(TEXTS[:4])]
        await asyncio.gather(*(h.collect() for h in hs))
    finally:
        await eng.stop()
    assert sizes == [4]
