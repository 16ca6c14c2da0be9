"""The engine's streaming decoder: slot-indexed Code2Wav state (exact, padded, graphed), the worker's batching order,
and the engine delivering the same audio with the decoder on its own thread as inline."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_codec_decoder import random_codes, tiny_config, variance_preserving_init

from qwen_tts.engine_api import EngineSettings, FinishReason, SynthesisRequest
from qwen_tts.engines.native import decoder as decoder_mod
from qwen_tts.engines.native.decoder import DecodeJob, DecodeWorker, SlotDecoder
from qwen_tts.engines.native.engine import NativeEngine
from qwen_tts.engines.native.frame_step import bucket
from qwen_tts.fastpath.options import FastPath
from qwen_tts.model.codec_decoder import Code2Wav
from qwen_tts.model.loading import load_model
from qwen_tts.model.random_checkpoint import write_random_checkpoint


@pytest.fixture(scope="module")
def c2w() -> Code2Wav:
    return variance_preserving_init(Code2Wav(tiny_config())).eval()


# A schedule the engine could produce: (request, slot, frames) per row of each call; a request's first row is
# fresh. Slot 0 is reused by request "e" after "b" ended, slot 3 by "f" after "a"; calls mix first chunks, later
# chunks and final short chunks, and batches of 1-3 rows (padded to the 1, 2, 4 buckets). As in the engine, only
# a request's final chunk is shorter than the call's longest.
SCHEDULE = [
    [("a", 3, 3), ("b", 0, 3), ("c", 4, 3)],
    [("a", 3, 5), ("b", 0, 5)],
    [("d", 1, 3), ("c", 4, 2)],  # c ends with a short chunk (padded to 3)
    [("a", 3, 5), ("d", 1, 5), ("b", 0, 1)],  # b ends (1 frame, padded to 5)
    [("e", 0, 3)],  # e takes b's slot: fresh state, whatever b left there
    [("a", 3, 4), ("e", 0, 5), ("d", 1, 5)],  # a ends
    [("f", 3, 3), ("e", 0, 2)],  # e ends; f starts in a's slot
    [("d", 1, 5)],
    [("f", 3, 5), ("d", 1, 1)],
]


@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_slot_decoder_streams_every_request_exactly(c2w, mode):
    cfg = c2w.cfg
    total = {}
    for call in SCHEDULE:
        for name, _, t in call:
            total[name] = total.get(name, 0) + t
    codes = {name: random_codes(cfg, 1, n, seed=10 + i)[0] for i, (name, n) in enumerate(sorted(total.items()))}
    dec = SlotDecoder(c2w, max_slots=5, chunk_lens=[3, 5], mode=mode)
    done, audio = {}, {name: [] for name in total}
    with torch.inference_mode():
        for call in SCHEDULE:
            T = max(dec.padded_len(t) for _, _, t in call)
            batch = torch.zeros(len(call), cfg.num_quantizers, T, dtype=torch.long)
            for i, (name, _, t) in enumerate(call):
                batch[i, :, :t] = codes[name][:, done.get(name, 0) : done.get(name, 0) + t]
            fresh = [name not in done for name, _, _ in call]
            wav = dec.decode([slot for _, slot, _ in call], fresh, batch)
            assert wav.shape == (len(call), T * c2w.total_upsample) and wav.device.type == "cpu"
            for i, (name, _, t) in enumerate(call):
                audio[name].append(wav[i, : t * c2w.total_upsample])
                done[name] = done.get(name, 0) + t
        for name, c in codes.items():
            whole = c2w(c[None])[0]
            torch.testing.assert_close(torch.cat(audio[name]), whole, msg=f"request {name} ({mode})")
    if mode == "padded":
        assert dec.padded_len(1) == 3 and dec.padded_len(4) == 5 and dec.batch_buckets == [1, 2, 4, 5]
    else:
        assert dec.padded_len(4) == 4


def test_slot_decoder_rejects_an_unknown_mode(c2w):
    with pytest.raises(ValueError, match="exact, padded or graphs"):
        SlotDecoder(c2w, 2, [3], "fast")


def _job(rows, key, first=False):
    return DecodeJob(
        rows=rows,
        slots=list(range(len(rows))),
        lengths=[1] * len(rows),
        codes=torch.zeros(len(rows), 1, 1, dtype=torch.long),
        first=first,
        fresh=[first] * len(rows),
        key=key,
    )


def _worker(max_batch=8) -> DecodeWorker:
    dec = SimpleNamespace(device=torch.device("cpu"))
    return DecodeWorker(dec, None, None, threading.Condition(), False, max_batch, {})


def test_worker_takes_first_chunks_first_and_merges_jobs_of_one_shape():
    a, b, c, d, e = (SimpleNamespace(name=n) for n in "abcde")
    w = _worker()
    j1, j2, j3 = _job([a, b], (12, False, -1)), _job([c], (3, True, -1), True), _job([d], (12, False, -1))
    j4, j5 = _job([a], (12, False, -1)), _job([e], (3, True, -1), True)
    w._queue = [j1, j2, j3, j4, j5]
    assert w._take() == [j2, j5]  # first chunks ahead of older later chunks, merged
    assert w._take() == [j1, j3]  # j4 holds row a again: it must wait for j1
    assert w._take() == [j4]
    assert w._queue == []


def test_worker_never_runs_a_rows_chunk_ahead_of_an_earlier_one_left_in_the_queue():
    a, b = SimpleNamespace(), SimpleNamespace()
    w = _worker()
    j1, j2, j3 = _job([a], (12, False, -1)), _job([b], (5, False, -1)), _job([b], (12, False, -1))
    w._queue = [j1, j2, j3]
    assert w._take() == [j1]  # j3 has j1's shape, but b's earlier chunk j2 has another: j3 waits for it
    assert w._take() == [j2]
    assert w._take() == [j3]


def test_worker_merges_no_more_rows_than_its_largest_batch():
    rows = [SimpleNamespace() for _ in range(5)]
    w = _worker(max_batch=4)
    jobs = [_job(rows[:3], (12, False, -1)), _job(rows[3:4], (12, False, -1)), _job(rows[4:], (12, False, -1))]
    w._queue = list(jobs)
    assert w._take() == jobs[:2]
    assert w._take() == jobs[2:]


def test_worker_decodes_inside_its_gpu_guard_on_its_own_thread():
    """The engine passes a lock while graphs are captured lazily: every decode call must run holding it."""
    lock = threading.Lock()
    held = []

    def decode(slots, fresh, codes):
        held.append((lock.locked(), len(slots)))
        return torch.zeros(len(slots), codes.shape[-1] * 4)

    dec = SimpleNamespace(device=torch.device("cpu"), decode=decode, upsample=4)
    delivered, cv = [], threading.Condition()
    w = DecodeWorker(
        dec, lambda row, c, wav: delivered.append(row), None, cv, True, 8, defaultdict(float), gpu_guard=lock
    )
    try:
        rows = [SimpleNamespace(cancelled=False) for _ in range(3)]
        for r in rows:
            w.submit(_job([r], (1, False, -1)))
        with cv:
            assert cv.wait_for(lambda: w.completed == 3, timeout=10)
        with lock:  # the engine holding it: the worker must wait
            w.submit(_job([SimpleNamespace(cancelled=False)], (1, False, -1)))
            time.sleep(0.2)
            assert sum(n for _, n in held) == 3
        with cv:
            assert cv.wait_for(lambda: not w.busy, timeout=10)
    finally:
        w.close()
    assert sum(n for _, n in held) == 4 and all(locked for locked, _ in held)
    assert len(delivered) == 4


def test_worker_keeps_batch_invariant_rows_apart():
    a, b = SimpleNamespace(), SimpleNamespace()
    w = _worker()
    ja, jb = _job([a], (12, False, 0)), _job([b], (12, False, 1))
    w._queue = [ja, jb]
    assert w._take() == [ja]
    assert w._take() == [jb]


# ------------------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", size="tiny", seed=0)
    return load_model(path, device="cpu")


def _requests(model, n):
    return [
        SynthesisRequest(
            text=f"Request number {i} of the decoder test.",
            xvector=torch.randn(model.config.xvector_dim, generator=torch.Generator().manual_seed(i)),
            seed=i,
            min_frames=5 + 7 * i,
            max_frames=5 + 7 * i,
            return_codes=True,
        )
        for i in range(n)
    ]


async def _serve(model, requests, **kw):
    fast, kw = FastPath.split(kw)
    cfg = EngineSettings(model_path=str(model.path), device="cpu", warmup=False, **kw)
    engine = NativeEngine(cfg, model=model, fast_path=fast)
    await engine.start()
    try:
        handles = [engine.submit(r) for r in requests]
        audio = await asyncio.gather(*(h.collect() for h in handles))
        return handles, audio, dict(engine.timings)
    finally:
        await engine.stop()


@pytest.mark.parametrize("frame_step", ["eager", "padded"])
def test_engine_audio_is_the_same_with_the_decoder_on_its_own_thread(tiny_model, frame_step):
    reqs = _requests(tiny_model, 4)
    handles, threaded, timings = asyncio.run(_serve(tiny_model, reqs, frame_step=frame_step, decode_thread=True))
    _, inline, _ = asyncio.run(_serve(tiny_model, _requests(tiny_model, 4), frame_step=frame_step, decode_thread=False))
    for i, (h, a, b) in enumerate(zip(handles, threaded, inline, strict=True)):
        n = 5 + 7 * i
        assert h.stats.finish_reason == FinishReason.BUDGET and h.stats.frames == n
        assert a.shape == b.shape == (n * 1920,)
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)  # batch composition may differ: rounding only
        # The streamed audio is the whole decode of the request's codes.
        codes = torch.cat(h.codes).T[None]
        with torch.inference_mode():
            whole = tiny_model.code2wav(codes)[0].numpy()
        np.testing.assert_allclose(a, whole, atol=2e-5, rtol=0)
    assert timings["decode_chunks"] >= 1 and timings["decode_rows"] >= timings["decode_chunks"]
    # Admission's host time in its parts: each part ran, and together they are within the whole.
    parts = [timings[f"prefill_{k}_s"] for k in ("prompt", "talker", "slots")]
    assert min(parts) > 0 and sum(parts) <= timings["prefill_s"]


def test_a_failing_chunk_ends_only_its_request(tiny_model, monkeypatch):
    real = decoder_mod.SlotDecoder.decode
    bad_slots = []

    def decode(self, slots, fresh, codes):
        if bad_slots and bad_slots[0] in slots:
            raise RuntimeError("injected decode fault")
        return real(self, slots, fresh, codes)

    monkeypatch.setattr(decoder_mod.SlotDecoder, "decode", decode)

    async def main():
        cfg = EngineSettings(model_path=str(tiny_model.path), device="cpu", warmup=False)
        engine = NativeEngine(cfg, model=tiny_model)
        await engine.start()
        try:
            reqs = _requests(tiny_model, 3)
            handles = [engine.submit(r) for r in reqs]
            bad_slots.append(1)  # slots are handed out 0, 1, 2: the second request's chunks fail
            results = await asyncio.gather(*(h.collect() for h in handles), return_exceptions=True)
            # The engine is still alive and serves the next request in full (in whatever slot).
            bad_slots.clear()
            after = await engine.submit(_requests(tiny_model, 1)[0]).collect()
            return handles, results, after
        finally:
            await engine.stop()

    handles, results, after = asyncio.run(main())
    assert handles[1].stats.finish_reason == FinishReason.ERROR
    assert handles[1].stats.error == "decode failed: RuntimeError"
    assert isinstance(results[1], Exception)
    for i in (0, 2):
        assert handles[i].stats.finish_reason == FinishReason.BUDGET
        assert results[i].shape == ((5 + 7 * i) * 1920,)
    assert after.shape == (5 * 1920,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("fp16", "polyphase", "snake"),
    [
        (False, 0, False),
        (True, 0, False),
        (True, 3, False),
        (False, 3, True),
        (True, 3, True),
    ],
    ids=["fp32", "fp16-decoder", "fp16-polyphase", "fp32-snake-kernel", "fp16-snake-kernel"],
)
def test_graphed_decode_equals_the_eager_padded_decode_on_cuda(c2w, fp16, polyphase, snake):
    import copy

    from qwen_tts.fastpath import snake_kernel

    cfg = c2w.cfg
    model = copy.deepcopy(c2w).to("cuda")
    if fp16:
        model.set_decoder_dtype(torch.float16)
    model.set_polyphase_dilation(polyphase)
    if snake:
        model.use_kernels(SimpleNamespace(snake=snake_kernel.snake, snake_beta=None))
    try:
        torch.backends.cudnn.allow_tf32 = False
        graphs = SlotDecoder(model, max_slots=5, chunk_lens=[3, 5], mode="graphs")
        eager = SlotDecoder(model, max_slots=5, chunk_lens=[3, 5], mode="padded")
        with torch.inference_mode():
            graphs.capture_all()
            assert graphs.num_graphs == 2 * 4
            done = {}
            for call in SCHEDULE:
                T = max(graphs.padded_len(t) for _, _, t in call)
                batch = random_codes(cfg, len(call), T, seed=len(done))
                fresh = [name not in done for name, _, _ in call]
                slots = [slot for _, slot, _ in call]
                a = graphs.decode(slots, fresh, batch)
                b = eager.decode(slots, fresh, batch)
                # float16: the same kernels, but a float16 ulp at full scale is ~1e-3
                torch.testing.assert_close(a, b, atol=2e-3 if fp16 else 1e-5, rtol=0)
                for name, _, t in call:
                    done[name] = done.get(name, 0) + t
    finally:
        torch.backends.cudnn.allow_tf32 = True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tf32_matmuls_are_captured_into_the_graphs_only(c2w, monkeypatch):
    """tf32_matmul: cuBLAS's TF32 switch is on while the graphs are captured (they keep the kernels captured), and
    back off once they are; the graphs' audio stays near the float32 graphs'."""
    import copy

    captured = []
    orig = decoder_mod.capture_graph

    def spy(*a, **k):
        captured.append(torch.backends.cuda.matmul.allow_tf32)
        return orig(*a, **k)

    monkeypatch.setattr(decoder_mod, "capture_graph", spy)
    model = copy.deepcopy(c2w).to("cuda")
    codes = random_codes(c2w.cfg, 2, 5, seed=3)
    out = {}
    torch.backends.cuda.matmul.allow_tf32 = False
    for tf32 in (False, True):
        captured.clear()
        dec = SlotDecoder(model, max_slots=2, chunk_lens=[5], mode="graphs", tf32_matmul=tf32)
        with torch.inference_mode():
            dec.capture_all()
            assert captured == [tf32] * dec.num_graphs and dec.num_graphs == 2
            assert torch.backends.cuda.matmul.allow_tf32 is False
            out[tf32] = dec.decode([0, 1], [True, True], codes)
    torch.testing.assert_close(out[True], out[False], atol=2e-2 * out[False].abs().max().item(), rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_decode_through_pinned_buffers_returns_the_graphs_audio_in_chunks_of_their_own(c2w):
    """The pinned host buffers serve every call: each chunk returned must be its own tensor (the next call refills
    the buffers), the graph's inputs are the call's, and the audio is the graph's output bit for bit."""
    import copy

    model = copy.deepcopy(c2w).to("cuda")
    dec = SlotDecoder(model, max_slots=5, chunk_lens=[3, 5], mode="graphs")
    with torch.inference_mode():
        dec.capture_all()
        done, chunks = {}, []
        for call in SCHEDULE:
            T = max(dec.padded_len(t) for _, _, t in call)
            batch = random_codes(c2w.cfg, len(call), T, seed=len(done))
            fresh = [name not in done for name, _, _ in call]
            slots = [slot for _, slot, _ in call]
            wav = dec.decode(slots, fresh, batch)
            assert wav.device.type == "cpu" and wav.dtype == torch.float32
            assert wav.shape == (len(call), T * dec.upsample)
            buf = dec._graphs[(bucket(len(call), dec.batch_buckets), T)][1]
            assert buf["idx"][: len(call)].tolist() == slots and buf["fresh"][: len(call)].tolist() == fresh
            assert torch.equal(buf["codes"][: len(call)].cpu(), batch)
            assert torch.equal(wav, buf["wav"][: len(call)].float().cpu())
            chunks.append((wav, wav.clone()))
            for name, _, t in call:
                done[name] = done.get(name, 0) + t
    for wav, copy_then in chunks:  # no later call wrote into an earlier chunk
        assert torch.equal(wav, copy_then)
    assert any(w.abs().max() > 0 for w, _ in chunks)


# ------------------------------------------------------------------------------------------------- prefill
def test_padded_prefill_equals_exact_prefill(tiny_model):
    from qwen_tts.engines.native.prefill import PrefillRunner, len_buckets

    talker = tiny_model.talker
    H = talker.codec_head.weight.shape[1]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randn(n, H, generator=g) for n in (5, 37, 20)]  # lengths pad to 64; batch 3 pads to 4
    out, caches = {}, {}
    for mode in ("exact", "padded"):
        cache = talker.new_cache(6, 128)
        runner = PrefillRunner(talker, cache, scratch=5, max_batch=4, max_len=100, max_tokens=256, mode=mode)
        with torch.inference_mode():
            out[mode] = runner.run(prompts, [2, 0, 4])
        caches[mode] = cache
    assert runner.shape(3, 37) == (4, 64) and runner.len_buckets == len_buckets(100) == [32, 64, 100]
    torch.testing.assert_close(out["padded"], out["exact"], rtol=1e-5, atol=1e-5)
    for slot, n in ((2, 5), (0, 37), (4, 20)):  # the real positions' K/V; later ones are overwritten by decoding
        for a, b in zip(caches["padded"].k, caches["exact"].k, strict=True):
            torch.testing.assert_close(a[slot, :, :n], b[slot, :, :n], rtol=1e-5, atol=1e-5)
    assert caches["padded"].k[0][1].abs().sum() == 0  # a slot outside the group is untouched
    # Grouping: a padded group stays within max_tokens unless it is a single prompt.
    assert runner.fits(2, 64) and not runner.fits(4, 100) and runner.fits(1, 100) and not runner.fits(5, 10)


# ------------------------------------------------------------------------------------------------- SnakeBeta
def test_compiled_snake_beta_equals_eager_and_code2wav_still_streams_exactly(c2w):
    import copy

    from test_codec_decoder import stream_decode

    from qwen_tts.fastpath import fused
    from qwen_tts.model.codec_decoder import SnakeBeta

    snakes = [m for m in c2w.modules() if isinstance(m, SnakeBeta)]
    m = snakes[1]
    x = 3 * torch.randn(3, m.alpha.shape[0], 50, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(fused.snake_beta(x, m.alpha, m.beta), m(x), rtol=1e-6, atol=1e-6)
    model = copy.deepcopy(c2w)
    calls = []

    def counted(*args):
        calls.append(1)
        return fused.snake_beta(*args)

    model.use_kernels(SimpleNamespace(snake=None, snake_beta=counted))
    codes = random_codes(c2w.cfg, 2, 20, seed=9)
    with torch.inference_mode():
        whole = c2w(codes)
        streamed = stream_decode(model, codes, [3, 5, 12])
    torch.testing.assert_close(streamed, whole, rtol=1e-5, atol=1e-5)
    assert len(calls) == 3 * len(snakes) > 0  # every SnakeBeta of each of the three chunks by the compiled kernel
