"""Code2Wav: whole decode, exact streaming (any chunking, batched rows at different positions), causality, keys."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qwen_tts.model.codec_decoder import CausalConv1d, Code2Wav, Code2WavStream
from qwen_tts.model.config import Code2WavConfig
from qwen_tts.model.random_checkpoint import layer_stack


def tiny_config(**overrides) -> Code2WavConfig:
    kw = dict(
        codebook_size=32,
        codebook_dim=16,
        latent_dim=24,
        decoder_dim=32,
        **layer_stack(16, 32, 3, 4, 2, 8),
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=4,
        layer_scale_initial_scale=0.01,
        max_position_embeddings=8000,
        num_quantizers=4,
        upsample_rates=(4, 3),
        upsampling_ratios=(2, 2),
    )
    kw.update(overrides)
    return Code2WavConfig(**kw)


def variance_preserving_init(model: nn.Module, seed: int = 0) -> nn.Module:
    """Weights with std 1/sqrt(fan_in) and O(1) scales, so every layer matters and the output is not clamped."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "weight" and p.dim() >= 2:
                fan_in = p.shape[1] * (p.shape[2] if p.dim() == 3 else 1)
                if isinstance(model.get_submodule(name.rsplit(".", 2)[0]), nn.ConvTranspose1d):
                    fan_in = p.shape[0] * p.shape[2] // 2  # stride r overlaps 2 taps per output sample
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
            elif leaf in ("bias",):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif leaf in ("alpha", "beta"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif leaf in ("scale", "gamma"):
                p.copy_(0.5 + 0.1 * torch.randn(p.shape, generator=g))
            elif leaf == "embedding_sum":
                p.copy_(torch.randn(p.shape, generator=g))
            elif leaf == "cluster_usage":
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:  # norm weights
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        # Damp the residual branches so activations stay O(1) through the 3 residual units of each block.
        for name, p in model.named_parameters():
            if name.endswith("conv2.conv.weight"):
                p.mul_(0.3)
        model.decoder[-1].conv.weight.mul_(0.5)
    return model


@pytest.fixture(scope="module")
def model() -> Code2Wav:
    return variance_preserving_init(Code2Wav(tiny_config())).eval()


def random_codes(cfg: Code2WavConfig, b: int, t: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.codebook_size, (b, cfg.num_quantizers, t), generator=g)


def stream_decode(model: Code2Wav, codes: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    stream = model.new_stream(codes.shape[0])
    out, s = [], 0
    for n in chunks:
        out.append(model.decode_chunk(codes[..., s : s + n], stream))
        s += n
    assert s == codes.shape[-1]
    return torch.cat(out, dim=-1)


def test_output_length_is_frames_times_upsample_and_not_clamped(model):
    codes = random_codes(model.cfg, 2, 11)
    with torch.no_grad():
        wav = model(codes)
    assert wav.shape == (2, 11 * model.cfg.total_upsample) == (2, 11 * 48)
    assert wav.dtype == torch.float32
    assert wav.abs().max() <= 1.0
    # The init must give a live signal that mostly stays inside the clamp, or the stream test proves little.
    assert 0.02 < wav.abs().mean() < 0.8
    assert (wav.abs() == 1.0).float().mean() < 0.05


@pytest.mark.parametrize(
    "chunks",
    [[1] * 20, [1, 3, 12, 4], [7, 13], [20], [2, 1, 1, 5, 11]],
    ids=["ones", "1-3-12-4", "7-13", "whole", "mixed"],
)
def test_stream_equals_whole_decode(model, chunks):
    # 20 frames > 3 layers x window 4: the exact result needs the per-layer K/V state, not just a frame context.
    codes = random_codes(model.cfg, 2, 20)
    with torch.no_grad():
        whole = model(codes)
        streamed = stream_decode(model, codes, chunks)
    torch.testing.assert_close(streamed, whole)


def test_long_sequence_uses_blocked_attention_exactly(model):
    # Longer than the 128-query attention block, so the whole decode splits its queries.
    codes = random_codes(model.cfg, 1, 300, seed=3)
    with torch.no_grad():
        whole = model(codes)
        streamed = stream_decode(model, codes, [150, 1, 149])
    torch.testing.assert_close(streamed, whole)


def test_batched_streams_at_different_positions(model):
    cfg = model.cfg
    a, b = random_codes(cfg, 1, 15, seed=4), random_codes(cfg, 1, 15, seed=5)
    with torch.no_grad():
        ref_a, ref_b = model(a), model(b)
        sa, sb = model.new_stream(), model.new_stream()
        pieces_a = [model.decode_chunk(a[..., :5], sa)]  # row a is 5 frames ahead of row b
        s = Code2WavStream.cat([sa, sb])
        assert s.position.tolist() == [5, 0]
        both = model.decode_chunk(torch.cat([a[..., 5:9], b[..., 0:4]]), s)
        pieces_a.append(both[:1])
        pieces_b = [both[1:]]
        sa, sb = s.split()
        pieces_a.append(model.decode_chunk(a[..., 9:], sa))
        s = Code2WavStream.cat([sb])
        pieces_b.append(model.decode_chunk(b[..., 4:], s))
    torch.testing.assert_close(torch.cat(pieces_a, -1), ref_a)
    torch.testing.assert_close(torch.cat(pieces_b, -1), ref_b)


def test_batched_whole_decode_equals_per_row(model):
    codes = random_codes(model.cfg, 3, 9, seed=6)
    with torch.no_grad():
        batched = model(codes)
        rows = torch.cat([model(codes[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(batched, rows)


def test_causal_later_frame_does_not_change_earlier_samples(model):
    codes = random_codes(model.cfg, 1, 12, seed=7)
    changed = codes.clone()
    changed[:, :, 8] = (changed[:, :, 8] + 1) % model.cfg.codebook_size
    up = model.cfg.total_upsample
    with torch.no_grad():
        w0, w1 = model(codes), model(changed)
    assert torch.equal(w0[:, : 8 * up], w1[:, : 8 * up])
    assert not torch.allclose(w0[:, 8 * up :], w1[:, 8 * up :])


def test_empty_chunk_returns_no_samples_and_keeps_state(model):
    stream = model.new_stream(2)
    codes = random_codes(model.cfg, 2, 0)
    assert model.decode_chunk(codes, stream).shape == (2, 0)
    assert stream.position.tolist() == [0, 0]


def test_rejects_wrong_number_of_codebooks(model):
    with pytest.raises(ValueError, match="codes must be"):
        model(torch.zeros(1, 3, 5, dtype=torch.long))


def test_state_dict_keys_mirror_checkpoint_names():
    keys = set(Code2Wav(tiny_config(num_hidden_layers=1)).state_dict())
    expected_some = {
        "quantizer.rvq_first.input_proj.weight",
        "quantizer.rvq_first.output_proj.weight",
        "quantizer.rvq_first.vq.layers.0._codebook.embedding_sum",
        "quantizer.rvq_rest.vq.layers.2._codebook.cluster_usage",
        "pre_conv.conv.weight",
        "pre_transformer.input_proj.bias",
        "pre_transformer.layers.0.self_attn.q_proj.weight",
        "pre_transformer.layers.0.mlp.gate_proj.weight",
        "pre_transformer.layers.0.self_attn_layer_scale.scale",
        "pre_transformer.norm.weight",
        "pre_transformer.output_proj.weight",
        "upsample.1.0.conv.weight",
        "upsample.1.1.dwconv.conv.weight",
        "upsample.1.1.gamma",
        "decoder.0.conv.weight",
        "decoder.1.block.0.alpha",
        "decoder.2.block.1.conv.bias",
        "decoder.2.block.4.conv1.conv.weight",
        "decoder.3.beta",
        "decoder.4.conv.weight",
    }
    assert expected_some <= keys
    assert not any("inv_freq" in k for k in keys)


def test_stream_state_is_updated_in_place_at_fixed_addresses(model):
    # Fixed buffers let the engine capture decode_chunk of a fixed shape in a CUDA graph.
    stream = model.new_stream(2)
    tensors = [stream.position, *stream.conv_history, *stream.tconv_overlap, *stream.keys, *stream.values]
    ptrs = [t.data_ptr() for t in tensors]
    with torch.no_grad():
        model.decode_chunk(random_codes(model.cfg, 2, 3), stream)
    after = [stream.position, *stream.conv_history, *stream.tconv_overlap, *stream.keys, *stream.values]
    assert [t.data_ptr() for t in after] == ptrs
    assert stream.position.tolist() == [3, 3]
    assert all(t.abs().sum() > 0 for t in stream.keys)


def test_split_rows_are_independent_copies(model):
    stream = model.new_stream(2)
    with torch.no_grad():
        model.decode_chunk(random_codes(model.cfg, 2, 2), stream)
        first, _ = stream.split()
        before = [t.clone() for t in stream.keys]
        model.decode_chunk(random_codes(model.cfg, 1, 4), first)
    assert first.position.tolist() == [6]
    assert stream.position.tolist() == [2, 2]
    for a, b in zip(before, stream.keys, strict=True):
        assert torch.equal(a, b)


def test_fp16_decoder_streams_like_its_whole_decode_with_state_in_each_layers_dtype(model):
    import copy

    half = copy.deepcopy(model)
    half.set_decoder_dtype(torch.float16)
    assert half.decoder_dtype == torch.float16 and half.pre_conv.conv.weight.dtype == torch.float32
    stream = half.new_stream(2)
    in_decoder = {id(m) for m in half.decoder.modules()}
    for m in half._convs:
        want = torch.float16 if id(m) in in_decoder else torch.float32
        assert stream.conv_history[m.slot].dtype == want
    assert {t.dtype for t in stream.keys} == {torch.float32}  # the transformer stays float32
    codes = random_codes(model.cfg, 2, 20)
    with torch.no_grad():
        exact = model(codes)
        whole = half(codes)
        streamed = stream_decode(half, codes, [1, 3, 12, 4])
    assert whole.dtype == streamed.dtype == torch.float32
    # float16 keeps 11 significant bits (an ulp at full scale is ~1e-3): the decode moves by a few ulps (3 seen),
    # and streaming rounds its convs at other lengths, so it matches its own whole decode to a few ulps (2 seen),
    # not bit for bit. A state in the wrong dtype or layout would be off by far more, or raise.
    assert 0 < (whole - exact).abs().max() < 8e-3
    assert (streamed - whole).abs().max() < 8e-3


def test_fp16_decoder_on_the_full_size_random_decoder_stays_within_minus_45_dbfs_of_the_exact_decode():
    """The engine's decoder_fp16, on the full-size 12 Hz decoder with the random checkpoint's weights: 12 frames
    (0.96 s of audio) against the float32 decode. Measured -51.8 dBFS here (float16 convolutions on the CPU)."""
    import copy

    from qwen_tts.model.random_checkpoint import _prefixed, code2wav_spec, model_config, random_state

    cfg = model_config("1.7b").speech_tokenizer.decoder
    exact = Code2Wav(cfg).eval()
    spec = _prefixed("decoder", code2wav_spec(cfg))  # the checkpoint's names: its init scales key on them
    exact.load_state_dict({k.removeprefix("decoder."): v for k, v in random_state(spec, 0, torch.float32)})
    half = copy.deepcopy(exact)
    half.set_decoder_dtype(torch.float16)
    codes = random_codes(cfg, 1, 12, seed=12)
    with torch.inference_mode():
        ref, got = exact(codes)[0], half(codes)[0]
    assert 0.05 < ref.pow(2).mean().sqrt() < 0.5 and (ref.abs() == 1.0).float().mean() < 0.01  # a live signal
    assert 20 * math.log10((got - ref).abs().max().item()) < -45


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_polyphase_dilated_convs_decode_and_stream_like_the_dilated_convolutions(model, dtype):
    """set_polyphase_dilation: dilated convs as undilated convs over the input's interleaved phases, the phases
    in the batch of a conv1d. The same function: one layer at lengths that do and
    do not divide into whole phases against a float64 dilated conv, then whole and streamed decodes (chunks
    shorter and longer than a phase) against the dilated convolutions."""
    import copy

    ref = copy.deepcopy(model)
    ref.set_decoder_dtype(dtype)
    poly = copy.deepcopy(ref)
    poly.set_polyphase_dilation(9)
    convs = [m for m in poly.decoder.modules() if isinstance(m, CausalConv1d)]
    assert {m.conv.dilation[0] for m in convs if m.polyphase} == {9}
    poly.set_polyphase_dilation(3)
    assert {m.conv.dilation[0] for m in convs if m.polyphase} == {3, 9}
    layer = next(m for m in convs if m.conv.dilation[0] == 9)
    g = torch.Generator().manual_seed(4)
    for T in (1, 8, 9, 40):
        x = torch.randn(2, layer.conv.in_channels, T, generator=g).to(dtype)
        with torch.no_grad():
            y = layer(x)
            c = layer.conv
            want = F.conv1d(F.pad(x.double(), (layer.context, 0)), c.weight.double(), c.bias.double(), dilation=9)
        assert y.shape == want.shape == (2, c.out_channels, T) and y.dtype == dtype
        tol = 4e-3 * max(1.0, want.abs().max().item()) if dtype == torch.float16 else 1e-5
        torch.testing.assert_close(y.double(), want, rtol=0, atol=tol)
    codes = random_codes(model.cfg, 2, 20)
    with torch.no_grad():
        want = ref(codes)
        got = poly(codes)
        streamed = stream_decode(poly, codes, [1, 3, 12, 4])
    # float16: the stack rounds to 11 bits, streaming rounds its convs at other lengths (as in the float16 test
    # above); float32: rounding only.
    tol = dict(rtol=0, atol=8e-3) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(streamed, got, **tol)
    poly.set_polyphase_dilation(0)
    assert not any(m.polyphase for m in convs)
