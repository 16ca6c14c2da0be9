"""`sampling.sample` as one Triton kernel, without a sort (the frame step's sampler on the fast path).

Our own kernel (no official counterpart). The compiled `sample` sorts every row of logits (top-k reads the k-th
largest off the sort, top-p sums the sorted probabilities) and scatters the top-p mask back: on an H200 the frame
step's 16 sorts took 0.34 ms of a 5.6 ms step at one stream, besides the kernels around them. Here one program
holds one row in registers and finds what the sort was for by bisection over the row's values:

- top-k: the k-th largest logit is the largest value v with at least k logits >= v. Floats are mapped to int32
  keys in the same order (the sign-magnitude trick), and 32 bisection rounds over the key's bits, each one count
  over the row, find it exactly: the same threshold as the sort's `desc[k - 1]`, so the same ids survive (ties
  kept) and the draw is the same as `sampling.sample`'s.
- top-p (only in rows with top_p < 1; the Qwen3-TTS default is 1): HF drops the ids whose ascending cumulative
  probability is <= 1 - top_p. That mass only grows with the logit, so the dropped ids are those at or below the
  largest value whose mass (the probability of every id <= it) is <= 1 - top_p, again found by 32 rounds, of
  sums. The largest logit is always kept. Same set as the sort's unless logits tie at the cut (HF then drops some
  of the tied ids by sort position, this all or none) or the two sums' rounding straddles 1 - top_p.
- the Gumbel noise is `sampling.uniform_noise`'s counter-based hash in uint32 arithmetic, bit for bit, and the
  draw is argmax(filtered + noise); greedy rows take the argmax of the unwarped logits, in a branch of their own
  that skips the 32-64 bisection rounds and the noise (the launches' `greedy_branch`).

A row's draw reads only its own logits and settings: batch invariant by construction, with no two-copy trick for
a lone row (`fused.compiled`), and one launch that captures into the step's CUDA graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qwen_tts.fastpath.decode_attention import HAVE_TRITON
from qwen_tts.fastpath.options import warp_elements_error
from qwen_tts.model import sampling

if HAVE_TRITON:
    import triton
    import triton.language as tl

    # The hash's constants, as constexprs for the kernel.
    _M1 = tl.constexpr(sampling._M1)
    _M2 = tl.constexpr(sampling._M2)
    _M3 = tl.constexpr(sampling._M3)
    _SALT = tl.constexpr(sampling._SALT)
    _UNIT_MAX = tl.constexpr(sampling.UNIT_MAX)

    @triton.jit
    def _mix32(x):
        """sampling._mix32 on uint32 values (products wrap mod 2**32, as the int64 version masks them)."""
        x = x ^ (x >> 16)
        x = x * _M1
        x = x ^ (x >> 15)
        x = x * _M2
        x = x ^ (x >> 16)
        x = x * _M3
        return x ^ (x >> 15)

    @triton.jit
    def _order_key(x):
        """float32 -> int32 in the same order (-0.0 just below +0.0); an involution on the bits."""
        bits = x.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _noise(idx, b, Seeds, Counters, counter_offset):
        """sampling.uniform_noise's Gumbel noise: the row's key from (counter, seed), then one hash per vocab index."""
        seed = tl.load(Seeds + b)
        counter = tl.load(Counters + b) + counter_offset
        h = _mix32(((counter >> 32) & 0xFFFFFFFF).to(tl.uint32))
        h = _mix32((counter & 0xFFFFFFFF).to(tl.uint32) ^ h)
        h = _mix32(h ^ (seed & 0xFFFFFFFF).to(tl.uint32))
        h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        hv = _mix32(_mix32(idx.to(tl.uint32) ^ h) ^ _mix32(h ^ _SALT))
        u = (((hv >> 8) & 0xFFFFFF).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        u = tl.minimum(u, _UNIT_MAX)
        return -tl.log(-tl.log(u))

    @triton.jit
    def _filtered_draw(y, noise, valid, top_k, top_p, V):
        """argmax(y + noise) over the ids top-k and top-p keep (top_k <= 0: no top-k; top_p >= 1: no top-p)."""
        neg_inf = float("-inf")
        key = _order_key(y)

        # top-k: the largest key with at least k keys >= it. Bit 31 first (is the k-th largest >= +0.0?), then
        # bits 30..0 added to the lower bound; every candidate fits in int32.
        k = tl.minimum(tl.maximum(top_k, 1), V).to(tl.int32)
        lo = tl.full((), -2147483648, tl.int32)
        n = tl.sum((valid & (key >= 0)).to(tl.int32), axis=0)
        lo = tl.where(n >= k, 0, lo)
        for i in tl.static_range(31):
            cand = lo + (1 << (30 - i))
            n = tl.sum((valid & (key >= cand)).to(tl.int32), axis=0)
            lo = tl.where(n >= k, cand, lo)
        kth = _order_key(lo).to(tl.float32, bitcast=True)
        y = tl.where((top_k > 0) & (y < kth), neg_inf, y)

        if top_p < 1.0:
            key = _order_key(y)
            m = tl.max(y, axis=0)
            p = tl.exp(y - m)
            p = p / tl.sum(p, axis=0)
            cut = 1.0 - top_p
            # The largest key whose mass (every id at or below it) is <= cut, bit 31 first as for top-k. Key
            # -2**31 (a NaN's) holds no mass, so the bound starts true.
            lo = tl.full((), -2147483648, tl.int32)
            mass = tl.sum(tl.where(valid & (key <= 0), p, 0.0), axis=0)
            lo = tl.where(mass <= cut, 0, lo)
            for i in tl.static_range(31):
                cand = lo + (1 << (30 - i))
                mass = tl.sum(tl.where(valid & (key <= cand), p, 0.0), axis=0)
                lo = tl.where(mass <= cut, cand, lo)
            y = tl.where((key <= lo) & (y < m), neg_inf, y)

        scores = tl.where(y > neg_inf, y + noise, neg_inf)
        return tl.argmax(scores, axis=0)

    @triton.jit
    def _draw(y, idx, valid, b, TopK, TopP, Seeds, Counters, counter_offset, V):
        """The sampled id of one row: y (the logits over the temperature) through top-k, top-p and the noise."""
        noise = _noise(idx, b, Seeds, Counters, counter_offset)
        top_k = tl.load(TopK + b)
        top_p = tl.load(TopP + b).to(tl.float32)
        return _filtered_draw(y, noise, valid, top_k, top_p, V)

    @triton.jit
    def _pick(Logits, Temperature, TopK, TopP, Greedy, Seeds, Counters, b, stride_row, counter_offset, V,
              BLOCK: tl.constexpr, GREEDY_BRANCH: tl.constexpr):  # fmt: skip
        """Row b's id (int64): the greedy argmax, or the draw through the row's filters and noise."""
        idx = tl.arange(0, BLOCK)
        valid = idx < V
        x = tl.load(Logits + b * stride_row + idx, mask=valid, other=float("-inf")).to(tl.float32)
        temperature = tl.load(Temperature + b).to(tl.float32)
        greedy = (tl.load(Greedy + b) != 0) | (temperature <= 0)
        if GREEDY_BRANCH:
            if greedy:
                out = tl.argmax(x, axis=0).to(tl.int64)
            else:
                y = tl.math.div_rn(x, temperature)  # IEEE division, as torch's `logits / temperature`
                out = _draw(y, idx, valid, b, TopK, TopP, Seeds, Counters, counter_offset, V).to(tl.int64)
        else:
            y = tl.math.div_rn(x, tl.where(greedy, 1.0, temperature))
            drawn = _draw(y, idx, valid, b, TopK, TopP, Seeds, Counters, counter_offset, V)
            out = tl.where(greedy, tl.argmax(x, axis=0), drawn).to(tl.int64)
        return out

    @triton.jit
    def _sample_kernel(
        Logits,  # (B, V), float32 / bfloat16 / float16
        Temperature,  # (B,) float32
        TopK,  # (B,) int64
        TopP,  # (B,) float32
        Greedy,  # (B,) bool
        Seeds,  # (B,) int64
        Counters,  # (B,) int64
        Out,  # (B,) int64
        stride_row,
        counter_offset,
        V,
        BLOCK: tl.constexpr,
        GREEDY_BRANCH: tl.constexpr,  # a greedy row skips the filters and the noise (else computes and drops them)
    ):
        b = tl.program_id(0)
        out = _pick(Logits, Temperature, TopK, TopP, Greedy, Seeds, Counters, b, stride_row, counter_offset, V,
                    BLOCK, GREEDY_BRANCH)  # fmt: skip
        tl.store(Out + b, out)

    @triton.jit
    def _sample_feed_kernel(
        Logits, Temperature, TopK, TopP, Greedy, Seeds, Counters,  # as _sample_kernel's
        Codes,  # (B,) int64 view (any row stride): the drawn ids
        Emb,  # (V, HS) the codebook's embedding table
        Sum,  # (B, HS) float32, in place: += the drawn id's embedding row
        Table,  # (V, HN): the next pass's input rows (the embedding table itself, or its projection)
        Next,  # (B, HN): the next pass's input, written when FEED
        stride_row, stride_codes, stride_emb, stride_sum, stride_table, stride_next, counter_offset, V, HS, HN,
        BLOCK: tl.constexpr, GREEDY_BRANCH: tl.constexpr, BLOCK_H: tl.constexpr,
        FEED: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        out = _pick(Logits, Temperature, TopK, TopP, Greedy, Seeds, Counters, b, stride_row, counter_offset, V,
                    BLOCK, GREEDY_BRANCH)  # fmt: skip
        tl.store(Codes + b * stride_codes, out)
        cols = tl.arange(0, BLOCK_H)
        for h0 in range(0, HS, BLOCK_H):
            m = h0 + cols < HS
            e = tl.load(Emb + out * stride_emb + h0 + cols, mask=m).to(tl.float32)
            acc = tl.load(Sum + b * stride_sum + h0 + cols, mask=m)
            tl.store(Sum + b * stride_sum + h0 + cols, acc + e, mask=m)
        if FEED:
            for h0 in range(0, HN, BLOCK_H):
                m = h0 + cols < HN
                row = tl.load(Table + out * stride_table + h0 + cols, mask=m)
                tl.store(Next + b * stride_next + h0 + cols, row, mask=m)


# Row elements per warp: a program gets max(1, BLOCK // this) warps (512: the code predictor's 2048-wide row on 4
# warps, the talker's 3072 padded to 4096 on 8; bench_sampler.py, docs/performance.md). A launch's `warp_elements`
# argument (FastPath.kernel_sampler_warp_elements), read when the launch is made (so when a graph is captured).
WARP_ELEMENTS = 512


def num_warps(vocab: int, warp_elements: int = WARP_ELEMENTS) -> int:
    """The warps a row of `vocab` logits gets (at most 16)."""
    if err := warp_elements_error(warp_elements):
        raise ValueError(f"warp elements {err}")
    return min(16, max(1, triton.next_power_of_2(vocab) // warp_elements))


def _row_draw(
    logits: Tensor, settings: tuple[Tensor, ...], warp_elements: int, greedy_branch: bool
) -> tuple[Tensor, tuple, dict]:
    """What both launches take for a row's draw: the logits (rows contiguous), the settings as the kernels read
    them (temperature, top_k, top_p, greedy, seeds, counters; the floats as float32) and the launch's constants.
    greedy_branch: greedy rows branch around the filters and the noise (one argmax; the same ids either way)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temperature, top_k, top_p, greedy, seeds, counters = settings
    V = logits.shape[1]
    meta = dict(BLOCK=triton.next_power_of_2(V), GREEDY_BRANCH=greedy_branch, num_warps=num_warps(V, warp_elements))
    return logits, (temperature.float(), top_k, top_p.float(), greedy, seeds, counters), meta


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    greedy: Tensor,
    seeds: Tensor,
    counters: Tensor,
    counter_offset: int = 0,
    warp_elements: int = WARP_ELEMENTS,
    greedy_branch: bool = True,
) -> Tensor:
    """`sampling.sample(logits, ..., counters + counter_offset)` in one launch: one id per row (B,) int64.

    logits (B, V) in any float dtype (read as float32, as `sample` casts them); the settings are (B,) tensors."""
    B, V = logits.shape
    logits, settings, meta = _row_draw(
        logits, (temperature, top_k, top_p, greedy, seeds, counters), warp_elements, greedy_branch
    )
    out = torch.empty(B, dtype=torch.long, device=logits.device)
    if B == 0:
        return out
    _sample_kernel[(B,)](logits, *settings, out, logits.stride(0), counter_offset, V, **meta)
    return out


def sample_feed(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    greedy: Tensor,
    seeds: Tensor,
    counters: Tensor,
    counter_offset: int,
    codes: Tensor,
    emb: Tensor,
    codec_sum: Tensor,
    table: Tensor | None = None,
    nxt: Tensor | None = None,
    warp_elements: int = WARP_ELEMENTS,
    greedy_branch: bool = True,
) -> None:
    """`sample`'s draw, and what the code predictor does with it, in the same launch:

    - codes (B,) int64 (a column of the codes, any row stride) = the drawn ids;
    - codec_sum (B, HS) float32 += emb[ids] (float32 additions, as `codec_sum + emb[ids]`);
    - nxt (B, HN) = table[ids] (the next pass's input; with table None, nothing).

    One kernel where the pass ran four (the draw, the embedding's gather, the add, the next input's gather)."""
    B, V = logits.shape
    logits, settings, meta = _row_draw(
        logits, (temperature, top_k, top_p, greedy, seeds, counters), warp_elements, greedy_branch
    )
    if codes.shape != (B,) or codes.dtype != torch.long:
        raise ValueError(f"codes must be ({B},) int64, not {tuple(codes.shape)} {codes.dtype}")
    HS = emb.shape[1]
    if emb.shape[0] != V or emb.stride(-1) != 1:
        raise ValueError(f"emb must be ({V}, H) with contiguous rows, not {tuple(emb.shape)}")
    if codec_sum.shape != (B, HS) or codec_sum.dtype != torch.float32 or codec_sum.stride(-1) != 1:
        raise ValueError(f"codec_sum must be ({B}, {HS}) float32 with contiguous rows")
    feed = table is not None
    if feed != (nxt is not None):
        raise ValueError("table and nxt come together")
    HN = table.shape[1] if feed else 0
    if feed and (table.shape[0] != V or table.stride(-1) != 1 or nxt.shape != (B, HN) or nxt.stride(-1) != 1):
        raise ValueError(f"table must be ({V}, H) and nxt ({B}, H), rows contiguous")
    if B == 0:
        return
    t, n = (table, nxt) if feed else (emb, codec_sum)  # unread without FEED
    _sample_feed_kernel[(B,)](
        logits,
        *settings,
        codes,
        emb,
        codec_sum,
        t,
        n,
        logits.stride(0),
        codes.stride(0),
        emb.stride(0),
        codec_sum.stride(0),
        t.stride(0),
        n.stride(0),
        counter_offset,
        V,
        HS,
        HN,
        BLOCK_H=1024,
        FEED=feed,
        **meta,
    )
