"""A matmul for the few-row case of the one-token decoder step (Triton), as a torch custom op.

Our own kernel (no official counterpart). At one to a few streams the fused step multiplies 2-16 rows by each
weight matrix. cuBLAS runs those GEMMs on 64x8 tiles, which for a 2048-wide output is 32 thread blocks on an
H200's 132 SMs, and reads the weights at ~1.6 TB/s, a third of the bandwidth (docs/benchmarks.md). Here one program
owns BLOCK_N output columns for every row (the rows padded to 16 for `tl.dot`) and streams its slice of the weight
over K in BLOCK_K steps; narrow column blocks give more programs than SMs for every weight of the step.

A row's result does not depend on how many rows came with it: every row sees the same K order and the same tiles,
so a row gets the same bits alone as in a batch of up to SMALL_M_MAX rows. Larger batches go to `F.linear` (whose
reduction order differs), so the switch at SMALL_M_MAX is a boundary of batch invariance (the CUDA batch-invariance
test crosses it). On by default (`EngineSettings.small_m_gemm`), as measured on an H200 (docs/benchmarks.md).

`linear(x, w)` is `F.linear(x, w)` for 2-D x: under torch.compile it is one opaque call (a custom op with a fake
implementation), so the compiled blocks keep their fusions around it and the step still captures into a graph.

Split K (`set_max_split_k`; the engine sets EngineSettings.small_m_split_k, 4 by default, as measured on an
H200). A weight whose output gives fewer column blocks than the GPU has SMs (the code predictor's 1024-wide o and
down projections: 32 programs on 132 SMs) leaves SMs idle and too few loads in flight. With split K, S programs
share a column block, each over its own run of K tiles; each writes its float32 partial sums and bumps the block's counter, and the program that bumps it last adds
the S partials in split order (0, 1, ..., S-1), writes the output and resets the counter. One launch, no atomics
on the data, and the sum's order is fixed whichever program finishes last: the result is deterministic, and a
row's bits still do not depend on the other rows (S is chosen from N, K and the SM count only). The counters live
in one buffer per device (`prepare`, before any graph capture), so the kernel runs on one stream at a time, as the
engine's frame steps and prefill do.

Fusions (`EngineSettings.small_m_fusion`; off, measured slower on an H200: docs/benchmarks.md). A second kernel,
`_small_m_fused_kernel`, takes the RMSNorm before a matmul (`norm_linear`), SiLU * up after gate|up
(`norm_linear_silu`) and the residual add after it (`linear_add`). The plain matmul keeps the first kernel,
unchanged from the one measured into the defaults.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from qwen_tts.decode_attention import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

# Rows up to which `linear` runs the Triton kernel (one 16-row tile); more go to F.linear.
SMALL_M_MAX = 16
# Output columns per program, the K step and the pipeline depth. Measured on an H200 (benchmarks/bench_gemm.py over
# the 1.7B step's eight weight shapes at 2-16 rows): 32 x 128 x 4 stages with split K 4 takes the step's matmuls
# 2.97 ms at 2 rows, against 3.46 for 16 x 256 x 4 unsplit (the first choice, from the shapes alone), 3.40 for
# 32 x 128 x 4 unsplit, 2.86 for the best block per shape, and cuBLAS's 3.62 (docs/benchmarks.md).
# `set_blocks` changes them process-wide (A/B runs).
BLOCK_N = 32
BLOCK_K = 128
NUM_STAGES = 4
# Split K: at most this many programs per column block (1: no split); set by `set_max_split_k`.
MAX_SPLIT_K = 8
_max_split_k = 1
# Counters of the split-K kernel, one int32 per column block, zero between launches: one buffer per device.
_counters: dict[torch.device, Tensor] = {}
COUNTERS = 4096


if HAVE_TRITON:

    @triton.jit
    def _dot_tile(acc, X, W, m, n, kk, k0, K, mmask, nmask, stride_xm, stride_wn, PRECISION: tl.constexpr):
        """acc + x[:, k0:k0+BLOCK_K] @ w[n, k0:k0+BLOCK_K].T, the tails masked."""
        kmask = (k0 + kk) < K
        x = tl.load(X + m[:, None] * stride_xm + (k0 + kk)[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(W + n[:, None] * stride_wn + (k0 + kk)[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        return tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)

    @triton.jit
    def _small_m_kernel(
        X,  # (M, K)
        W,  # (N, K)
        Y,  # (M, N)
        P,  # split K: (SPLIT, M, N) float32 partial sums (else unused)
        C,  # split K: (>= column blocks,) int32 counters, zero on entry and on exit (else unused)
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        SPLIT: tl.constexpr,  # programs per column block (grid axis 1)
        TILES_PER_SPLIT: tl.constexpr,  # split K: K tiles of BLOCK_K per program
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no TF32), else ignored
    ):
        pid = tl.program_id(0)
        m = tl.arange(0, BLOCK_M)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        mmask = m < M
        nmask = n < N
        tile_mask = mmask[:, None] & nmask[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if SPLIT == 1:
            for k0 in range(0, K, BLOCK_K):
                acc = _dot_tile(acc, X, W, m, n, kk, k0, K, mmask, nmask, stride_xm, stride_wn, PRECISION)
            tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=tile_mask)
        else:
            split = tl.program_id(1)
            k_start = split * TILES_PER_SPLIT * BLOCK_K
            for t in range(TILES_PER_SPLIT):
                k0 = k_start + t * BLOCK_K
                acc = _dot_tile(acc, X, W, m, n, kk, k0, K, mmask, nmask, stride_xm, stride_wn, PRECISION)
            tile = m[:, None] * N + n[None, :]
            tl.store(P + split * M * N + tile, acc, mask=tile_mask)
            # Every thread's partials before the one thread's release (a CTA barrier; release is cumulative), then
            # learn whether every other split of this block has released its own.
            tl.debug_barrier()
            done = tl.atomic_add(C + pid, 1, sem="acq_rel")
            if done == SPLIT - 1:
                tl.debug_barrier()  # every thread's loads after the acquire
                total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                for s in tl.static_range(SPLIT):  # split order, whichever program came last
                    total += tl.load(P + s * M * N + tile, mask=tile_mask, other=0.0, cache_modifier=".cg")
                tl.store(Y + m[:, None] * stride_ym + n[None, :], total.to(Y.dtype.element_ty), mask=tile_mask)
                tl.atomic_xchg(C + pid, 0)  # ready for the next launch


if HAVE_TRITON:

    @triton.jit
    def _load_w(W, n, kk, k0, K, nmask, stride_wn):
        kmask = (k0 + kk) < K
        return tl.load(W + n[:, None] * stride_wn + (k0 + kk)[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)

    @triton.jit
    def _load_x(X, LNW, m, kk, k0, K, mmask, stride_xm, ss, NORM: tl.constexpr):
        """(x[:, k0:k0+BLOCK_K] for the dot, ss), the tails masked. NORM: the dot's operand is x times the norm's
        weight, rounded to x's dtype, and ss accumulates the rows' sums of squares (float32) for the 1/rms that
        scales the product afterwards: the norm costs no pass of its own."""
        kmask = (k0 + kk) < K
        x = tl.load(X + m[:, None] * stride_xm + (k0 + kk)[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
            g = tl.load(LNW + k0 + kk, mask=kmask, other=0.0)
            x = (xf * g.to(tl.float32)[None, :]).to(x.dtype)
        return x, ss

    @triton.jit
    def _epilogue(acc, acc_up, r, dtype, SILU: tl.constexpr, RESIDUAL: tl.constexpr):
        """The tile's output in `dtype`: SILU: SiLU(gate) * up, each rounded as the eager ops round; RESIDUAL: plus the
        residual tile r (the product rounded first, as `r + F.linear(x, w)` is)."""
        y = acc.to(dtype)
        if SILU:
            g = y.to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dtype)  # F.silu's x * sigmoid(x), in float32
            y = (s.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
        if RESIDUAL:
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
        return y

    @triton.jit
    def _small_m_fused_kernel(
        X,  # (M, K)
        W,  # (N, K); SILU: (2N, K), the gate's rows then the up projection's
        Y,  # (M, N)
        P,  # split K: (SPLIT, M, N) float32 partial sums (else unused)
        C,  # split K: (>= column blocks,) int32 counters, zero on entry and on exit (else unused)
        LNW,  # NORM: (K,) the RMSNorm's weight (else unused)
        R,  # RESIDUAL: (M, N) added to the product (else unused)
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        stride_rm,
        eps,
        SPLIT: tl.constexpr,  # programs per column block (grid axis 1)
        TILES_PER_SPLIT: tl.constexpr,  # split K: K tiles of BLOCK_K per program
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no TF32), else ignored
        NORM: tl.constexpr,  # x RMS-normalised first (over all K; eps, LNW); unsplit
        SILU: tl.constexpr,  # gate|up weights: write SiLU(x @ gate.T) * (x @ up.T)
        RESIDUAL: tl.constexpr,  # add R to the product
    ):
        pid = tl.program_id(0)
        m = tl.arange(0, BLOCK_M)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        mmask = m < M
        nmask = n < N
        tile_mask = mmask[:, None] & nmask[None, :]
        if SPLIT == 1:
            k_start = 0
            k_end = K
        else:
            k_start = tl.program_id(1) * TILES_PER_SPLIT * BLOCK_K
            k_end = tl.minimum(k_start + TILES_PER_SPLIT * BLOCK_K, K)
        # The weights are never written by the kernel before this one: their first tile is read before the wait.
        w = _load_w(W, n, kk, k_start, K, nmask, stride_wn)
        if SILU:
            wu = _load_w(W + N * stride_wn, n, kk, k_start, K, nmask, stride_wn)
        # The residual tile now, while the weights stream in, not after the last K tile.
        r = tl.zeros((BLOCK_M, BLOCK_N), Y.dtype.element_ty)
        if RESIDUAL:
            r = tl.load(R + m[:, None] * stride_rm + n[None, :], mask=tile_mask, other=0.0)
        ss = tl.zeros((BLOCK_M,), tl.float32)  # NORM: the rows' sums of squares, the same order for every row
        x, ss = _load_x(X, LNW, m, kk, k_start, K, mmask, stride_xm, ss, NORM)
        acc = tl.dot(x, tl.trans(w), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), input_precision=PRECISION)
        acc_up = acc
        if SILU:
            acc_up = tl.dot(x, tl.trans(wu), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), input_precision=PRECISION)
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            x, ss = _load_x(X, LNW, m, kk, k0, K, mmask, stride_xm, ss, NORM)
            acc = tl.dot(x, tl.trans(_load_w(W, n, kk, k0, K, nmask, stride_wn)), acc, input_precision=PRECISION)
            if SILU:
                wu = _load_w(W + N * stride_wn, n, kk, k0, K, nmask, stride_wn)
                acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=PRECISION)
        if NORM:  # rms_norm(x) @ w.T = (x * weight) @ w.T / rms(x), row by row
            inv_rms = tl.math.rsqrt(ss / K + eps)
            acc = acc * inv_rms[:, None]
            acc_up = acc_up * inv_rms[:, None]
        if SPLIT == 1:
            y = _epilogue(acc, acc_up, r, Y.dtype.element_ty, SILU, RESIDUAL)
            tl.store(Y + m[:, None] * stride_ym + n[None, :], y, mask=tile_mask)
        else:
            split = tl.program_id(1)
            tile = m[:, None] * N + n[None, :]
            tl.store(P + split * M * N + tile, acc, mask=tile_mask)
            # Every thread's partials before the one thread's release (a CTA barrier; release is cumulative), then
            # learn whether every other split of this block has released its own.
            tl.debug_barrier()
            done = tl.atomic_add(C + pid, 1, sem="acq_rel")
            if done == SPLIT - 1:
                tl.debug_barrier()  # every thread's loads after the acquire
                total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                for s in tl.static_range(SPLIT):  # split order, whichever program came last
                    total += tl.load(P + s * M * N + tile, mask=tile_mask, other=0.0, cache_modifier=".cg")
                y = _epilogue(total, total, r, Y.dtype.element_ty, False, RESIDUAL)
                tl.store(Y + m[:, None] * stride_ym + n[None, :], y, mask=tile_mask)
                tl.atomic_xchg(C + pid, 0)  # ready for the next launch


def set_blocks(block_n: int, block_k: int, num_stages: int) -> None:
    """The kernel's default block sizes, process-wide (CUDA graphs keep those they were captured with)."""
    global BLOCK_N, BLOCK_K, NUM_STAGES
    if block_n < 16 or block_k < 16 or block_n & (block_n - 1) or block_k & (block_k - 1) or num_stages < 1:
        raise ValueError(f"blocks must be powers of two >= 16 and stages >= 1, not {block_n}x{block_k}x{num_stages}")
    BLOCK_N, BLOCK_K, NUM_STAGES = block_n, block_k, num_stages


def set_max_split_k(splits: int) -> None:
    """At most `splits` programs per column block for weights with fewer column blocks than SMs (1: never split).
    Process-wide; CUDA graphs keep the split they were captured with."""
    global _max_split_k
    if not 1 <= splits <= MAX_SPLIT_K:
        raise ValueError(f"split K must be 1 to {MAX_SPLIT_K}, not {splits}")
    _max_split_k = splits


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # elsewhere (Triton's interpreter): an H200's, so the choice is the GPU's


def _k_step(K: int, block_k: int) -> int:
    """The K tile the kernel runs: block_k, or less for a short K (a power of two, at least tl.dot's 16)."""
    return min(block_k, max(16, 1 << (K - 1).bit_length()))


def split_k_for(N: int, K: int, device: torch.device, block_n: int | None = None, block_k: int | None = None) -> int:
    """Programs per column block for an (N, K) weight: as many as fit on the SMs, at most the set maximum and one
    K tile per program; a function of the shape and the device only, never of the rows (blocks None: the
    defaults)."""
    block_n, block_k = block_n or BLOCK_N, block_k or BLOCK_K
    blocks, tiles = _cdiv(N, block_n), _cdiv(K, _k_step(K, block_k))
    sms = _sm_count(device)
    if _max_split_k == 1 or blocks >= sms:
        return 1
    # Whole multiples of the column blocks that fit on the SMs: on an H200 a 128-block qkv split in two ran 0.9 us
    # slower than unsplit, and a 64-block o split in three 0.3 us slower than in two (bench_gemm.py).
    want = min(_max_split_k, sms // blocks, tiles)
    return _cdiv(tiles, _cdiv(tiles, want))  # no empty split


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prepare(device: torch.device | str, blocks: int = COUNTERS) -> Tensor:
    """The split-K counters for a device (allocated once, zeroed; call before capturing graphs that use them)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    c = _counters.get(device)
    if c is None or c.numel() < blocks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("small_m_gemm.prepare(device) must run before CUDA graph capture")
        c = _counters[device] = torch.zeros(max(blocks, COUNTERS), dtype=torch.int32, device=device)
    return c


def small_m_matmul(
    x: Tensor,
    w: Tensor,
    block_n: int | None = None,
    block_k: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
    norm_weight: Tensor | None = None,
    eps: float = 0.0,
    silu: bool = False,
    residual: Tensor | None = None,
) -> Tensor:
    """x (M <= SMALL_M_MAX, K) @ w (N, K).T -> (M, N) in x's dtype, by the Triton kernel (block sizes for sweeps,
    None: the defaults; split_k None: `split_k_for` the shape).

    With the fusions the kernel computes, in one launch, what the eager ops compute: norm_weight:
    `fused.rms_norm(x, norm_weight, eps)` in place of x, as (x * norm_weight) @ w.T / rms(x) row by row (the sum of
    squares taken from the same loads as the product; one bf16 rounding of the normalised input instead of the eager
    two, so not its bits); silu: w is gate|up (2N, K) and the result SiLU(gate) * up, rounded where the eager ops
    round (N columns; half the column block, so as many programs as without it); residual (M, N): `residual +
    product`, the product rounded first. With norm_weight or silu the kernel runs unsplit over K."""
    block_n, block_k, num_stages = block_n or BLOCK_N, block_k or BLOCK_K, num_stages or NUM_STAGES
    M, K = x.shape
    N = w.shape[0] // 2 if silu else w.shape[0]
    if M > SMALL_M_MAX:
        raise ValueError(f"{M} rows > SMALL_M_MAX ({SMALL_M_MAX})")
    if w.shape[1] != K:
        raise ValueError(f"x has {K} columns, w {w.shape[1]}")
    if x.dtype != w.dtype:
        raise ValueError(f"x is {x.dtype}, w {w.dtype}")
    if silu and w.shape[0] % 2:
        raise ValueError(f"silu needs gate|up weights (an even row count), not {w.shape[0]}")
    if norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"norm_weight must be ({K},), not {tuple(norm_weight.shape)}")
    if residual is not None and residual.shape != (M, N):
        raise ValueError(f"residual must be ({M}, {N}), not {tuple(residual.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    block_k = _k_step(K, block_k)
    if silu:
        block_n = max(16, block_n // 2)  # two weight tiles a program: the same programs, the same bytes each
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    blocks, tiles = _cdiv(N, block_n), _cdiv(K, block_k)
    if silu or norm_weight is not None:  # the epilogue needs every K tile's part: one program per block
        split = 1
        if split_k not in (None, 1):
            raise ValueError("silu and norm_weight run unsplit (split_k 1)")
    else:
        split = split_k_for(N, K, x.device, block_n, block_k) if split_k is None else split_k
    if not 1 <= split <= tiles:
        raise ValueError(f"split_k {split} outside 1..{tiles} (K tiles of {block_k})")
    per_split = _cdiv(tiles, split)
    split = _cdiv(tiles, per_split)  # no empty split
    # Split K: the partial sums and the counters (without it the kernel never touches them: y stands in).
    partial = torch.empty((split, M, N), device=x.device, dtype=torch.float32) if split > 1 else y
    counters = prepare(x.device, blocks) if split > 1 else y
    if norm_weight is not None:
        norm_weight = norm_weight.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    if norm_weight is None and not silu and residual is None:
        _small_m_kernel[(blocks, split)](
            x,
            w,
            y,
            partial,
            counters,
            M,
            N,
            K,
            x.stride(0),
            w.stride(0),
            y.stride(0),
            SPLIT=split,
            TILES_PER_SPLIT=per_split if split > 1 else 0,
            BLOCK_M=SMALL_M_MAX,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            PRECISION=precision,
            num_warps=4,
            num_stages=num_stages,
        )
        return y
    _small_m_fused_kernel[(blocks, split)](
        x,
        w,
        y,
        partial,
        counters,
        norm_weight if norm_weight is not None else y,
        residual if residual is not None else y,
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        residual.stride(0) if residual is not None else 0,
        float(eps),
        SPLIT=split,
        TILES_PER_SPLIT=per_split if split > 1 else 0,
        BLOCK_M=SMALL_M_MAX,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=precision,
        NORM=norm_weight is not None,
        SILU=silu,
        RESIDUAL=residual is not None,
        num_warps=4,
        num_stages=num_stages,
    )
    return y


@torch.library.custom_op("qwen_tts::small_m_linear", mutates_args=())
def linear(x: Tensor, w: Tensor) -> Tensor:
    """F.linear(x, w) for 2-D x: the Triton kernel up to SMALL_M_MAX rows, F.linear beyond."""
    if x.shape[0] > SMALL_M_MAX or not HAVE_TRITON:
        return F.linear(x, w)
    return small_m_matmul(x, w)


@linear.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def _eager_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    from qwen_tts.fused import rms_norm  # here, not at the top: fused imports this module

    return rms_norm(x, weight, eps)


@torch.library.custom_op("qwen_tts::small_m_norm_linear", mutates_args=())
def norm_linear(x: Tensor, norm_weight: Tensor, eps: float, w: Tensor) -> Tensor:
    """F.linear(rms_norm(x, norm_weight, eps), w): one launch up to SMALL_M_MAX rows, the eager ops beyond."""
    if x.shape[0] > SMALL_M_MAX or not HAVE_TRITON:
        return F.linear(_eager_rms_norm(x, norm_weight, eps), w)
    return small_m_matmul(x, w, norm_weight=norm_weight, eps=eps)


@norm_linear.register_fake
def _(x: Tensor, norm_weight: Tensor, eps: float, w: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


@torch.library.custom_op("qwen_tts::small_m_norm_linear_silu", mutates_args=())
def norm_linear_silu(x: Tensor, norm_weight: Tensor, eps: float, w_gate_up: Tensor) -> Tensor:
    """SiLU(gate) * up of F.linear(rms_norm(x, norm_weight, eps), w_gate_up).chunk(2): one launch up to
    SMALL_M_MAX rows, the eager ops beyond."""
    if x.shape[0] > SMALL_M_MAX or not HAVE_TRITON:
        gate, up = F.linear(_eager_rms_norm(x, norm_weight, eps), w_gate_up).chunk(2, dim=-1)
        return F.silu(gate) * up
    return small_m_matmul(x, w_gate_up, norm_weight=norm_weight, eps=eps, silu=True)


@norm_linear_silu.register_fake
def _(x: Tensor, norm_weight: Tensor, eps: float, w_gate_up: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], w_gate_up.shape[0] // 2))


@torch.library.custom_op("qwen_tts::small_m_linear_add", mutates_args=())
def linear_add(x: Tensor, w: Tensor, residual: Tensor) -> Tensor:
    """residual + F.linear(x, w): one launch up to SMALL_M_MAX rows, the eager ops beyond."""
    if x.shape[0] > SMALL_M_MAX or not HAVE_TRITON:
        return residual + F.linear(x, w)
    return small_m_matmul(x, w, residual=residual)


@linear_add.register_fake
def _(x: Tensor, w: Tensor, residual: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))
