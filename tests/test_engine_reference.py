"""The batching engine generates exactly the codes of the reference loop (`generate_codes`), which parity checks
against the official package: mixed settings in one batch, exact and padded (bucketed) steps.

Settings are chosen so that every rule the engine re-implements changes the codes on the tiny model: a strong
repetition penalty, an end-of-speech logit boost (so EOS lands right at `min_frames` for some rows and at varied
frames for others), top-k and top-p together, both text modes, sampled and greedy rows.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from qwen_tts.engine_api import EngineSettings, FinishReason, SynthesisRequest
from qwen_tts.engines.native import NativeEngine
from qwen_tts.engines.native.frame_step import StepCodes
from qwen_tts.fastpath.options import FastPath
from qwen_tts.model.reference_loop import generate_codes

# (text, options): each row exercises a different part of the loop.
CASES = [
    ("The quick brown fox jumps over the lazy dog.", dict(greedy=True, repetition_penalty=1.8, min_frames=2)),
    ("Streaming text, one token per step.", dict(greedy=True, non_streaming_text=False, min_frames=6)),
    ("Sampled with top-k and top-p.", dict(temperature=0.9, top_k=20, top_p=0.8, repetition_penalty=1.6)),
    (
        "Sampled, text fed per step, a long minimum.",
        dict(temperature=1.2, top_k=0, top_p=0.9, non_streaming_text=False, min_frames=9, repetition_penalty=2.0),
    ),
    ("Residual codes sampled their own way.", dict(cp_temperature=0.6, cp_top_k=7, cp_top_p=0.85, min_frames=4)),
    ("Guten Tag, wie geht es Ihnen heute?", dict(greedy=True, language="german", repetition_penalty=1.3)),
    ("A short one.", dict(temperature=0.7, top_k=5, non_streaming_text=False, repetition_penalty=3.0)),
    # Long rows (EOS masked throughout): greedy and near-greedy decoding repeat ids, so the penalty decides codes.
    ("The penalty must shape a long greedy run.", dict(greedy=True, repetition_penalty=1.5, min_frames=41)),
    ("And a cold sampled run.", dict(temperature=0.3, top_k=3, repetition_penalty=2.0, min_frames=41)),
]
MAX_FRAMES = 40
# The request's fields that generate_codes takes under the same names (`reference` maps the others).
SAME_NAMES = ("language", "greedy", "temperature", "top_k", "top_p", "repetition_penalty",
              "cp_temperature", "cp_top_k", "cp_top_p", "seed")  # fmt: skip


@contextlib.contextmanager
def eos_boost(model, boost: float):
    """Add `boost` to the end-of-speech logit of the talker (both the engine and the reference loop see it)."""
    eos = model.config.talker.codec_eos_token_id

    def hook(_module, _inputs, out):
        return (
            out + torch.nn.functional.one_hot(torch.tensor(eos, device=out.device), out.shape[-1]).to(out.dtype) * boost
        )

    handle = model.talker.codec_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def request(model, i: int, text: str, opts: dict) -> SynthesisRequest:
    x = torch.randn(model.config.xvector_dim, generator=torch.Generator().manual_seed(100 + i))
    return SynthesisRequest(text=text, xvector=x, seed=1000 + i, max_frames=MAX_FRAMES, return_codes=True, **opts)


def reference(model, req: SynthesisRequest) -> torch.Tensor:
    """The reference loop's codes for a request: x-vector, or ICL with the request's reference."""
    icl = req.icl
    return generate_codes(
        model.talker,
        model.config,
        model.tokenizer,
        req.text,
        req.xvector,
        non_streaming=req.non_streaming_text,
        max_frames=req.max_frames,
        min_new_tokens=req.min_frames,
        ref_codes=None if icl is None else icl.codes,
        ref_text=None if icl is None else icl.text,
        **{name: getattr(req, name) for name in SAME_NAMES},
    )


async def run_engine(model, requests: list[SynthesisRequest], **settings) -> tuple[NativeEngine, list]:
    p = next(model.talker.parameters())  # the engine runs where the model's weights are, in their dtype
    where = {"device": p.device.type, "dtype": str(p.dtype).removeprefix("torch."), "warmup": False}
    fast, settings = FastPath.split(settings)  # the fast-path options among them
    cfg = EngineSettings(model_path=str(model.path), max_slots=8, **{**where, **settings})
    eng = NativeEngine(cfg, model=model, fast_path=fast)
    await eng.start()
    try:
        handles = [eng.submit(r) for r in requests]
        await asyncio.gather(*(h.collect() for h in handles))
    finally:
        await eng.stop()
    return eng, handles


async def engine_codes(model, requests: list[SynthesisRequest], padded: bool, **settings) -> list:
    # "padded": the graph runner's padded, bucketed step, run eagerly
    eng, handles = await run_engine(model, requests, frame_step="padded" if padded else "eager", **settings)
    assert type(eng._runner._frame_step).__name__ == ("FrameStepRunner" if padded else "EagerFrameStep")
    return handles


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
async def test_engine_codes_equal_the_reference_loop_for_mixed_requests(tiny_qwen3tts, padded, overlap) -> None:
    """overlapped: each step launched before the one before is read (overlap_steps, CUDA's default), so a row
    that ends at a step was already stepped once more: those codes must never reach the request."""
    model = tiny_qwen3tts
    with eos_boost(model, 3.0):
        reqs = [request(model, i, text, opts) for i, (text, opts) in enumerate(CASES)]
        expected = [reference(model, r) for r in reqs]
        handles = await engine_codes(model, reqs, padded, overlap_steps=overlap)
    lengths = []
    for (text, _), h, ref in zip(CASES, handles, expected, strict=True):
        got = torch.cat(h.codes) if h.codes else torch.zeros(0, 16, dtype=torch.long)
        assert torch.equal(got, ref), (text, got.shape, ref.shape)
        reason = FinishReason.BUDGET if ref.shape[0] == MAX_FRAMES else FinishReason.EOS
        assert h.stats.finish_reason is reason, text
        lengths.append(ref.shape[0])
    # The settings really make EOS matter: some rows stop early, some at their min_frames exactly, not all alike.
    assert min(lengths) < MAX_FRAMES and len(set(lengths)) >= 3, lengths
    assert any(n == opts.get("min_frames", 2) for n, (_, opts) in zip(lengths, CASES, strict=True)), lengths


@pytest.mark.parametrize(("codebook", "value"), [(0, 2100), (0, -1), (5, 2048), (15, 4096)])
async def test_a_code_outside_the_codebook_ends_only_its_request(tiny_qwen3tts, codebook, value) -> None:
    model = tiny_qwen3tts
    cfg = EngineSettings(model_path=str(model.path), device="cpu", warmup=False, max_slots=4)
    eng = NativeEngine(cfg, model=model)
    reqs = [request(model, i, text, dict(greedy=True, min_frames=41)) for i, (text, _) in enumerate(CASES[:3])]
    victim = reqs[1]

    def corrupting(slots, frames, *rest):  # a fault (NaN logits, a kernel bug) yields an impossible code
        step = real(slots, frames, *rest)
        codes = step.result()
        for i, (slot, frame) in enumerate(zip(slots, frames, strict=True)):
            if eng._live[slot].handle.request is victim and frame == 6:
                codes[i, codebook] = value
        return StepCodes(codes, None)

    await eng.start()
    real = eng._runner._frame_step.launch
    eng._runner._frame_step.launch = corrupting
    try:
        handles = [eng.submit(r) for r in reqs]
        results = await asyncio.gather(*(h.collect() for h in handles), return_exceptions=True)
        assert eng.ready
        after = eng.submit(request(model, 9, CASES[0][0], dict(greedy=True, min_frames=41)))
        await after.collect()
    finally:
        await eng.stop()
    bad = handles[1]
    assert isinstance(results[1], Exception) and bad.stats.finish_reason is FinishReason.ERROR
    assert bad.stats.error == (
        f"generation produced code {value} for codebook {codebook}, outside the codebook (size 2048)"
    )
    assert len(bad.codes) == 0 or torch.cat(bad.codes).shape[0] <= 6  # the bad frame never reached the decoder
    for i in (0, 2):
        assert handles[i].stats.finish_reason is FinishReason.BUDGET
        assert torch.equal(torch.cat(handles[i].codes), reference(model, reqs[i]))
    assert after.stats.finish_reason is FinishReason.BUDGET and after.stats.frames == MAX_FRAMES


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("frame_step", ["eager", "graphs"])
@pytest.mark.parametrize("size", ["tiny", "tiny-mtp"])
async def test_engine_codes_equal_the_reference_loop_on_cuda_in_float32(
    tiny_checkpoint, tmp_path, size, frame_step
) -> None:
    """The same mixed requests on CUDA in float32: the reference loop eager, the engine eager or on its full fast
    path (fused kernels, CUDA-graph frame steps and prefill, the decoder thread). tiny-mtp has a code predictor
    behind small_to_mtp_projection, as the 1.7B: there the engine gathers the predictor's inputs from projected
    tables (cp_input_tables) and runs the heads on the few-row kernel (small_m_heads)."""
    from qwen_tts.model.loading import load_model
    from qwen_tts.model.random_checkpoint import write_random_checkpoint

    path = tiny_checkpoint if size == "tiny" else write_random_checkpoint(tmp_path / size, size=size, seed=0)
    model = load_model(path, device="cuda", dtype=torch.float32)
    reqs = [request(model, i, text, opts) for i, (text, opts) in enumerate(CASES)]
    expected = [reference(model, r) for r in reqs]  # before the engine builds its tables on this model
    eng, handles = await run_engine(
        model,
        reqs,
        device="cuda",
        dtype="float32",
        warmup=frame_step == "graphs",
        frame_step=frame_step,
        decoder_tf32=False,
        cp_input_tables=True,
        small_m_heads=True,
    )
    assert eng.model_info["cuda_graphs"] == (frame_step == "graphs")
    assert eng.model_info["cp_input_tables"] == (size == "tiny-mtp")
    assert eng.model_info["small_m_heads"] is True
    for (text, _), h, ref in zip(CASES, handles, expected, strict=True):
        got = torch.cat(h.codes) if h.codes else torch.zeros(0, 16, dtype=torch.long)
        n = min(len(got), len(ref))
        same = int((got[:n] == ref[:n].cpu()).all(1).cumprod(0).sum())
        assert got.shape == ref.shape and same == n, f"{text}: {same} of {len(ref)} frames agree, got {len(got)}"
