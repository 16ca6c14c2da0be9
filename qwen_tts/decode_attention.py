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


def decode_attention(
    q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor, slots: Tensor, positions: Tensor
) -> Tensor:
    """q (B, Hq, D), k/v (B, Hkv, D) -> (B, Hq, D); writes k/v into cache_k/cache_v (S, Hkv, L, D) at
    [slots, :, positions] and attends over each slot's positions 0..position."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    for name, t in (("q", q), ("k", k), ("v", v), ("cache_k", cache_k), ("cache_v", cache_v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if cache_k.stride() != cache_v.stride():
        raise ValueError("cache_k and cache_v must share one layout")
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
        slots.stride(0),
        positions.stride(0),  # may be 0: the code predictor's positions are one row expanded over the batch
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cache_k.stride(0),
        cache_k.stride(1),
        cache_k.stride(2),
        out.stride(0),
        out.stride(1),
        D**-0.5,
        GROUP=group,
        BLOCK_G=max(1, triton.next_power_of_2(group)),
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
