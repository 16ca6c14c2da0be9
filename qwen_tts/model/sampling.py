"""Batched, batch-invariant token sampling with per-row settings.

Reimplements the HF transformers 4.57.3 logits pipeline that qwen-tts 0.1.1 MQ `generate` configures for the talker
(`RepetitionPenaltyLogitsProcessor`, `SuppressTokensLogitsProcessor`, `MinNewTokensLengthLogitsProcessor`, then when
sampling `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`) and for the code predictor (warpers only).
As in HF, logits are processed in float32, processors apply in greedy mode too, and warpers only when sampling.

Randomness is counter-based: a vectorised integer hash of (seed, counter, vocab index) gives each logit its own
uniform, turned into Gumbel noise; the sample is argmax(filtered logits + noise), distributed as softmax(filtered).
A row's draw depends only on its logits, seed and counter (never on other rows or on a torch.Generator), there is
no host sync, and everything is fixed-shape, so it captures into CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import BoolTensor, LongTensor, Tensor

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31 keep every product of a 32-bit value below 2**63, so int64 never overflows.
_M1 = 0x7FEB352D
_M2 = 0x2C1B3C6D
_M3 = 0x297A2D39
_SALT = 0x61C88647


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit avalanche hash on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _M3) & _MASK32
    return x ^ (x >> 15)


def uniform_noise(seeds: LongTensor, counters: LongTensor, vocab: int) -> Tensor:
    """Uniforms in (0, 1), float32 (B, vocab), a pure function of (seed, counter, vocab index)."""
    seeds = seeds.long()[:, None]
    counters = counters.long()[:, None]
    key = _mix32((counters & _MASK32) ^ _mix32((counters >> 32) & _MASK32))  # (B, 1)
    key = _mix32(key ^ (seeds & _MASK32))
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    # The vocab index is only XOR-ed with the key: torch.compile does index arithmetic in int32.
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None]
    h = _mix32(_mix32(idx ^ key) ^ _mix32(key ^ _SALT))
    return hash_to_unit(h)


# The largest float32 below 1.0.
UNIT_MAX = 1.0 - 2.0**-24


def hash_to_unit(h: Tensor) -> Tensor:
    """32-bit hashes (int64) -> float32 uniforms strictly inside (0, 1), from their top 24 bits.

    (k + 0.5) / 2**24 lies in (0, 1) as a real number, but in float32 `k + 0.5` is exact only below 2**23: above,
    it rounds to an even integer, and for k = 2**24 - 1 to 2**24, which made u == 1.0 exactly and the Gumbel noise
    +inf. The clamp maps that one value to the largest float below 1 and leaves every other value as it was (so a
    seed draws what it drew before). Eager, fused (FMA) and compiled arithmetic agree: all round to nearest even.
    """
    return (((h >> 8) & 0xFFFFFF).float() + 0.5).mul(1.0 / (1 << 24)).clamp_max(UNIT_MAX)


def gumbel_noise(seeds: LongTensor, counters: LongTensor, vocab: int) -> Tensor:
    return -torch.log(-torch.log(uniform_noise(seeds, counters, vocab)))


def apply_repetition_penalty(logits: Tensor, seen: BoolTensor, penalty: Tensor) -> Tensor:
    """HF rule on ids marked in `seen` (B, V): score / p if score > 0 else score * p, once per distinct id."""
    p = penalty.to(logits.dtype)[:, None]
    penalized = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalized, logits)


def mark_seen(seen: BoolTensor, ids: LongTensor) -> BoolTensor:
    """Record the ids just generated (B,) in `seen` (B, V), in place."""
    return seen.scatter_(1, ids[:, None], True)


def suppress_mask(vocab_size: int, codebook_size: int, eos_id: int, device: torch.device | str | None = None) -> Tensor:
    """(V,) bool: the talker's suppressed ids, every control id (>= codebook_size) except EOS."""
    ids = torch.arange(vocab_size, device=device)
    return (ids >= codebook_size) & (ids != eos_id)


def suppress(logits: Tensor, mask: BoolTensor) -> Tensor:
    """Set logits of ids where `mask` (V,) or (B, V) is True to -inf."""
    return logits.masked_fill(mask, float("-inf"))


def mask_eos(logits: Tensor, eos_id: int, active: BoolTensor) -> Tensor:
    """Min-length rule: EOS gets -inf in rows where `active` (B,), e.g. `steps < min_new_tokens`."""
    # Comparisons, not item assignment: a Python scalar copied into a CUDA tensor breaks CUDA graph capture.
    col = torch.arange(logits.shape[-1], device=logits.device) == eos_id
    return logits.masked_fill(active[:, None] & col, float("-inf"))


def filter_logits(logits: Tensor, temperature: Tensor, top_k: LongTensor, top_p: Tensor) -> Tensor:
    """HF warper order and semantics with per-row settings (B,); dropped ids become -inf.

    temperature divides; top-k keeps ids >= the k-th largest (ties kept; k <= 0 disables); top-p sorts ascending
    and drops ids whose cumulative probability is <= 1 - top_p, always keeping the largest (top_p >= 1 disables).

    One descending sort serves both: the k-th largest is read off it, and HF's ascending cumulative sum is the
    same sum (smallest first) taken over the flipped order, so values match HF's bit for bit where logits do not
    tie (with ties, which tied ids top-p keeps depends on the sort, in HF too).
    """
    neg_inf = float("-inf")
    vocab = logits.shape[-1]
    logits = logits / temperature.to(logits.dtype)[:, None]

    desc, order = logits.sort(dim=-1, descending=True)
    k = top_k.long().clamp(1, vocab)
    kth = desc.gather(1, (k - 1)[:, None])
    top_k_on = (top_k > 0)[:, None]
    logits = logits.masked_fill((logits < kth) & top_k_on, neg_inf)

    # top-p on the top-k survivors, in the same descending order.
    desc = desc.masked_fill((desc < kth) & top_k_on, neg_inf)
    ascending_cum = desc.softmax(dim=-1).flip(-1).cumsum(dim=-1).flip(-1)
    not_largest = torch.arange(vocab, device=logits.device) > 0
    drop_sorted = (ascending_cum <= (1 - top_p.to(ascending_cum.dtype))[:, None]) & not_largest
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop & (top_p < 1)[:, None], neg_inf)


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: LongTensor,
    top_p: Tensor,
    greedy: BoolTensor,
    seeds: LongTensor,
    counters: LongTensor,
) -> LongTensor:
    """One id per row (B,). Greedy rows (or temperature <= 0) take the argmax of the unwarped logits."""
    logits = logits.float()
    greedy = greedy | (temperature <= 0)
    t = torch.where(greedy, torch.ones_like(temperature, dtype=torch.float32), temperature.float())
    filtered = filter_logits(logits, t, top_k, top_p)
    # Filtered ids score -inf whatever their noise: `-inf + noise` alone would be NaN for an infinite noise, and
    # argmax picks a NaN. The noise itself is finite (uniforms strictly inside (0, 1)); this holds even if not.
    kept = filtered > float("-inf")
    scores = torch.where(kept, filtered + gumbel_noise(seeds, counters, logits.shape[-1]), float("-inf"))
    drawn = scores.argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)
