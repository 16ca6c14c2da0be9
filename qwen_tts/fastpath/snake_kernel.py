"""Code2Wav's elementwise work as one Triton kernel per activation (the conv stack's fast path on CUDA).

Our own kernel (no official counterpart). In the final conv stack every convolution's output goes through the same
few elementwise steps before the next convolution reads it: the conv's bias, the residual sum, SnakeBeta, and,
before a causal conv, the left context (the stream's history, or zeros). Eager PyTorch makes each a pass over
the activation (cuDNN adds a bias in a pass of its own; `torch.cat` copies the whole input to put the history in
front): on an H200 a 64-row 12-frame float16 chunk spent 9.5 ms in SnakeBeta (compiled, one kernel each),
8.9 ms in other elementwise kernels and 3.4 ms in concatenations, of 38.8 ms of kernels (profile_step.py).

`snake` does them in one pass: it reads the inputs of the sum v = x + y + bias (any of them absent, x and y in any
strides), writes `[history | snake(v)]` into a fresh contiguous buffer (the conv's padded input), and, where the
residual needs it, v itself. One program covers one (row, channel) pair's block of samples, so the channel's
e^alpha and 1/(e^beta + 1e-9) are computed once per program, not per element. Pointwise: a row's result does not
depend on the others (batch invariant), and every launch captures into the decoder's CUDA graph.

On the H200 (profile_step.py, the same chunk): 29 launches, 5.9 ms, in place of 9.5 + 8.9 + ~2 ms; the chunk's
kernels 38.8 -> 24.3 ms, and the audio as close to the exact float32 decode as before (-50.5 dBFS).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qwen_tts.fastpath.decode_attention import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    _INV_2PI = tl.constexpr(0.15915494309189535)
    _2PI_HI = tl.constexpr(6.28125)  # 2 pi in two parts (Cody-Waite): k * _2PI_HI is exact for |k| < 2**15
    _2PI_LO = tl.constexpr(0.0019353071795864769)
    _PI = tl.constexpr(3.141592653589793)
    _HALF_PI = tl.constexpr(1.5707963267948966)

    @triton.jit
    def _sin_poly(x):
        """sin(x) for float32 x: reduced to [-pi, pi] by a two-part 2 pi, folded to [-pi/2, pi/2], then the Taylor
        polynomial to x**11 (truncation <= 6e-8 there). Absolute error ~1e-7 for |x| < 1e3, far below the float16
        activations' 1e-3; a few FMAs against the general sinf."""
        k = tl.floor(x * _INV_2PI + 0.5)
        r = (x - k * _2PI_HI) - k * _2PI_LO
        r = tl.where(r > _HALF_PI, _PI - r, r)
        r = tl.where(r < -_HALF_PI, -_PI - r, r)
        r2 = r * r
        p = -2.505210838544172e-08
        p = p * r2 + 2.7557319223985893e-06
        p = p * r2 - 0.0001984126984126984
        p = p * r2 + 0.008333333333333333
        p = p * r2 - 0.16666666666666666
        return r + r * r2 * p

    @triton.jit
    def _snake_kernel(
        x_ptr,
        y_ptr,
        bias_ptr,
        alpha_ptr,
        beta_ptr,
        hist_ptr,
        out_ptr,
        sum_ptr,
        C,
        L,
        CTX,
        sxb,
        sxc,
        sxl,
        syb,
        syc,
        syl,
        shb,
        shc,
        shl,
        HAS_X: tl.constexpr,
        HAS_Y: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_HIST: tl.constexpr,
        KEEP_SUM: tl.constexpr,
        POLY_SIN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # batch row * C + channel
        b = row // C
        c = row % C
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # position in the padded output [0, CTX + L)
        total = CTX + L
        inside = t < total
        j = t - CTX  # sample of v
        new = inside & (j >= 0)
        v = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_X:
            v += tl.load(x_ptr + b * sxb + c * sxc + j * sxl, mask=new, other=0.0).to(tl.float32)
        if HAS_Y:
            v += tl.load(y_ptr + b * syb + c * syc + j * syl, mask=new, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v += tl.load(bias_ptr + c).to(tl.float32)
        scale = tl.exp(tl.load(alpha_ptr + c).to(tl.float32))
        inv = 1.0 / (tl.exp(tl.load(beta_ptr + c).to(tl.float32)) + 1e-9)
        s = _sin_poly(v * scale) if POLY_SIN else tl.sin(v * scale)
        a = v + s * s * inv
        if HAS_HIST:
            old = tl.load(hist_ptr + b * shb + c * shc + t * shl, mask=inside & (j < 0), other=0.0).to(tl.float32)
            a = tl.where(j >= 0, a, old)
        else:
            a = tl.where(j >= 0, a, 0.0)
        tl.store(out_ptr + row * total + t, a.to(out_ptr.dtype.element_ty), mask=inside)
        if KEEP_SUM:
            tl.store(sum_ptr + row * L + j, v.to(sum_ptr.dtype.element_ty), mask=new)


BLOCK = 1024


def _strides(t: Tensor | None) -> tuple[int, int, int]:
    return tuple(t.stride()) if t is not None else (0, 0, 0)


def snake(
    alpha: Tensor,
    beta: Tensor,
    x: Tensor | None = None,
    y: Tensor | None = None,
    bias: Tensor | None = None,
    context: int = 0,
    history: Tensor | None = None,
    keep_sum: bool = False,
    poly_sin: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """v = x + y + bias[:, None] (each optional, at least one of x and y given; (B, C, L), any strides) ->
    (padded, sum): padded (B, C, context + L), contiguous, is `history` (B, C, context) then SnakeBeta(v), as
    `CausalConv1d` pads a conv's input (zeros without a history); sum is v itself when `keep_sum`, else None.
    Everything in float32 inside, rounded once to the inputs' dtype. `history` is only read: updating it from the
    padded buffer's tail is the caller's (a program writing it would race the programs reading it).

    poly_sin: sin as `_sin_poly` instead of Triton's tl.sin (off by default: the kernel is bound by its bytes, not
    its sines; docs/performance.md)."""
    ref = x if x is not None else y
    if ref is None:
        raise ValueError("snake needs x or y")
    B, C, L = ref.shape
    for t in (x, y):
        if t is not None and tuple(t.shape) != (B, C, L):
            raise ValueError(f"snake inputs must share their shape: {tuple(t.shape)} != {(B, C, L)}")
    if history is not None and tuple(history.shape) != (B, C, context):
        raise ValueError(f"history must be {(B, C, context)}, got {tuple(history.shape)}")
    total = context + L
    out = torch.empty(B, C, total, device=ref.device, dtype=ref.dtype)
    kept = torch.empty(B, C, L, device=ref.device, dtype=ref.dtype) if keep_sum else None
    if B * C == 0 or total == 0:
        return out, kept
    grid = (B * C, triton.cdiv(total, BLOCK))
    _snake_kernel[grid](
        x if x is not None else ref,
        y if y is not None else ref,
        bias if bias is not None else alpha,
        alpha,
        beta,
        history if history is not None else out,
        out,
        kept if kept is not None else out,
        C,
        L,
        context,
        *_strides(x),
        *_strides(y),
        *_strides(history),
        HAS_X=x is not None,
        HAS_Y=y is not None,
        HAS_BIAS=bias is not None,
        HAS_HIST=history is not None,
        KEEP_SUM=keep_sum,
        POLY_SIN=poly_sin,
        BLOCK=BLOCK,
        num_warps=4,
    )
    return out, kept
