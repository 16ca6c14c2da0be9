"""A matmul for the few-row case of the one-token decoder step (Triton), as a torch custom op.

Our own kernel (no official counterpart). At one to a few streams the fused step multiplies 2-16 rows by each
weight matrix. cuBLAS runs those GEMMs on 64x8 tiles, which for a 2048-wide output is 32 thread blocks on an
H200's 132 SMs, and reads the weights at ~1.6 TB/s, a third of the bandwidth (docs/history/benchmarks-diary.md). Here one program
owns BLOCK_N output columns for every row (the rows padded to 16 for `tl.dot`) and streams its slice of the weight
over K in BLOCK_K steps; narrow column blocks give more programs than SMs for every weight of the step.

A row's result does not depend on how many rows came with it: every row sees the same K order and the same tiles,
so a row gets the same bits alone as in a batch of up to SMALL_M_MAX rows. Larger batches go to `F.linear` (whose
reduction order differs), so the switch at SMALL_M_MAX is a boundary of batch invariance (the CUDA batch-invariance
test crosses it). On by default (`FastPath.small_m_gemm`), as measured on an H200 (docs/history/benchmarks-diary.md).

`linear(x, w)` is `F.linear(x, w)` for 2-D x: under torch.compile it is one opaque call (a custom op with a fake
implementation), so the compiled blocks keep their fusions around it and the step still captures into a graph.

Split K (`max_split_k`, an argument of `linear`; the engine passes FastPath.small_m_split_k, 4 by default;
docs/performance.md). A weight whose output gives fewer column blocks than the GPU has SMs (the code predictor's 1024-wide o and
down projections: 32 programs on 132 SMs) leaves SMs idle and too few loads in flight. With split K, S programs
share a column block, each over its own run of K tiles; each writes its float32 partial sums and bumps the block's counter, and the program that bumps it last adds
the S partials in split order (0, 1, ..., S-1), writes the output and resets the counter. One launch, no atomics
on the data, and the sum's order is fixed whichever program finishes last: the result is deterministic, and a
row's bits still do not depend on the other rows (S is chosen from N, K and the SM count only). The counters live
in one buffer per device (`prepare`, before any graph capture), so the kernel runs on one stream at a time, as the
engine's frame steps and prefill do.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from qwen_tts.fastpath.decode_attention import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

# Rows up to which `linear` runs the Triton kernel (one 16-row tile); more go to F.linear.
SMALL_M_MAX = 16
# Output columns per program, the K step and the pipeline depth (benchmarks/kernels/bench_gemm.py; docs/performance.md);
# small_m_matmul takes others for sweeps.
BLOCK_N = 32
BLOCK_K = 128
NUM_STAGES = 4
# Split K: at most this many programs per column block (`linear`'s max_split_k; 1: no split).
MAX_SPLIT_K = 8
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


def split_k_error(splits: object) -> str | None:
    """Why `splits` cannot be the split-K maximum, or None."""
    if isinstance(splits, int) and 1 <= splits <= MAX_SPLIT_K:
        return None
    return f"split K must be 1 to {MAX_SPLIT_K}, not {splits}"


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # elsewhere (Triton's interpreter): an H200's, so the choice is the GPU's


def _k_step(K: int, block_k: int) -> int:
    """The K tile the kernel runs: block_k, or less for a short K (a power of two, at least tl.dot's 16)."""
    return min(block_k, max(16, 1 << (K - 1).bit_length()))


def split_k_for(
    N: int, K: int, device: torch.device, block_n: int | None = None, block_k: int | None = None, max_split_k: int = 1
) -> int:
    """Programs per column block for an (N, K) weight: as many as fit on the SMs, at most `max_split_k` and one
    K tile per program; a function of the shape and the device only, never of the rows (blocks None: the
    defaults)."""
    if err := split_k_error(max_split_k):
        raise ValueError(err)
    block_n, block_k = block_n or BLOCK_N, block_k or BLOCK_K
    blocks, tiles = _cdiv(N, block_n), _cdiv(K, _k_step(K, block_k))
    sms = _sm_count(device)
    if max_split_k == 1 or blocks >= sms:
        return 1
    # Whole multiples of the column blocks that fit on the SMs: on an H200 a 128-block qkv split in two ran 0.9 us
    # slower than unsplit, and a 64-block o split in three 0.3 us slower than in two (bench_gemm.py).
    want = min(max_split_k, sms // blocks, tiles)
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
    max_split_k: int = 1,
) -> Tensor:
    """x (M <= SMALL_M_MAX, K) @ w (N, K).T -> (M, N) in x's dtype, by the Triton kernel (block sizes for sweeps,
    None: the defaults; split_k None: `split_k_for` the shape, at most max_split_k)."""
    block_n, block_k, num_stages = block_n or BLOCK_N, block_k or BLOCK_K, num_stages or NUM_STAGES
    M, K = x.shape
    N = w.shape[0]
    if M > SMALL_M_MAX:
        raise ValueError(f"{M} rows > SMALL_M_MAX ({SMALL_M_MAX})")
    if w.shape[1] != K:
        raise ValueError(f"x has {K} columns, w {w.shape[1]}")
    if x.dtype != w.dtype:
        raise ValueError(f"x is {x.dtype}, w {w.dtype}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    block_k = _k_step(K, block_k)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    blocks, tiles = _cdiv(N, block_n), _cdiv(K, block_k)
    split = split_k_for(N, K, x.device, block_n, block_k, max_split_k) if split_k is None else split_k
    if not 1 <= split <= tiles:
        raise ValueError(f"split_k {split} outside 1..{tiles} (K tiles of {block_k})")
    per_split = _cdiv(tiles, split)
    split = _cdiv(tiles, per_split)  # no empty split
    # Split K: the partial sums and the counters (without it the kernel never touches them: y stands in).
    partial = torch.empty((split, M, N), device=x.device, dtype=torch.float32) if split > 1 else y
    counters = prepare(x.device, blocks) if split > 1 else y
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


@torch.library.custom_op("qwen_tts::small_m_linear", mutates_args=())
def linear(x: Tensor, w: Tensor, max_split_k: int = 1) -> Tensor:
    """F.linear(x, w) for 2-D x: the Triton kernel up to SMALL_M_MAX rows (K split over at most max_split_k
    programs a column block), F.linear beyond."""
    if x.shape[0] > SMALL_M_MAX or not HAVE_TRITON:
        return F.linear(x, w)
    return small_m_matmul(x, w, max_split_k=max_split_k)


@linear.register_fake
def _(x: Tensor, w: Tensor, max_split_k: int = 1) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))
