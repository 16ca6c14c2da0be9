"""The native engine serves ICL requests (`SynthesisRequest.icl`) as the reference loop generates them.

Mixed batches of ICL and x-vector rows, greedy and sampled, both text modes: the engine's codes equal
`generate_codes` with the same reference; its streamed audio equals the decode of reference + generated codes with
the reference part cut (`decode_icl`, which test_icl_parity.py checks against the official package); a voice's
code block and decoder start are computed once (`IclCache`, `SlotDecoder.start_from`).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from test_engine_reference import eos_boost
from test_engine_reference import reference as loop_codes

from qwen_tts.engine_api import EngineSettings, FinishReason, SynthesisRequest
from qwen_tts.engines.native import NativeEngine
from qwen_tts.engines.native.icl_cache import IclCache
from qwen_tts.fastpath.options import FastPath
from qwen_tts.icl import IclReference
from qwen_tts.model.icl_prompt import decode_icl, ref_text_ids
from qwen_tts.text_stream import TextStream

HOP = 1920
MAX_FRAMES = 24


def reference(frames: int, text: str, key: str, seed: int) -> IclReference:
    codes = torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(seed))
    return IclReference(codes=codes, text=text, key=key)


VOICE_A = reference(6, "What the first clip says.", "sha256:a", 1)
VOICE_B = reference(40, "第二段参考音频。", "sha256:b", 2)
# (text, icl, options): ICL rows of two voices beside x-vector rows, greedy and sampled, both text modes.
CASES = [
    ("The quick brown fox jumps over the lazy dog.", VOICE_A, dict(greedy=True, repetition_penalty=1.5)),
    ("Streaming text, one token per step.", VOICE_A, dict(non_streaming_text=False, top_k=20, min_frames=5)),
    ("An x-vector row in the same batch.", None, dict(greedy=True, non_streaming_text=False)),
    ("你好，世界。", VOICE_B, dict(language="chinese", temperature=1.1, top_p=0.9, repetition_penalty=1.4)),
    ("A sampled x-vector row.", None, dict(temperature=0.8, top_k=10, min_frames=4)),
    ("Greedy, text fed per step, long reference.", VOICE_B, dict(greedy=True, non_streaming_text=False)),
]


def request(model, i: int, text: str, icl: IclReference | None, opts: dict) -> SynthesisRequest:
    x = torch.randn(model.config.xvector_dim, generator=torch.Generator().manual_seed(100 + i))
    opts = {"max_frames": MAX_FRAMES, **opts}
    return SynthesisRequest(text=text, xvector=x, seed=1000 + i, return_codes=True, icl=icl, **opts)


def loop_audio(model, req: SynthesisRequest, codes: torch.Tensor) -> np.ndarray:
    """The reference loop's output audio: decode-and-cut for ICL (less the one reference sample the official cut
    keeps for some lengths: a stream starts at ref * 1920), the plain decode otherwise."""
    with torch.inference_mode():
        if req.icl is None:
            return model.code2wav(codes.T[None])[0].cpu().numpy()
        wav = decode_icl(model.code2wav, req.icl.codes, codes)
    return wav[len(wav) - len(codes) * HOP :].cpu().numpy()


def make_engine(model, **settings) -> NativeEngine:
    fast, settings = FastPath.split(settings)
    p = next(model.talker.parameters())
    where = {"device": p.device.type, "dtype": str(p.dtype).removeprefix("torch."), "warmup": False}
    cfg = EngineSettings(model_path=str(model.path), max_slots=8, **{**where, **settings})
    return NativeEngine(cfg, model=model, fast_path=fast)


async def run(eng: NativeEngine, requests: list[SynthesisRequest]):
    handles = [eng.submit(r) for r in requests]
    audio = await asyncio.gather(*(h.collect() for h in handles))
    return handles, audio


def codes_of(handle) -> torch.Tensor:
    return torch.cat(handle.codes) if handle.codes else torch.zeros(0, 16, dtype=torch.long)


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
async def test_icl_and_xvector_rows_in_one_batch_give_the_reference_loops_codes_and_audio(
    tiny_qwen3tts, padded, overlap
):
    model = tiny_qwen3tts
    with eos_boost(model, 2.0):
        reqs = [request(model, i, *case) for i, case in enumerate(CASES)]
        expected = [loop_codes(model, r) for r in reqs]
        eng = make_engine(model, frame_step="padded" if padded else "eager", overlap_steps=overlap)
        await eng.start()
        try:
            handles, audio = await run(eng, reqs)
        finally:
            await eng.stop()
    lengths = []
    for r, h, ref, wav in zip(reqs, handles, expected, audio, strict=True):
        got = codes_of(h)
        assert torch.equal(got, ref), (r.text, got.shape, ref.shape)
        assert h.stats.finish_reason is (FinishReason.BUDGET if len(ref) == MAX_FRAMES else FinishReason.EOS)
        np.testing.assert_allclose(wav, loop_audio(model, r, ref), rtol=1.3e-6, atol=1e-5, err_msg=r.text)
        lengths.append(len(ref))
    assert len(set(lengths)) >= 2 and min(lengths) > 0, lengths  # EOS matters: not every row runs the same length
    # Two voices: each code block built once, each reference decoded once, whatever the rows per voice.
    assert (eng._runner.icl.misses, eng._runner.icl.hits) == (2, 2)
    assert eng._runner.decoder.decoder.references_decoded == 2


async def test_a_second_request_of_a_voice_hits_the_cache_and_gives_the_same_result(tiny_qwen3tts):
    model = tiny_qwen3tts
    eng = make_engine(model, first_chunk_frames=2, chunk_frames=5)
    first = request(model, 0, CASES[0][0], VOICE_A, dict(greedy=True, min_frames=MAX_FRAMES))
    again = request(model, 0, CASES[0][0], VOICE_A, dict(greedy=True, min_frames=MAX_FRAMES))
    # the same voice under a new IclReference object (as a profile loaded again gives it): the key decides
    same_voice = IclReference(codes=VOICE_A.codes.clone(), text=VOICE_A.text, key=VOICE_A.key)
    third = request(model, 0, CASES[0][0], same_voice, dict(greedy=True, min_frames=MAX_FRAMES))
    await eng.start()
    try:
        (h1,), (a1,) = await run(eng, [first])
        cache, decoder = eng._runner.icl, eng._runner.decoder.decoder
        assert (cache.misses, cache.hits, decoder.references_decoded) == (1, 0, 1)
        voice = next(iter(cache._voices.values()))
        assert voice.key == VOICE_A.key and voice.block.shape == (6, model.config.talker.hidden_size)
        assert voice.decoder_state is not None and int(voice.decoder_state[0]) == 6  # position after the reference
        (h2,), (a2,) = await run(eng, [again])
        (h3,), (a3,) = await run(eng, [third])
        assert (cache.misses, cache.hits, decoder.references_decoded) == (1, 2, 1)
    finally:
        await eng.stop()
    assert torch.equal(codes_of(h1), codes_of(h2)) and torch.equal(codes_of(h1), codes_of(h3))
    assert len(a1) == MAX_FRAMES * HOP
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(a1, a3)
    np.testing.assert_allclose(a1, loop_audio(model, first, codes_of(h1)), rtol=1.3e-6, atol=1e-5)


def test_the_cache_keeps_the_most_recent_voices_and_rebuilds_a_key_that_now_holds_other_codes():
    built = []

    def block(codes: torch.Tensor) -> torch.Tensor:
        built.append(codes)
        return codes.float().sum(1, keepdim=True)

    cache = IclCache(capacity=2)
    a, b, c = (reference(3, "t", key, seed) for key, seed in (("a", 1), ("b", 2), ("c", 3)))
    va = cache.voice(a, [1], block)
    cache.voice(b, [1], block)
    assert cache.voice(a, [1], block) is va  # a is now the most recent
    cache.voice(c, [1], block)  # evicts b
    assert ("a" in cache, "b" in cache, "c" in cache) == (True, False, True)
    assert (cache.misses, cache.hits, len(built)) == (3, 1, 3)
    changed = reference(3, "t", "a", 9)  # the key reused for other codes: a new voice, not a stale hit
    assert cache.voice(changed, [1], block) is not va and cache.misses == 4
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        IclCache(capacity=0)


async def test_icl_requests_the_engine_cannot_serve_are_refused_at_submit(tiny_qwen3tts):
    model = tiny_qwen3tts
    eng = make_engine(model, max_text_tokens=64)
    await eng.start()
    try:
        # streaming-text mode: the prompt holds the reference alone (3 + 5 + 81 positions), whatever the text
        long_ref = reference(80, "A long reference.", "sha256:long", 4)
        n_ref = len(ref_text_ids(model.tokenizer, long_ref.text))
        pattern = (
            rf"^voice_mode: the voice's reference \(80 frames, a transcript of {n_ref} tokens\) makes an ICL prompt "
            r"of 89 positions in streaming-text mode; the limit is 80 \(max_text_tokens"
        )
        with pytest.raises(ValueError, match=pattern):
            eng.submit(request(model, 0, "Hello.", long_ref, dict(non_streaming_text=False)))
        streamed = request(model, 0, "Hello.", long_ref, dict(non_streaming_text=False))
        streamed.text_stream = TextStream("Hello.")
        with pytest.raises(ValueError, match=pattern):
            eng.submit(streamed)
        # non-streaming mode: the text is in the prompt too (3 + 5 + T1 + 61 positions), and the text field named
        mid_ref = reference(60, "A long reference.", "sha256:mid", 5)
        n_text = len(model.tokenizer.text_ids("Hello."))
        with pytest.raises(ValueError, match=rf"^text: {n_text} tokens with the voice's reference \(60 frames, a "
                                             rf"transcript of {n_ref} tokens\) make an ICL prompt of "
                                             rf"{8 + n_ref + n_text + 1 + 61} positions; the limit is 80"):  # fmt: skip
            eng.submit(request(model, 0, "Hello.", mid_ref, {}))
        bad = IclReference(codes=torch.full((4, 16), 2048, dtype=torch.long), text="t", key="k")
        with pytest.raises(ValueError, match=r"icl: reference codes must be in \[0, 2048\), got 2048"):
            eng.submit(request(model, 0, "Hello.", bad, {}))
        # a reference that fits is served
        h = eng.submit(request(model, 0, "Hello.", VOICE_A, dict(greedy=True, max_frames=3, min_frames=3)))
        await h.collect()
        assert h.stats.finish_reason is FinishReason.BUDGET and h.stats.frames == 3
    finally:
        await eng.stop()
    assert eng._runner.icl.misses == 1  # the refused requests never reached the cache


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("frame_step", ["eager", "graphs"])
async def test_icl_rows_on_cuda_in_float32_give_the_reference_loops_codes(tiny_checkpoint, frame_step):
    """The mixed batch on CUDA in float32, the engine eager or on its full fast path (CUDA-graph frame steps,
    prefill and decoder, the decoder thread). The reference codes come before the engine sets up its fast path on
    the model; the audio is compared after, through the same Code2Wav (float32 decoder)."""
    from qwen_tts.model.loading import load_model

    model = load_model(tiny_checkpoint, device="cuda", dtype=torch.float32)
    reqs = [request(model, i, *case) for i, case in enumerate(CASES)]
    expected = [loop_codes(model, r) for r in reqs]
    eng = make_engine(
        model, warmup=frame_step == "graphs", frame_step=frame_step, decoder_tf32=False, decoder_fp16=False
    )
    await eng.start()
    try:
        handles, audio = await run(eng, reqs)
    finally:
        await eng.stop()
    for r, h, ref, wav in zip(reqs, handles, expected, audio, strict=True):
        got, ref = codes_of(h), ref.cpu()
        assert torch.equal(got, ref), (r.text, got.shape, ref.shape)
        np.testing.assert_allclose(wav, loop_audio(model, r, ref.cuda()), rtol=1e-4, atol=1e-4, err_msg=r.text)
    assert eng._runner.decoder.decoder.references_decoded == 2


async def test_a_new_voice_has_its_reference_decoded_at_admission_ahead_of_its_first_chunk(tiny_qwen3tts):
    """The decoder gets the reference as a job of its own when the request is admitted, so when the first chunk
    comes, the voice's decoder start is there to copy."""
    model = tiny_qwen3tts
    eng = make_engine(model, first_chunk_frames=2)
    await eng.start()
    try:
        dec = eng._runner.decoder.decoder
        ready_at_first_chunk = []
        real = dec.start_from

        def start_from(slot, voice):
            ready_at_first_chunk.append(voice.decoder_state is not None)
            real(slot, voice)

        dec.start_from = start_from
        await run(eng, [request(model, 0, "Hello.", VOICE_B, dict(greedy=True, max_frames=4, min_frames=4))])
    finally:
        await eng.stop()
    assert ready_at_first_chunk == [True] and dec.references_decoded == 1
