"""Code2Wav's elementwise kernel (qwen_tts/fastpath/snake_kernel.py) and the conv stack that runs on it
(`Code2Wav.use_kernels` with the kernel as its `snake`), against the eager modules.

Without a GPU the kernel runs in Triton's interpreter (conftest.py); on CUDA, on the device.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from qwen_tts.fastpath.decode_attention import HAVE_TRITON
from qwen_tts.model.codec_decoder import CausalConv1d, Code2Wav, SnakeBeta
from tests.test_codec_decoder import random_codes, stream_decode, tiny_config, variance_preserving_init

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton (the interpreter on CPU)")

if HAVE_TRITON:
    from qwen_tts.fastpath import snake_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def eager_snake(v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    m = SnakeBeta(alpha.shape[0]).double().to(v.device)
    with torch.no_grad():
        m.alpha.copy_(alpha)
        m.beta.copy_(beta)
        return m(v.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_snake_sums_pads_and_activates_in_one_pass(dtype) -> None:
    """Every combination the conv stack uses: x + y + bias (each optional; y a strided view, as a transposed
    conv's trimmed output is), the history or zeros in front, the sum kept or not; lengths below, at and above
    the kernel's block; against SnakeBeta's eager expression in float64."""
    g = torch.Generator().manual_seed(0)
    B, C = 3, 5
    alpha, beta = (0.3 * torch.randn(C, generator=g)).to(DEVICE), (0.3 * torch.randn(C, generator=g)).to(DEVICE)
    for L in (1, 7, snake_kernel.BLOCK, snake_kernel.BLOCK + 37):
        x = torch.randn(B, C, L, generator=g).to(DEVICE, dtype)
        y_full = torch.randn(B, C, L + 6, generator=g).to(DEVICE, dtype)
        y = y_full[..., :L]  # a trimmed view: stride L + 6 between channels
        bias = torch.randn(C, generator=g).to(DEVICE, dtype)
        for ctx in (0, 6, 54):
            hist = torch.randn(B, C, ctx, generator=g).to(DEVICE, dtype)
            for use_x, use_y, use_b, use_h in [(1, 0, 0, 0), (0, 1, 1, 0), (1, 1, 1, 1), (0, 1, 1, 1), (1, 0, 1, 1)]:
                kw = dict(x=x if use_x else None, y=y if use_y else None, bias=bias if use_b else None)
                v = sum(t.double() for t in (kw["x"], kw["y"]) if t is not None)
                if use_b:
                    v = v + bias.double()[:, None]
                want_pad = hist.double() if use_h else torch.zeros(B, C, ctx, dtype=torch.float64, device=DEVICE)
                want = torch.cat([want_pad, eager_snake(v, alpha, beta)], dim=-1)
                out, kept = snake_kernel.snake(
                    alpha, beta, **kw, context=ctx, history=hist if use_h else None, keep_sum=True
                )
                assert out.shape == (B, C, ctx + L) and out.dtype == dtype and out.is_contiguous()
                tol = 2e-3 * max(1.0, want.abs().max().item()) if dtype == torch.float16 else 1e-5
                torch.testing.assert_close(out.double(), want, rtol=0, atol=tol)
                torch.testing.assert_close(kept.double(), v, rtol=0, atol=tol)
                assert torch.equal(out[..., :ctx], want_pad.to(dtype))  # the history is copied, not rounded
                none, no_sum = snake_kernel.snake(alpha, beta, **kw, context=ctx, history=hist if use_h else None)
                assert no_sum is None and torch.equal(none, out)


def snake_kernels() -> SimpleNamespace:
    """Code2Wav's kernels (`DecoderKernels`) with the snake kernel alone."""
    return SimpleNamespace(snake=snake_kernel.snake, snake_beta=None)


def test_polynomial_sin_matches_float64_over_the_arguments_snake_sees() -> None:
    """poly_sin: sin by range reduction and a polynomial instead of Triton's `tl.sin`. For arguments up to
    |x e^alpha| ~ 400 (alpha up to 4.6) and the reduction's edges (multiples of pi/2): both within float32's
    rounding of float64 SnakeBeta, that is of the argument x e^alpha (4 * 2^-24 of it: on CUDA e^alpha comes from
    the hardware's exp2, a few ulps, and 2 * 2^-24 was exceeded by 4e-7 on an H200) and of the output (an ulp of
    |v| up to 100), plus 2e-6."""
    g = torch.Generator().manual_seed(3)
    C, L = 6, 4096
    alpha = torch.tensor([0.0, 0.5, -1.0, 2.0, 4.6, 3.0], device=DEVICE)
    beta = (0.3 * torch.randn(C, generator=g)).to(DEVICE)
    x = (8 * torch.rand(1, C, L, generator=g) - 4).to(DEVICE)
    x[0, :, :128] = torch.arange(-64, 64, device=DEVICE) * (torch.pi / 2) / alpha.exp()[:, None]  # args k pi/2
    want = eager_snake(x, alpha, beta)
    arg = (x.double() * alpha.double().exp()[:, None]).abs()
    inv = 1 / (beta.double().exp()[:, None] + 1e-9)
    tol = 2e-6 + 4 * 2.0**-24 * arg * inv + 2.0**-23 * want.abs()  # d sin^2 / d arg <= 1; the output's ulp
    for poly in (True, False):
        got, _ = snake_kernel.snake(alpha, beta, x=x, poly_sin=poly)
        err = (got.double() - want).abs()
        assert (err <= tol).all(), (poly, (err - tol).max().item())
    assert arg.max() > 350  # the large arguments were there


def test_snake_refuses_inputs_that_do_not_line_up() -> None:
    a = torch.zeros(4, device=DEVICE)
    x = torch.zeros(2, 4, 10, device=DEVICE)
    with pytest.raises(ValueError, match="needs x or y"):
        snake_kernel.snake(a, a)
    with pytest.raises(ValueError, match="share their shape"):
        snake_kernel.snake(a, a, x=x, y=torch.zeros(2, 4, 9, device=DEVICE))
    with pytest.raises(ValueError, match=r"history must be \(2, 4, 6\)"):
        snake_kernel.snake(a, a, x=x, context=6, history=torch.zeros(2, 4, 5, device=DEVICE))


@pytest.fixture(scope="module")
def c2w() -> Code2Wav:
    return variance_preserving_init(Code2Wav(tiny_config())).eval().to(DEVICE)


@pytest.fixture
def no_tf32():
    """cuDNN runs float32 convs in TF32 by default (10-bit mantissas): the kernel's once-rounded inputs then move
    the output by ~1e-4 (seen on an H200), rounding, not an error. Off for the float32 comparisons, as in
    test_decoder.py's graphed-decode test."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize(
    ("dtype", "polyphase"), [(torch.float32, 0), (torch.float16, 3)], ids=["fp32", "fp16-polyphase"]
)
def test_conv_stack_on_the_kernel_decodes_and_streams_like_the_modules(c2w, no_tf32, dtype, polyphase) -> None:
    """The snake kernel (`use_kernels`): every conv of the final stack without its bias, the kernel doing bias, residual sum,
    SnakeBeta and causal padding between them. Whole decodes and streamed ones (chunks of 1 to 12 frames, so
    histories longer and shorter than a chunk) equal the modules' own decodes to rounding, and the stream's state
    after the last chunk is the modules' state."""
    ref = copy.deepcopy(c2w)
    ref.set_decoder_dtype(dtype)
    ref.set_polyphase_dilation(polyphase)
    fast = copy.deepcopy(ref)
    fast.use_kernels(snake_kernels())
    codes = random_codes(c2w.cfg, 2, 20).to(DEVICE)
    chunks = [1, 3, 12, 4]
    with torch.no_grad():
        want, got = ref(codes), fast(codes)
        s_ref, s_fast = ref.new_stream(2), fast.new_stream(2)
        pieces_ref, pieces_fast, start = [], [], 0
        for n in chunks:
            part = codes[..., start : start + n]
            pieces_ref.append(ref.decode_chunk(part, s_ref))
            pieces_fast.append(fast.decode_chunk(part, s_fast))
            start += n
    streamed_ref, streamed = torch.cat(pieces_ref, dim=-1), torch.cat(pieces_fast, dim=-1)
    assert 0.05 < want.pow(2).mean().sqrt() < 0.9  # a live signal, not clamped flat
    # float16: the modules round each elementwise op to 11 bits, the kernel once per activation (as the float16
    # tests of test_codec_decoder.py, a few ulps of full scale); float32: rounding only.
    tol = dict(rtol=0, atol=8e-3) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(streamed, streamed_ref, **tol)
    torch.testing.assert_close(streamed, stream_decode(fast, codes, [20]), **tol)
    state_tol = dict(rtol=0, atol=2e-2) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(s_fast.conv_history + s_fast.tconv_overlap, s_ref.conv_history + s_ref.tconv_overlap, strict=True):
        torch.testing.assert_close(a, b, **state_tol)
    convs = [m for m in fast.decoder.modules() if isinstance(m, CausalConv1d)]
    assert all(m.conv.bias is not None for m in convs)  # the biases are still the modules', only added later
    fast.use_kernels(None)
    with torch.no_grad():
        torch.testing.assert_close(fast(codes), want, rtol=0, atol=0)


def test_slot_decoder_on_the_snake_kernel_matches_the_modules(no_tf32) -> None:
    """The engine's slot-indexed decoder (gather rows by slot, decode, scatter the state back; padded to its
    buckets) on the snake kernel's conv stack: five slots in a batched first chunk, then three rows together and
    two alone, against the same through the eager modules."""
    from qwen_tts.engines.native.decoder import SlotDecoder

    cfg = tiny_config()
    base = variance_preserving_init(Code2Wav(cfg).eval()).to(DEVICE)
    codes = random_codes(cfg, 5, 9, seed=3).to(DEVICE)

    def run(model):
        dec = SlotDecoder(model, max_slots=6, chunk_lens=[3, 6], mode="padded")
        with torch.inference_mode():
            first = dec.decode([0, 1, 2, 3, 4], [True] * 5, codes[:, :, :3])
            rest = [dec.decode([0, 1, 2], [False] * 3, codes[:3, :, 3:9])]
            rest += [dec.decode([s], [False], codes[s : s + 1, :, 3:9]) for s in (3, 4)]
        return torch.cat([first, torch.cat(rest)], dim=-1)

    fast = copy.deepcopy(base)
    fast.use_kernels(snake_kernels())
    want, got = run(base), run(fast)
    assert got.shape == want.shape == (5, 9 * base.total_upsample)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
