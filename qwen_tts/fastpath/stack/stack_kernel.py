"""The code predictor's decoder stack, one token per row, as one Triton kernel per pass.

Our own kernel (no official counterpart). It computes what `layers.DecoderStack.forward` computes for T = 1 and
up to 16 rows: every layer's input RMSNorm, q|k|v, q/k RMSNorm, RoPE, the K/V write, attention over the slot's
positions, o_proj and residual, RMSNorm, gate|up, SiLU * up, down_proj and residual, then the final norm.

On the fused path (fused.py) one code-predictor pass is ~50 launches: four matmuls, an attention kernel and
compiled pointwise kernels per layer, each reading a few MB of weights in a few microseconds, so the launches and
the gaps between them cost more than the bytes (docs/history/benchmarks-diary.md). Here a pass is a sequence of phases, five
per layer and the final norm:
  1. q|k|v = rms_norm(x) @ w_qkv.T, split over K; the last program of each head's column block adds the partial
     sums, applies the head's RMSNorm and RoPE, and writes q to scratch, k and v into the cache;
  2. attention, one unit per (row, kv head), over the positions 0..position of the row's slot;
  3. x = x + attn @ w_o.T, split over K, the last program of each column block adding the partials;
  4. SiLU(gate) * up of rms_norm(x) @ w_gate_up.T;
  5. x = x + act @ w_down.T, split over K;
  and rms_norm(x) with the stack's final norm.
Each phase reads what the one before wrote, from other programs. Two modes:
  - "phases": one launch per phase (26 for a five-layer stack), the launch boundary orders them;
  - "persistent": one launch per pass with at most one program per SM, every program looping over its units of
    each phase and waiting at a grid-wide barrier (an atomic counter) before the next: it counts in at the end of
    a phase and waits at the start of the next, with the `preload` option after loading the phase's first weight
    tile (weights no phase writes), so that load is in flight while the grid catches up. All programs must be
    resident at once, which one program per SM and a grid no larger than the SM count give. Triton's CPU
    interpreter runs programs one after another, so there only "phases" can run.

The arithmetic rounds where the eager layers round (each op's result in the model's dtype), except that matmul
partial sums are float32 and added in split order. A row's result does not depend on the other rows: the split of
every matmul is a function of the shapes and the SM count, every row runs the same tiles and the same K order. The
split-K counters and the barrier live in one buffer per device (`prepare`, before any graph capture), so the kernel
runs on one stream at a time, as the engine's frame steps do.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn

from qwen_tts.fastpath.decode_attention import HAVE_TRITON
from qwen_tts.fastpath.stack import stack_cuda

if HAVE_TRITON:
    import triton
    import triton.language as tl

MODES = ("off", "phases", "persistent", "cuda")  # cuda: the CUDA kernel of stack_cuda.py, same weights
# Rows per pass the kernel takes (one 16-row tile for tl.dot); more go to the fused path's kernels.
MAX_ROWS = 16
# Cache positions attention reads at most (the code predictor's cache holds 16).
MAX_POSITIONS = 64
PHASES_PER_LAYER = 5
BLOCK_N = 32  # output columns per unit of the o, gate|up and down projections (q|k|v: one head)
MAX_BLOCK_K = 128
NUM_STAGES = 3
# One int32 per column block of the widest matmul, then the grid barrier's counter and its exit counter.
COUNTERS = 4096
_counters: dict[torch.device, Tensor] = {}


if HAVE_TRITON:

    @triton.jit
    def _grid_arrive(BAR):
        """Count this program in at the grid-wide barrier (an atomic counter): its phase is done. The CTA barrier
        before the release orders every thread's stores before it."""
        tl.debug_barrier()
        tl.atomic_add(BAR, 1, sem="release", scope="gpu")

    @triton.jit
    def _grid_wait(BAR, target, PERSISTENT: tl.constexpr):
        """Persistent: wait until `target` arrivals at the barrier (0: the launch's first phase, no wait). The CTA
        barrier after the acquire orders every thread's loads after it (the loads of data written in the kernel
        also skip L1: .cg). Loads issued before the wait (the phase's weights, which no phase writes) stay in
        flight while it spins."""
        if PERSISTENT:  # noqa: SIM102 (a compile-time branch around a runtime one)
            if target > 0:
                seen = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
                while seen < target:
                    seen = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
                tl.debug_barrier()

    @triton.jit
    def _w_tile(W, rows, rmask, k_start, K, STEP: tl.constexpr):
        """w[rows, k_start:k_start + STEP] of W (N, K) contiguous, zero outside rmask and K: a unit's first K step."""
        k = k_start + tl.arange(0, STEP)
        return tl.load(W + rows[:, None] * K + k[None, :], mask=rmask[:, None] & (k < K)[None, :], other=0.0)

    @triton.jit
    def _inv_rms(X, m, mmask, eps, H: tl.constexpr, H_P2: tl.constexpr):
        """1 / sqrt(mean(x^2) + eps) of each row of X (BLOCK_M, H), in float32."""
        h = tl.arange(0, H_P2)
        x = tl.load(
            X + m[:, None] * H + h[None, :], mask=mmask[:, None] & (h < H)[None, :], other=0.0, cache_modifier=".cg"
        )
        xf = x.to(tl.float32)
        return tl.math.rsqrt(tl.sum(xf * xf, axis=1) / H + eps)

    @triton.jit
    def _x_tile(X, m, mmask, k, kmask, K, inv, LNW, NORM: tl.constexpr):
        """x[:, k] of X (rows, K), data the kernel wrote (so past L1: .cg); NORM: rms_norm(x) = LNW * (x * inv)
        .to(dtype), rounded as `layers.RMSNorm` rounds."""
        x = tl.load(
            X + m[:, None] * K + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0, cache_modifier=".cg"
        )
        if NORM:
            g = tl.load(LNW + k, mask=kmask, other=0.0).to(tl.float32)
            xn = (x.to(tl.float32) * inv[:, None]).to(x.dtype)
            x = (g[None, :] * xn.to(tl.float32)).to(x.dtype)
        return x

    @triton.jit
    def _matmul(
        acc, w0, X, W, m, mmask, n, nmask, k_start, k_end, K, inv, LNW, NORM: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, PEEL: tl.constexpr,
    ):  # fmt: skip
        """acc + x[:, k_start:k_end] @ w[n, k_start:k_end].T; X (rows, K) and W (N, K) contiguous. PEEL: w0 is the
        first step's weight tile, loaded by the caller (`_w_tile`, before a grid wait), and the other steps are not
        pipelined (the preloaded tile's shared memory and the pipeline's would not fit together); else w0 is unused
        and the loop loads every tile itself. NORM: x is replaced by rms_norm(x) = LNW * (x * inv).to(dtype),
        rounded as `layers.RMSNorm` rounds."""
        kk = tl.arange(0, BLOCK_K)
        if PEEL:
            k = k_start + kk
            x = _x_tile(X, m, mmask, k, k < K, K, inv, LNW, NORM)
            acc = tl.dot(x, tl.trans(w0), acc, input_precision=PRECISION)
            for k0 in tl.range(k_start + BLOCK_K, k_end, BLOCK_K, num_stages=1):
                acc = _step(acc, X, W, m, mmask, n, nmask, k0 + kk, K, inv, LNW, NORM, PRECISION)
        else:
            for k0 in range(k_start, k_end, BLOCK_K):
                acc = _step(acc, X, W, m, mmask, n, nmask, k0 + kk, K, inv, LNW, NORM, PRECISION)
        return acc

    @triton.jit
    def _step(acc, X, W, m, mmask, n, nmask, k, K, inv, LNW, NORM: tl.constexpr, PRECISION: tl.constexpr):
        """One K step of `_matmul`: the x tile and the weight tile at columns k, one dot."""
        kmask = k < K
        x = _x_tile(X, m, mmask, k, kmask, K, inv, LNW, NORM)
        w = tl.load(W + n[:, None] * K + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        return tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)

    @triton.jit
    def _arrive(PART, CNT, acc, tile, tmask, blk, s, part_stride, SPLIT: tl.constexpr):
        """Store this split's partial sums of a column block and count it in; True for the block's last split."""
        tl.store(PART + s * part_stride + tile, acc, mask=tmask)
        tl.debug_barrier()  # every thread's partials before the one thread's release
        done = tl.atomic_add(CNT + blk, 1, sem="acq_rel", scope="gpu")
        return done == SPLIT - 1

    @triton.jit
    def _partials(PART, tile, tmask, part_stride, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
        """The sum of a tile's partials in split order (0, 1, ...), whichever split came last."""
        total = tl.zeros((BLOCK_M, BLOCK), tl.float32)
        for s in tl.static_range(SPLIT):
            total += tl.load(PART + s * part_stride + tile, mask=tmask, other=0.0, cache_modifier=".cg")
        return total

    @triton.jit
    def _residual_phase(
        SRC, W, XIN, XS, PART, CNT, BAR, target, m, mmask, pid, nprog, H: tl.constexpr, K: tl.constexpr,
        SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        STEP_K: tl.constexpr, PRECISION: tl.constexpr, PERSISTENT: tl.constexpr, PRELOAD: tl.constexpr,
        UNIT_STAGES: tl.constexpr,
    ):  # fmt: skip
        """x + src @ w.T into XS (phases 3 and 5): BLOCK_N columns a unit, split over K, the last split adding the
        partials and the residual (the product rounded first, as `x + F.linear(...)` is); unsplit, the unit adds.
        Waits at the grid barrier for `target` first; PRELOAD: after loading its first unit's first weight tile."""
        dt = XS.dtype.element_ty
        per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
        jn = tl.arange(0, BLOCK_N)
        units = tl.cdiv(H, BLOCK_N) * SPLIT
        w_pre = 0
        if PRELOAD:
            n_pre = (pid // SPLIT) * BLOCK_N + jn
            w_pre = _w_tile(W, n_pre, (n_pre < H) & (pid < units), (pid % SPLIT) * per, K, STEP_K)
        _grid_wait(BAR, target, PERSISTENT)
        for u in tl.range(pid, units, nprog, num_stages=UNIT_STAGES):
            blk = u // SPLIT
            s = u % SPLIT
            n = blk * BLOCK_N + jn
            k_start = s * per
            w0 = w_pre
            if PRELOAD:  # noqa: SIM102 (a compile-time branch around a runtime one)
                if u != pid:
                    w0 = _w_tile(W, n, n < H, k_start, K, STEP_K)
            acc = _matmul(
                tl.zeros((BLOCK_M, BLOCK_N), tl.float32), w0, SRC, W, m, mmask, n, n < H, k_start,
                tl.minimum(k_start + per, K), K, m.to(tl.float32), W, False, STEP_K, PRECISION, PRELOAD,
            )  # fmt: skip
            tile = m[:, None] * H + n[None, :]
            tmask = mmask[:, None] & (n < H)[None, :]
            if SPLIT == 1:
                r = tl.load(XIN + tile, mask=tmask, other=0.0, cache_modifier=".cg")
                tl.store(XS + tile, (acc.to(dt).to(tl.float32) + r.to(tl.float32)).to(dt), mask=tmask)
            elif _arrive(PART, CNT, acc, tile, tmask, blk, s, BLOCK_M * H, SPLIT):
                tl.debug_barrier()  # every thread's loads after the acquire
                y = _partials(PART, tile, tmask, BLOCK_M * H, BLOCK_M, BLOCK_N, SPLIT).to(dt)
                r = tl.load(XIN + tile, mask=tmask, other=0.0, cache_modifier=".cg")
                tl.store(XS + tile, (y.to(tl.float32) + r.to(tl.float32)).to(dt), mask=tmask)
                tl.atomic_xchg(CNT + blk, 0)  # ready for the next phase

    @triton.jit
    def _prefetch(W, rows, rmask, k_start, k_end, K, LINE: tl.constexpr):
        """Ask L2 for w[rows, k_start:k_end], one prefetch per LINE elements (a 128-byte line); nothing waits."""
        for k0 in range(k_start, k_end, 8 * LINE):
            k = k0 + tl.arange(0, 8) * LINE
            ok = rmask[:, None] & (k < k_end)[None, :]
            p = tl.where(ok, W + rows[:, None] * K + k[None, :], W)
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1
            )

    @triton.jit
    def _prefetch_units(W, pid, nprog, N: tl.constexpr, K: tl.constexpr, SPLIT: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LINE: tl.constexpr):  # fmt: skip
        """Prefetch the weight slices of this program's units of a matmul phase (the units `_residual_phase` and
        the q|k|v and gate|up phases hand out: BLOCK_N rows, one split's K range)."""
        per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
        for u in range(pid, tl.cdiv(N, BLOCK_N) * SPLIT, nprog):
            rows = (u // SPLIT) * BLOCK_N + tl.arange(0, BLOCK_N)
            k_start = (u % SPLIT) * per
            _prefetch(W, rows, rows < N, k_start, tl.minimum(k_start + per, K), K, LINE)

    @triton.jit
    def _matmul2(
        acc_a, acc_b, wa0, wb0, X, W, m, mmask, rows_a, rows_b, nmask, k_start, k_end, K, inv, LNW,
        NORM: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PEEL: tl.constexpr,
    ):  # fmt: skip
        """`_matmul` for two row sets of one weight sharing the x operand (gate and up); PEEL: with their first
        tiles."""
        kk = tl.arange(0, BLOCK_K)
        if PEEL:
            k = k_start + kk
            x = _x_tile(X, m, mmask, k, k < K, K, inv, LNW, NORM)
            acc_a = tl.dot(x, tl.trans(wa0), acc_a, input_precision=PRECISION)
            acc_b = tl.dot(x, tl.trans(wb0), acc_b, input_precision=PRECISION)
            for k0 in tl.range(k_start + BLOCK_K, k_end, BLOCK_K, num_stages=1):
                acc_a, acc_b = _step2(acc_a, acc_b, X, W, m, mmask, rows_a, rows_b, nmask, k0 + kk, K, inv, LNW, NORM,
                                      PRECISION)  # fmt: skip
        else:
            for k0 in range(k_start, k_end, BLOCK_K):
                acc_a, acc_b = _step2(acc_a, acc_b, X, W, m, mmask, rows_a, rows_b, nmask, k0 + kk, K, inv, LNW, NORM,
                                      PRECISION)  # fmt: skip
        return acc_a, acc_b

    @triton.jit
    def _step2(acc_a, acc_b, X, W, m, mmask, rows_a, rows_b, nmask, k, K, inv, LNW, NORM: tl.constexpr,
               PRECISION: tl.constexpr):  # fmt: skip
        """One K step of `_matmul2`: the x tile at columns k, the two weight tiles, two dots."""
        kmask = k < K
        x = _x_tile(X, m, mmask, k, kmask, K, inv, LNW, NORM)
        wmask = nmask[:, None] & kmask[None, :]
        wa = tl.load(W + rows_a[:, None] * K + k[None, :], mask=wmask, other=0.0)
        wb = tl.load(W + rows_b[:, None] * K + k[None, :], mask=wmask, other=0.0)
        acc_a = tl.dot(x, tl.trans(wa), acc_a, input_precision=PRECISION)
        acc_b = tl.dot(x, tl.trans(wb), acc_b, input_precision=PRECISION)
        return acc_a, acc_b

    @triton.jit
    def _stack_kernel(
        X_IN,  # (M, H) the pass input (read only)
        XS,  # (M, H) the residual stream, then the output (the final norm in place)
        POS,  # (M,) int64 each row's position
        SLOT,  # (M,) int64 each row's cache slot
        KC,  # (L, slots, NKV, T, D) the key cache, written at (layer, slot, head, position)
        VC,
        LN1,  # (L, H) input RMSNorm weights
        WQKV,  # (L, (NQ + 2 NKV) D, H)
        QKN,  # (L, 2, D) q and k RMSNorm weights
        WO,  # (L, H, NQ D)
        LN2,  # (L, H)
        WGU,  # (L, 2 I, H) gate rows then up rows
        WD,  # (L, H, I)
        NORM_W,  # (H,) the final RMSNorm's weight
        INV_FREQ,  # (D / 2,) float32 RoPE frequencies
        QBUF,  # (M, NQ D) scratch: q after its norm and RoPE
        ABUF,  # (M, NQ D) scratch: attention output
        GBUF,  # (M, I) scratch: SiLU(gate) * up
        PART,  # float32 scratch: split-K partial sums, (SPLIT, BLOCK_M, N) for the phase's N
        CNT,  # int32 (COUNTERS + ...): column-block counters, the barrier, its exit counter; zero between launches
        M,
        ph_start,
        ph_end,
        eps,
        scale,
        stride_cl,
        stride_cs,
        stride_ch,
        stride_ct,
        H: tl.constexpr,
        H_P2: tl.constexpr,
        I: tl.constexpr,  # noqa: E741 (the intermediate size, as H is the hidden)
        D: tl.constexpr,
        NQ: tl.constexpr,
        NKV: tl.constexpr,
        G_P2: tl.constexpr,
        T: tl.constexpr,
        T_P2: tl.constexpr,
        L: tl.constexpr,
        SPLIT_QKV: tl.constexpr,
        SPLIT_O: tl.constexpr,
        SPLIT_GU: tl.constexpr,
        SPLIT_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        PERSISTENT: tl.constexpr,
        RES_BLOCK_N: tl.constexpr,  # output columns per unit of the o and down projections
        PREFETCH: tl.constexpr,  # each phase first asks L2 for this program's weights of the next matmul phase
        PRELOAD: tl.constexpr,  # each matmul phase loads its first weight tile before the grid wait
        UNIT_STAGES: tl.constexpr,  # the software pipeline's stages over a matmul phase's units (a program's loop)
        LINE: tl.constexpr,  # weight elements per 128-byte line
        STEP_QKV: tl.constexpr,  # the K step of each matmul's loop (a multiple of BLOCK_K's split ranges divides)
        STEP_O: tl.constexpr,
        STEP_GU: tl.constexpr,
        STEP_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        dt = XS.dtype.element_ty
        m = tl.arange(0, BLOCK_M)
        mmask = m < M
        c = tl.arange(0, D)
        HALF: tl.constexpr = D // 2
        G: tl.constexpr = NQ // NKV
        NQKV: tl.constexpr = NQ + 2 * NKV
        QD: tl.constexpr = NQ * D
        BAR = CNT + 4096
        for ph in range(ph_start, ph_end):
            layer = ph // 5
            kind = ph % 5
            target = (ph - ph_start) * nprog  # every program's arrivals from the launch's phases before this one
            xin = XS  # the residual stream; the pass input until layer 0's o projection has added to it
            if ph < 3:
                xin = X_IN
            # The next matmul's weights stream into L2 while this phase and the barrier run.
            if PREFETCH:  # noqa: SIM102 (a compile-time branch around runtime ones)
                if ph < 5 * L:
                    if kind == 0:
                        _prefetch_units(WO + layer * (H * QD), pid, nprog, H, QD, SPLIT_O, RES_BLOCK_N, BLOCK_K, LINE)
                    elif kind == 2:
                        wgu = WGU + layer * (2 * I * H)
                        _prefetch_units(wgu, pid, nprog, I, H, SPLIT_GU, BLOCK_N, BLOCK_K, LINE)
                        _prefetch_units(wgu + I * H, pid, nprog, I, H, SPLIT_GU, BLOCK_N, BLOCK_K, LINE)
                    elif kind == 3:
                        _prefetch_units(WD + layer * (H * I), pid, nprog, H, I, SPLIT_D, RES_BLOCK_N, BLOCK_K, LINE)
                    elif kind == 4:  # noqa: SIM102
                        if layer + 1 < L:
                            _prefetch_units(WQKV + (layer + 1) * (NQKV * D * H), pid, nprog, NQKV * D, H, SPLIT_QKV,
                                            D, BLOCK_K, LINE)  # fmt: skip
            if ph == 5 * L:
                # The final RMSNorm, in place (one program: 16 rows of H).
                _grid_wait(BAR, target, PERSISTENT)
                if pid == 0:
                    inv = _inv_rms(XS, m, mmask, eps, H, H_P2)
                    kk = tl.arange(0, BLOCK_K)
                    for k0 in range(0, H, BLOCK_K):
                        k = k0 + kk
                        tmask = mmask[:, None] & (k < H)[None, :]
                        x = tl.load(XS + m[:, None] * H + k[None, :], mask=tmask, other=0.0, cache_modifier=".cg")
                        xn = (x.to(tl.float32) * inv[:, None]).to(dt)
                        g = tl.load(NORM_W + k, mask=k < H, other=0.0).to(tl.float32)
                        tl.store(XS + m[:, None] * H + k[None, :], (g[None, :] * xn.to(tl.float32)).to(dt), mask=tmask)
            elif kind == 0:
                # q|k|v, one head's D columns per block, split over K; the block's last split finishes the head.
                per = tl.cdiv(tl.cdiv(H, BLOCK_K), SPLIT_QKV) * BLOCK_K
                wqkv = WQKV + layer * (NQKV * D * H)
                w_pre = 0
                if PRELOAD:
                    n_pre = (pid // SPLIT_QKV) * D + c
                    w_pre = _w_tile(wqkv, n_pre, (n_pre < NQKV * D) & (pid < NQKV * SPLIT_QKV), (pid % SPLIT_QKV) * per,
                                    H, STEP_QKV)  # fmt: skip
                _grid_wait(BAR, target, PERSISTENT)
                inv = _inv_rms(xin, m, mmask, eps, H, H_P2)
                for u in tl.range(pid, NQKV * SPLIT_QKV, nprog, num_stages=UNIT_STAGES):
                    blk = u // SPLIT_QKV
                    s = u % SPLIT_QKV
                    n = blk * D + c
                    k_start = s * per
                    w0 = w_pre
                    if PRELOAD:  # noqa: SIM102
                        if u != pid:
                            w0 = _w_tile(wqkv, n, n < NQKV * D, k_start, H, STEP_QKV)
                    acc = _matmul(
                        tl.zeros((BLOCK_M, D), tl.float32), w0, xin, wqkv, m, mmask, n,
                        n < NQKV * D, k_start, tl.minimum(k_start + per, H), H, inv, LN1 + layer * H, True, STEP_QKV,
                        PRECISION, PRELOAD,
                    )  # fmt: skip
                    tile = m[:, None] * (NQKV * D) + n[None, :]
                    tmask = mmask[:, None] & (c < D)[None, :]
                    pstride = BLOCK_M * NQKV * D
                    if _arrive(PART, CNT, acc, tile, tmask, blk, s, pstride, SPLIT_QKV):
                        tl.debug_barrier()  # every thread's loads after the acquire
                        y = _partials(PART, tile, tmask, pstride, BLOCK_M, D, SPLIT_QKV).to(dt)
                        pos = tl.load(POS + m, mask=mmask, other=0)
                        slot = tl.load(SLOT + m, mask=mmask, other=0)
                        head = blk - NQ
                        if blk < NQ + NKV:
                            # The head's RMSNorm and RoPE: x * cos + rotate_half(x) * sin, each op rounded. The
                            # partner columns (c + D/2 mod D) come from the same partials.
                            partner = (c + HALF) % D
                            tile_p = m[:, None] * (NQKV * D) + (blk * D + partner)[None, :]
                            yp = _partials(PART, tile_p, tmask, pstride, BLOCK_M, D, SPLIT_QKV).to(dt)
                            nbase = QKN + layer * 2 * D + (blk >= NQ).to(tl.int32) * D
                            nw = tl.load(nbase + c).to(tl.float32)
                            nwp = tl.load(nbase + partner).to(tl.float32)
                            yf = y.to(tl.float32)
                            inv_h = tl.math.rsqrt(tl.sum(yf * yf, axis=1) / D + eps)
                            yn = (nw[None, :] * (yf * inv_h[:, None]).to(dt).to(tl.float32)).to(dt)
                            ypf = yp.to(tl.float32)
                            ypn = (nwp[None, :] * (ypf * inv_h[:, None]).to(dt).to(tl.float32)).to(dt)
                            rot = tl.where((c < HALF)[None, :], -ypn.to(tl.float32), ypn.to(tl.float32))
                            freq = pos.to(tl.float32)[:, None] * tl.load(INV_FREQ + c % HALF)[None, :]
                            cos = tl.cos(freq).to(dt).to(tl.float32)
                            sin = tl.sin(freq).to(dt).to(tl.float32)
                            a = (yn.to(tl.float32) * cos).to(dt).to(tl.float32)
                            b = (rot * sin).to(dt).to(tl.float32)
                            out = (a + b).to(dt)
                            if blk < NQ:
                                tl.store(QBUF + m[:, None] * QD + (blk * D + c)[None, :], out, mask=tmask)
                            else:
                                at = layer * stride_cl + slot * stride_cs + head * stride_ch + pos * stride_ct
                                tl.store(KC + at[:, None] + c[None, :], out, mask=tmask)
                        else:
                            at = layer * stride_cl + slot * stride_cs + (head - NKV) * stride_ch + pos * stride_ct
                            tl.store(VC + at[:, None] + c[None, :], y, mask=tmask)
                        tl.atomic_xchg(CNT + blk, 0)  # ready for the next phase
            elif kind == 1:
                # Attention: the G query heads of one kv head for one row, over positions 0..position.
                _grid_wait(BAR, target, PERSISTENT)
                g = tl.arange(0, G_P2)
                gmask = g < G
                t = tl.arange(0, T_P2)
                for u in range(pid, M * NKV, nprog):
                    b = u // NKV
                    h = u % NKV
                    pos = tl.load(POS + b)
                    slot = tl.load(SLOT + b)
                    heads = h * G + g
                    q = tl.load(
                        QBUF + b * QD + heads[:, None] * D + c[None, :], mask=gmask[:, None], other=0.0,
                        cache_modifier=".cg",
                    ).to(tl.float32)  # fmt: skip
                    tmask = (t <= pos) & (t < T)
                    at = layer * stride_cl + slot * stride_cs + h * stride_ch + t[:, None] * stride_ct + c[None, :]
                    k = tl.load(KC + at, mask=tmask[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
                    v = tl.load(VC + at, mask=tmask[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
                    sc = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (G, T)
                    sc = tl.where(tmask[None, :], sc, float("-inf"))
                    p = tl.exp(sc - tl.max(sc, axis=1)[:, None])
                    p = p / tl.sum(p, axis=1)[:, None]
                    o = tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # (G, D)
                    tl.store(ABUF + b * QD + heads[:, None] * D + c[None, :], o.to(dt), mask=gmask[:, None])
            elif kind == 3:
                # SiLU(gate) * up of rms_norm(x) @ w_gate_up.T: a unit's tile is BLOCK_N gate rows and their up rows.
                per = tl.cdiv(tl.cdiv(H, BLOCK_K), SPLIT_GU) * BLOCK_K
                j = tl.arange(0, 2 * BLOCK_N)
                jn = tl.arange(0, BLOCK_N)
                wgu = WGU + layer * (2 * I * H)
                gu_units = tl.cdiv(I, BLOCK_N) * SPLIT_GU
                # The first unit's first K step (SPLIT_GU 1: its gate and up tiles; else both in one tile).
                w_pre = 0
                wa_pre = 0
                wb_pre = 0
                if PRELOAD:
                    ok_pre = pid < gu_units
                    if SPLIT_GU == 1:
                        n_pre = pid * BLOCK_N + jn
                        wa_pre = _w_tile(wgu, n_pre, (n_pre < I) & ok_pre, 0, H, STEP_GU)
                        wb_pre = _w_tile(wgu, I + n_pre, (n_pre < I) & ok_pre, 0, H, STEP_GU)
                    else:
                        col_pre = (pid // SPLIT_GU) * BLOCK_N + j % BLOCK_N
                        rows_pre = tl.where(j < BLOCK_N, col_pre, I + col_pre)
                        w_pre = _w_tile(wgu, rows_pre, (col_pre < I) & ok_pre, (pid % SPLIT_GU) * per, H, STEP_GU)
                _grid_wait(BAR, target, PERSISTENT)
                inv = _inv_rms(xin, m, mmask, eps, H, H_P2)
                for u in tl.range(pid, gu_units, nprog, num_stages=UNIT_STAGES):
                    blk = u // SPLIT_GU
                    s = u % SPLIT_GU
                    if SPLIT_GU == 1:  # the unit has every K tile: SiLU * up straight from its accumulators
                        n = blk * BLOCK_N + jn
                        nmask = mmask[:, None] & (n < I)[None, :]
                        zero = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                        wa0 = wa_pre
                        wb0 = wb_pre
                        if PRELOAD:  # noqa: SIM102
                            if u != pid:
                                wa0 = _w_tile(wgu, n, n < I, 0, H, STEP_GU)
                                wb0 = _w_tile(wgu, I + n, n < I, 0, H, STEP_GU)
                        acc_g, acc_u = _matmul2(
                            zero, zero, wa0, wb0, xin, wgu, m, mmask, n, I + n, n < I, 0, H, H, inv,
                            LN2 + layer * H, True, STEP_GU, PRECISION, PRELOAD,
                        )  # fmt: skip
                        gate = acc_g.to(dt).to(tl.float32)
                        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
                        tl.store(GBUF + m[:, None] * I + n[None, :], (act * acc_u.to(dt).to(tl.float32)).to(dt),
                                 mask=nmask)  # fmt: skip
                    else:
                        col = blk * BLOCK_N + j % BLOCK_N
                        rows = tl.where(j < BLOCK_N, col, I + col)
                        k_start = s * per
                        w0 = w_pre
                        if PRELOAD:  # noqa: SIM102
                            if u != pid:
                                w0 = _w_tile(wgu, rows, col < I, k_start, H, STEP_GU)
                        acc = _matmul(
                            tl.zeros((BLOCK_M, 2 * BLOCK_N), tl.float32), w0, xin, wgu, m, mmask, rows,
                            col < I, k_start, tl.minimum(k_start + per, H), H, inv, LN2 + layer * H, True, STEP_GU,
                            PRECISION, PRELOAD,
                        )  # fmt: skip
                        tile = m[:, None] * (2 * I) + rows[None, :]
                        pstride = BLOCK_M * 2 * I
                        if _arrive(
                            PART, CNT, acc, tile, mmask[:, None] & (col < I)[None, :], blk, s, pstride, SPLIT_GU
                        ):
                            tl.debug_barrier()
                            n = blk * BLOCK_N + jn
                            nmask = mmask[:, None] & (n < I)[None, :]
                            gate = _partials(PART, m[:, None] * (2 * I) + n[None, :], nmask, pstride, BLOCK_M, BLOCK_N,
                                             SPLIT_GU).to(dt).to(tl.float32)  # fmt: skip
                            up = _partials(PART, m[:, None] * (2 * I) + (I + n)[None, :], nmask, pstride, BLOCK_M, BLOCK_N,
                                           SPLIT_GU).to(dt).to(tl.float32)  # fmt: skip
                            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # F.silu, in float32
                            tl.store(GBUF + m[:, None] * I + n[None, :], (act * up).to(dt), mask=nmask)
                            tl.atomic_xchg(CNT + blk, 0)
            elif kind == 2:
                _residual_phase(ABUF, WO + layer * (H * QD), xin, XS, PART, CNT, BAR, target, m, mmask, pid, nprog, H,
                                QD, SPLIT_O, BLOCK_M, RES_BLOCK_N, BLOCK_K, STEP_O, PRECISION, PERSISTENT,
                                PRELOAD, UNIT_STAGES)  # fmt: skip
            else:
                _residual_phase(GBUF, WD + layer * (H * I), xin, XS, PART, CNT, BAR, target, m, mmask, pid, nprog, H,
                                I, SPLIT_D, BLOCK_M, RES_BLOCK_N, BLOCK_K, STEP_D, PRECISION, PERSISTENT,
                                PRELOAD, UNIT_STAGES)  # fmt: skip
            if PERSISTENT:  # noqa: SIM102
                if ph + 1 < ph_end:
                    _grid_arrive(BAR)
        if PERSISTENT:  # noqa: SIM102
            # The last program out resets the barrier for the next launch (every program has passed it).
            if tl.atomic_add(BAR + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
                tl.atomic_xchg(BAR, 0)
                tl.atomic_xchg(BAR + 1, 0)


# The kernel's choices, process-wide (`set_options`; CUDA graphs keep those they were captured with). K steps up to
# 512 on eight warps: on an H200 at the 1.7B's code predictor dims a persistent pass took 171.5-184.5 us at 1-16 rows
# against 194.8-246.3 with steps of 128 on four warps (benchmarks/kernels/bench_stack.py, docs/history/benchmarks-diary.md).
_options = {
    "prefetch": False,
    "preload": False,
    "residual_split": 4,
    "residual_block_n": BLOCK_N,
    "max_step_k": 512,
    "num_warps": 8,
}


def set_options(prefetch: bool | None = None, preload: bool | None = None, residual_split: int | None = None,
                residual_block_n: int | None = None, max_step_k: int | None = None,
                num_warps: int | None = None) -> dict:  # fmt: skip
    """prefetch: each phase asks L2 for the next matmul's weights first (on CUDA; the interpreter has no inline
    assembly); preload: each matmul phase loads its first unit's first weight tile into registers before it waits
    at the grid barrier, so the load is in flight while the grid catches up (in the phases mode, nothing waits);
    residual_split: at most this many splits over K for the o and down projections (1: each unit has every K tile
    and adds the residual itself); residual_block_n: their output columns per unit (16-128, a power of two);
    max_step_k: the largest K step of a matmul loop (128-1024, a power of two; each unit's K range in as few
    steps, so as few dependent loads, as divide it); num_warps: 4 or 8. Returns the options now in force."""
    if residual_split is not None and not 1 <= residual_split <= 4:
        raise ValueError(f"residual_split must be 1 to 4, not {residual_split}")
    if residual_block_n is not None and (residual_block_n not in (16, 32, 64, 128)):
        raise ValueError(f"residual_block_n must be 16, 32, 64 or 128, not {residual_block_n}")
    if max_step_k is not None and max_step_k not in (128, 256, 512, 1024):
        raise ValueError(f"max_step_k must be 128, 256, 512 or 1024, not {max_step_k}")
    if num_warps is not None and num_warps not in (4, 8):
        raise ValueError(f"num_warps must be 4 or 8, not {num_warps}")
    given = dict(prefetch=prefetch, preload=preload, residual_split=residual_split, residual_block_n=residual_block_n,
                 max_step_k=max_step_k, num_warps=num_warps)  # fmt: skip
    for k, v in given.items():
        if v is not None:
            _options[k] = v
    return dict(_options)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _p2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # elsewhere (Triton's interpreter): an H200's, so the splits are the GPU's


def prepare(device: torch.device | str) -> Tensor:
    """The kernel's counters for a device (allocated once, zeroed; call before capturing graphs that use them)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    c = _counters.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("stack_kernel.prepare(device) must run before CUDA graph capture")
        c = _counters[device] = torch.zeros(COUNTERS + stack_cuda.BARRIER_INTS, dtype=torch.int32, device=device)
    return c


class StackWeights:
    """A decoder stack's weights re-laid as one (layers, ...) tensor each; the layers' parameters become views of
    them (the same storage and state dict)."""

    def __init__(self, stack: nn.Module) -> None:
        layers = stack.layers
        if any(layer.fused is None for layer in layers):
            raise ValueError("stack_kernel needs fused.enable() on the stack first (its q|k|v and gate|up weights)")
        a0 = layers[0].self_attn
        cfg = stack.cfg
        self.L, self.H, self.I, self.D = len(layers), cfg.hidden_size, cfg.intermediate_size, a0.head_dim
        self.NQ, self.NKV = layers[0].fused.n_q, layers[0].fused.n_kv
        self.eps = layers[0].input_layernorm.eps
        if self.D & (self.D - 1) or self.D < 16:
            raise ValueError(f"head_dim must be a power of two >= 16, not {self.D}")
        if self.NQ % self.NKV:
            raise ValueError(f"{self.NQ} query heads do not group over {self.NKV} kv heads")
        with torch.no_grad():
            self.w_qkv = _relay([lay.fused.w_qkv for lay in layers])
            self.w_gate_up = _relay([lay.fused.w_gate_up for lay in layers])
            for i, lay in enumerate(layers):
                a, mlp = lay.self_attn, lay.mlp
                lay.fused.w_qkv, lay.fused.w_gate_up = self.w_qkv[i], self.w_gate_up[i]
                _point(self.w_qkv[i], [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
                _point(self.w_gate_up[i], [mlp.gate_proj.weight, mlp.up_proj.weight])
            self.w_o = _relay([lay.self_attn.o_proj.weight for lay in layers], params=True)
            self.w_down = _relay([lay.mlp.down_proj.weight for lay in layers], params=True)
            self.ln1 = _relay([lay.input_layernorm.weight for lay in layers], params=True)
            self.ln2 = _relay([lay.post_attention_layernorm.weight for lay in layers], params=True)
            qk = _relay([torch.stack((lay.self_attn.q_norm.weight, lay.self_attn.k_norm.weight)) for lay in layers])
            for i, lay in enumerate(layers):
                lay.self_attn.q_norm.weight.data, lay.self_attn.k_norm.weight.data = qk[i][0], qk[i][1]
            self.qk_norm = qk
        self.norm = stack.norm.weight
        self.rotary = stack.rotary_emb  # its inv_freq (float32, remade when the module moves)

    def splits(self, device: torch.device) -> tuple[int, int, int, int]:
        """Programs per column block of the q|k|v, o, gate|up and down matmuls: as many as fit on the SMs, at most
        four (o and down: at most the residual_split option), at least one K tile each. A function of the shapes,
        the options and the device only (never of the rows)."""
        sms = _sm_count(device)
        bk = self.block_k

        def split(blocks: int, K: int, cap: int = 4) -> int:
            tiles = _cdiv(K, bk)
            want = max(1, min(cap, sms // blocks, tiles))
            return _cdiv(tiles, _cdiv(tiles, want))  # no empty split

        nqkv = self.NQ + 2 * self.NKV
        res_n, res_split = _options["residual_block_n"], _options["residual_split"]
        return (
            split(nqkv, self.H),
            split(_cdiv(self.H, res_n), self.NQ * self.D, res_split),
            split(_cdiv(self.I, BLOCK_N), self.H),
            split(_cdiv(self.H, res_n), self.I, res_split),
        )

    def steps(self, device: torch.device) -> tuple[int, int, int, int]:
        """The K step of each matmul's loop (q|k|v, o, gate|up, down): the largest power of two up to max_step_k
        that divides a unit's K range (whole BLOCK_K tiles), so a unit loads its slice in as few steps as fit."""
        bk, cap = self.block_k, max(self.block_k, _options["max_step_k"])
        out = []
        for K, split in zip((self.H, self.NQ * self.D, self.H, self.I), self.splits(device), strict=True):
            span = _cdiv(_cdiv(K, bk), split) * bk
            step = bk
            while step * 2 <= cap and span % (step * 2) == 0:
                step *= 2
            out.append(step)
        return tuple(out)

    @property
    def block_k(self) -> int:
        return min(MAX_BLOCK_K, max(16, _p2(min(self.H, self.I, self.NQ * self.D))))


def _relay(tensors: list[Tensor], params: bool = False) -> Tensor:
    """One (len, ...) tensor holding `tensors`; params: each (a parameter) becomes a view of its row."""
    big = torch.stack([t.data for t in tensors])
    if params:
        for i, t in enumerate(tensors):
            t.data = big[i]
    return big


def _point(fused: Tensor, params: list[Tensor]) -> None:
    """Make each parameter a view of its rows of `fused` (as fused._fuse_linear_weights does)."""
    start = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[start : start + n]
        start += n


def enable(stack: nn.Module, mode: str) -> None:
    """Run the stack's one-token passes of up to MAX_ROWS rows through this kernel ("phases" or "persistent"), or
    those of up to stack_cuda.MAX_ROWS bf16 rows through the CUDA kernel ("cuda"), or not ("off"). The stack must be
    on the fused path (fused.enable) already."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if mode != "off" and stack.stack_weights is None:
        stack.stack_weights = StackWeights(stack)
    stack.stack_kernel = None if mode == "off" else mode


def runs(stack: nn.Module, x: Tensor, cache) -> bool:
    """Whether `stack_pass` takes this pass (the kernel is on, the rows and the cache within its limits)."""
    if stack.stack_kernel == "cuda":
        return stack_cuda.runs(stack.stack_weights, x, cache)
    return (
        stack.stack_kernel is not None
        and x.shape[0] <= MAX_ROWS
        and cache.max_len <= MAX_POSITIONS
        and x.dtype == cache.k.dtype
    )


def stack_pass(
    stack: nn.Module, x: Tensor, positions: Tensor, cache, slots: Tensor, mode: str | None = None,
    phase_range: tuple[int, int] | None = None,
) -> Tensor:  # fmt: skip
    """One token per row through the whole stack and its final norm: x (M, H) -> (M, H); each row's K/V written
    into its slot at its position (rows may share a slot at different positions). mode None: the stack's.
    phase_range (start, end): run only those phases (profiling, benchmarks/kernels/bench_stack.py; the output is then
    partial)."""
    sw: StackWeights = stack.stack_weights
    mode = mode or stack.stack_kernel
    if mode == "cuda":  # its phases are this kernel's: five a layer, then the final norm; a range starts at 0
        if phase_range is not None and phase_range[0] != 0:
            raise ValueError(f"the cuda mode runs phases from 0, not {phase_range}")
        stop = None if phase_range is None else phase_range[1]
        return stack_cuda.stack_pass(sw, x, positions, cache, slots, prepare(x.device)[COUNTERS:], stop=stop)
    M, H = x.shape
    if M > MAX_ROWS:
        raise ValueError(f"{M} rows > MAX_ROWS ({MAX_ROWS})")
    if H != sw.H:
        raise ValueError(f"x has {H} columns, the stack {sw.H}")
    kc, vc = cache.k, cache.v
    if kc.stride() != vc.stride() or kc.stride(-1) != 1:
        raise ValueError("the K and V caches must share strides, the head dim contiguous")
    dev = x.device
    interpreted = dev.type != "cuda"
    if mode == "persistent" and interpreted:
        raise ValueError("the persistent mode needs a GPU (the interpreter runs one program at a time)")
    x = x.contiguous()
    out = torch.empty_like(x)
    qd = sw.NQ * sw.D
    qbuf = torch.empty((M, qd), device=dev, dtype=x.dtype)
    abuf = torch.empty((M, qd), device=dev, dtype=x.dtype)
    gbuf = torch.empty((M, sw.I), device=dev, dtype=x.dtype)
    s_qkv, s_o, s_gu, s_d = sw.splits(dev)
    nqkv = sw.NQ + 2 * sw.NKV
    part = torch.empty(
        MAX_ROWS * max(s_qkv * nqkv * sw.D, s_o * H, s_gu * 2 * sw.I, s_d * H), device=dev, dtype=torch.float32
    )
    counters = prepare(dev)
    units = [
        nqkv * s_qkv,
        M * sw.NKV,
        _cdiv(H, _options["residual_block_n"]) * s_o,
        _cdiv(sw.I, BLOCK_N) * s_gu,
        _cdiv(H, _options["residual_block_n"]) * s_d,
    ]
    T = kc.shape[3]
    args = (
        x, out, positions.contiguous(), slots.contiguous(), kc, vc, sw.ln1, sw.w_qkv, sw.qk_norm, sw.w_o, sw.ln2,
        sw.w_gate_up, sw.w_down, sw.norm, sw.rotary.inv_freq, qbuf, abuf, gbuf, part, counters, M,
    )  # fmt: skip
    meta = dict(
        H=H, H_P2=_p2(H), I=sw.I, D=sw.D, NQ=sw.NQ, NKV=sw.NKV, G_P2=_p2(sw.NQ // sw.NKV), T=T, T_P2=_p2(T),
        L=sw.L, SPLIT_QKV=s_qkv, SPLIT_O=s_o, SPLIT_GU=s_gu, SPLIT_D=s_d, BLOCK_M=MAX_ROWS, BLOCK_N=BLOCK_N,
        BLOCK_K=sw.block_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=_options["num_warps"],
        num_stages=NUM_STAGES, RES_BLOCK_N=_options["residual_block_n"],
        PREFETCH=bool(_options["prefetch"]) and not interpreted, PRELOAD=bool(_options["preload"]),
        UNIT_STAGES=1 if _options["preload"] else NUM_STAGES,
        LINE=128 // x.element_size(),
        **dict(zip(("STEP_QKV", "STEP_O", "STEP_GU", "STEP_D"), sw.steps(dev), strict=True)),
    )  # fmt: skip
    tail = (sw.eps, 1.0 / math.sqrt(sw.D), *kc.stride()[:4])
    phases = PHASES_PER_LAYER * sw.L + 1
    first, end = phase_range or (0, phases)
    if mode == "persistent":
        grid = min(_sm_count(dev), max(units))
        _stack_kernel[(grid,)](*args, first, end, *tail, PERSISTENT=True, **meta)
    else:
        for ph in range(first, end):
            grid = 1 if ph == phases - 1 else units[ph % PHASES_PER_LAYER]
            _stack_kernel[(grid,)](*args, ph, ph + 1, *tail, PERSISTENT=False, **meta)
    return out
