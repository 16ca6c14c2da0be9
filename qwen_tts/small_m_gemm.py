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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from qwen_tts.decode_attention import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

# Rows up to which `linear` runs the Triton kernel (one 16-row tile); more go to F.linear.
SMALL_M_MAX = 16
# Output columns per program and the K step: 2048 columns give 128 programs, and 16 x 256 bf16 weights (8 KB) per
# step keep loads wide. Chosen from the shapes, not yet tuned on the GPU (benchmarks/bench_gemm.py sweeps them).
BLOCK_N = 16
BLOCK_K = 256
NUM_STAGES = 4


if HAVE_TRITON:

    @triton.jit
    def _small_m_kernel(
        X,  # (M, K)
        W,  # (N, K)
        Y,  # (M, N)
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
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
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + kk) < K
            x = tl.load(
                X + m[:, None] * stride_xm + (k0 + kk)[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0
            )
            w = tl.load(
                W + n[:, None] * stride_wn + (k0 + kk)[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0
            )
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        tl.store(
            Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :]
        )


def small_m_matmul(
    x: Tensor, w: Tensor, block_n: int = BLOCK_N, block_k: int = BLOCK_K, num_stages: int = NUM_STAGES
) -> Tensor:
    """x (M <= SMALL_M_MAX, K) @ w (N, K).T -> (M, N) in x's dtype, by the Triton kernel (block sizes for sweeps)."""
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
    _small_m_kernel[(triton.cdiv(N, block_n),)](
        x,
        w,
        y,
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        BLOCK_M=SMALL_M_MAX,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, max(16, triton.next_power_of_2(K))),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
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
