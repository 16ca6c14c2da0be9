"""One-token GQA attention that reads a slot-indexed static KV cache in place (Triton), with the K/V write fused.

Our own kernel (no official counterpart). It computes what `layers.Attention` computes for T = 1: write the new
key and value at each row's position in its slot, then softmax(q . k / sqrt(D)) . v over that slot's positions
0..position. The eager path gathers `cache[slots, :, :kv_len]` into a new tensor first (a copy of every row's
keys and values each layer and step); here each program reads its row's keys straight from the cache, so the
step needs no kv-length bucket and moves only the bytes attention must read.

Grid: one program per (row, kv head); the program holds the GROUP query heads that share the kv head, streams
the keys and values in blocks of BLOCK_T positions with an online softmax, and accumulates in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the eager path serves
    triton = None

HAVE_TRITON = triton is not None


if HAVE_TRITON:

    @triton.jit
    def _decode_attention_kernel(
        Q,  # (B, Hq, D)
        KNew,  # (B, Hkv, D)
        VNew,
        CacheK,  # (S, Hkv, L, D)
        CacheV,
        Slots,  # (B,) int64
        Positions,  # (B,) int64
        Out,  # (B, Hq, D)
        stride_slot,
        stride_pos,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_vb,
        stride_vh,
        stride_cs,
        stride_ch,
        stride_ct,
        stride_ob,
        stride_oh,
        scale,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        b = tl.program_id(0)
        hkv = tl.program_id(1)
        slot = tl.load(Slots + b * stride_slot)
        pos = tl.load(Positions + b * stride_pos)
        d = tl.arange(0, D)
        # The new key/value first, so the loop below reads position `pos` back like any other.
        kn = tl.load(KNew + b * stride_kb + hkv * stride_kh + d)
        vn = tl.load(VNew + b * stride_vb + hkv * stride_vh + d)
        base = slot * stride_cs + hkv * stride_ch
        tl.store(CacheK + base + pos * stride_ct + d, kn)
        tl.store(CacheV + base + pos * stride_ct + d, vn)
        tl.debug_barrier()  # the stores are visible to every thread of the program before the reads

        g = tl.arange(0, BLOCK_G)
        gmask = g < GROUP
        heads = hkv * GROUP + g
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        q = q.to(tl.float32) * scale  # (G, D)
        m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        denom = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, D), tl.float32)
        for start in range(0, pos + 1, BLOCK_T):
            t = start + tl.arange(0, BLOCK_T)
            tmask = t <= pos
            offs = base + t[:, None] * stride_ct + d[None, :]
            k = tl.load(CacheK + offs, mask=tmask[:, None], other=0.0).to(tl.float32)  # (T, D)
            v = tl.load(CacheV + offs, mask=tmask[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (G, T)
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / denom[:, None]
        tl.store(
            Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=gmask[:, None],
        )


if HAVE_TRITON:

    @triton.jit
    def _split_attention_kernel(
        Q,  # (B, Hq, D)
        KNew,  # (B, Hkv, D)
        VNew,
        CacheK,  # (S, Hkv, L, D)
        CacheV,
        Slots,  # (B,) int64
        Positions,  # (B,) int64
        Out,  # (B, Hq, D): written when there is one partition
        PartAcc,  # (B, Hq, NP, D) float32: each partition's unnormalised output
        PartMax,  # (B, Hq, NP) float32: its running max
        PartSum,  # (B, Hq, NP) float32: its softmax denominator
        stride_slot,
        stride_pos,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_vb,
        stride_vh,
        stride_cs,
        stride_ch,
        stride_ct,
        stride_ob,
        stride_oh,
        scale,
        NP: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_T: tl.constexpr,
        PRECISION: tl.constexpr,  # "ieee" for float32 inputs, else "tf32" (what P.V runs in)
    ):
        b = tl.program_id(0)
        hkv = tl.program_id(1)
        part = tl.program_id(2)
        slot = tl.load(Slots + b * stride_slot)
        pos = tl.load(Positions + b * stride_pos)
        # The row's positions 0..pos in NP partitions of whole blocks: its own position decides the split.
        part_len = tl.cdiv(tl.cdiv(pos + 1, NP), BLOCK_T) * BLOCK_T
        start = part * part_len
        if start <= pos:  # partitions past the row's position have nothing to read
            d = tl.arange(0, D)
            base = slot * stride_cs + hkv * stride_ch
            if part == pos // part_len:  # the partition that reads position `pos` writes it first
                kn = tl.load(KNew + b * stride_kb + hkv * stride_kh + d)
                vn = tl.load(VNew + b * stride_vb + hkv * stride_vh + d)
                tl.store(CacheK + base + pos * stride_ct + d, kn)
                tl.store(CacheV + base + pos * stride_ct + d, vn)
                tl.debug_barrier()
            g = tl.arange(0, BLOCK_G)
            gmask = g < GROUP
            heads = hkv * GROUP + g
            q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
            m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
            denom = tl.zeros((BLOCK_G,), tl.float32)
            acc = tl.zeros((BLOCK_G, D), tl.float32)
            end = tl.minimum(start + part_len, pos + 1)
            for t0 in range(start, end, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                tmask = t < end
                offs = base + t[:, None] * stride_ct + d[None, :]
                k = tl.load(CacheK + offs, mask=tmask[:, None], other=0.0)  # (T, D)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # bf16 operands: a bf16 product
                s = tl.where(tmask[None, :], s * scale, float("-inf"))  # (G, T) float32
                m_new = tl.maximum(m, tl.max(s, axis=1))
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new[:, None])
                denom = denom * alpha + tl.sum(p, axis=1)
                v = tl.load(CacheV + offs, mask=tmask[:, None], other=0.0)
                # P stays float32 (TF32 on the tensor cores, not bf16 as flash attention has it); a bf16 V
                # widens to TF32 exactly.
                pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
                acc = acc * alpha[:, None] + pv
                m = m_new
            if NP == 1:
                out = acc / denom[:, None]
                tl.store(
                    Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                    out.to(Out.dtype.element_ty),
                    mask=gmask[:, None],
                )
            else:
                row = (b * (GROUP * tl.num_programs(1)) + heads) * NP + part  # (G,) index into (B, Hq, NP)
                tl.store(PartAcc + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])
                tl.store(PartMax + row, m, mask=gmask)
                tl.store(PartSum + row, denom, mask=gmask)

    @triton.jit
    def _combine_partitions_kernel(
        Positions,
        PartAcc,
        PartMax,
        PartSum,
        Out,
        stride_pos,
        stride_ob,
        stride_oh,
        NP: tl.constexpr,
        D: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(Positions + b * stride_pos)
        part_len = tl.cdiv(tl.cdiv(pos + 1, NP), BLOCK_T) * BLOCK_T
        p = tl.arange(0, NP)
        pmask = p * part_len <= pos  # the partitions the first kernel wrote
        row = (b * tl.num_programs(1) + h) * NP + p
        m = tl.load(PartMax + row, mask=pmask, other=float("-inf"))
        denom = tl.load(PartSum + row, mask=pmask, other=0.0)
        d = tl.arange(0, D)
        acc = tl.load(PartAcc + row[:, None] * D + d[None, :], mask=pmask[:, None], other=0.0)
        w = tl.where(pmask, tl.exp(m - tl.max(m, axis=0)), 0.0)
        out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * denom, axis=0)
        tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty))


# Programs per (row, kv head) in the split kernel, each over a whole number of SPLIT_BLOCK-position blocks: at 300
# positions 10 of them read 32 positions each, where the one-program kernel reads all 300 in one program. A fixed
# count keeps the grid (and so one CUDA graph) independent of the positions; a cache of at most one block (the code
# predictor's 16 positions) is one partition and needs no combine pass.
SPLIT_PARTS = 16
SPLIT_BLOCK = 32


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache_k: Tensor,
    cache_v: Tensor,
    slots: Tensor,
    positions: Tensor,
    split: bool = False,
) -> Tensor:
    """q (B, Hq, D), k/v (B, Hkv, D) -> (B, Hq, D); writes k/v into cache_k/cache_v (S, Hkv, L, D) at
    [slots, :, positions] and attends over each slot's positions 0..position.

    split: run `split_decode_attention` instead (the same function, split over positions)."""
    if split:
        return split_decode_attention(q, k, v, cache_k, cache_v, slots, positions)
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    _check_layout(q, k, v, cache_k, cache_v)
    out = torch.empty_like(q)
    # Enough positions per block to keep loads wide, few enough that (G, T, D) float32 stays in registers; a cache
    # of at most 16 positions (the code predictor's) in one block of 16.
    block_t = 16 if group > 2 or cache_k.shape[2] <= 16 else 32
    _decode_attention_kernel[(B, Hkv)](
        q,
        k,
        v,
        cache_k,
        cache_v,
        slots,
        positions,
        out,
        *_strides(q, k, v, cache_k, slots, positions, out),
        D**-0.5,
        GROUP=group,
        BLOCK_G=max(1, triton.next_power_of_2(group)),
        D=D,
        BLOCK_T=block_t,
        num_warps=4,
    )
    return out


def _strides(q: Tensor, k: Tensor, v: Tensor, cache: Tensor, slots: Tensor, positions: Tensor, out: Tensor) -> tuple:
    """The stride arguments both kernels take, in their order (slot, position, q, k, v, cache, out)."""
    return (
        slots.stride(0),
        positions.stride(0),  # may be 0: the code predictor's positions are one row expanded over the batch
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        out.stride(0),
        out.stride(1),
    )


def _check_layout(q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("cache_k", cache_k), ("cache_v", cache_v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if cache_k.stride() != cache_v.stride():
        raise ValueError("cache_k and cache_v must share one layout")


def split_decode_attention(
    q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor, slots: Tensor, positions: Tensor
) -> Tensor:
    """`decode_attention`'s function, split over positions (flash decoding), with tensor-core dot products.

    One program per (row, kv head, partition): a row's positions 0..position split into SPLIT_PARTS partitions of
    whole SPLIT_BLOCK-position blocks; the program holds the GROUP query heads, padded to 16 rows for `tl.dot`,
    against its partition's keys and values. A second kernel combines each (row, query head)'s partitions in a
    fixed order. The grid depends on the cache's length alone, so one CUDA graph serves every step; a row's split
    and arithmetic depend on its own position alone, not on the batch (batch invariance). A cache of one block
    (the code predictor's) is one partition, normalised in the first kernel, with no second. Float32 inputs take IEEE float32 dot products (no
    TF32); with bf16 inputs q.k is a bf16 product and P.V a TF32 one (P rounded to 10 bits, not bf16's 7)."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    _check_layout(q, k, v, cache_k, cache_v)
    if D < 16:
        raise ValueError(f"head_dim {D} < 16: tl.dot needs 16")
    L = cache_k.shape[2]
    block_t = min(SPLIT_BLOCK, max(16, triton.next_power_of_2(L)))
    n_parts = min(SPLIT_PARTS, triton.next_power_of_2(triton.cdiv(L, block_t)))
    out = torch.empty_like(q)
    if n_parts > 1:
        part_acc = torch.empty((B, Hq, n_parts, D), device=q.device, dtype=torch.float32)
        part_max = torch.empty((B, Hq, n_parts), device=q.device, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    else:  # unused: the first kernel writes `out`
        part_acc = part_max = part_sum = out
    _split_attention_kernel[(B, Hkv, n_parts)](
        q,
        k,
        v,
        cache_k,
        cache_v,
        slots,
        positions,
        out,
        part_acc,
        part_max,
        part_sum,
        *_strides(q, k, v, cache_k, slots, positions, out),
        D**-0.5,
        NP=n_parts,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        D=D,
        BLOCK_T=block_t,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    if n_parts > 1:
        _combine_partitions_kernel[(B, Hq)](
            positions,
            part_acc,
            part_max,
            part_sum,
            out,
            positions.stride(0),
            out.stride(0),
            out.stride(1),
            NP=n_parts,
            D=D,
            BLOCK_T=block_t,
            num_warps=4,
        )
    return out


def reference_decode_attention(
    q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor, slots: Tensor, positions: Tensor
) -> Tensor:
    """The same computation in plain torch (the eager path's gather + SDPA), for tests."""
    cache_k[slots, :, positions] = k
    cache_v[slots, :, positions] = v
    L = int(positions.max()) + 1
    keys = cache_k[slots, :, :L]
    values = cache_v[slots, :, :L]
    mask = (torch.arange(L, device=q.device) <= positions[:, None])[:, None, None]  # (B, 1, 1, L)
    out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, enable_gqa=True)
    return out[:, :, 0]
