"""Sampling rules (HF processor and warper semantics) and the counter-based noise."""

from __future__ import annotations

import math

import torch

from qwen_tts.sampling import (
    apply_repetition_penalty,
    filter_logits,
    mark_seen,
    mask_eos,
    sample,
    suppress,
    suppress_mask,
    uniform_noise,
)

NEG = float("-inf")


def rows(*values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.isfinite(r).nonzero().flatten().tolist() for r in logits]


def test_top_k_keeps_the_k_largest_with_ties_and_zero_disables() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 3.0, 3.0, 2.0, 0.0], [1.0, 5.0, 3.0, 4.0, 2.0]])
    out = filter_logits(logits, rows(1, 1, 1), rows(2, 2, 0, dtype=torch.long), rows(1, 1, 1))
    assert kept(out) == [[1, 3], [1, 2], [0, 1, 2, 3, 4]]
    torch.testing.assert_close(out[0, [1, 3]], torch.tensor([5.0, 4.0]))


def test_top_p_drops_tokens_whose_ascending_cumulative_probability_is_within_1_minus_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(3, -1)
    # ascending cumulative: 0.05, 0.20, 0.50, 1.00
    out = filter_logits(logits, rows(1, 1, 1), rows(0, 0, 0, dtype=torch.long), rows(0.75, 0.45, 0.01))
    assert kept(out) == [[0, 1], [0], [0]]


def test_top_p_of_one_keeps_everything() -> None:
    logits = torch.tensor([[0.0, -30.0, 2.0]])
    assert kept(filter_logits(logits, rows(1), rows(0, dtype=torch.long), rows(1.0))) == [[0, 1, 2]]


def test_temperature_divides_before_top_k_and_top_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    out = filter_logits(logits, rows(2.0), rows(3, dtype=torch.long), rows(1.0))
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.5, 0.0, NEG]]))
    # At T=0.25 the top token holds > 0.98 of the mass, so top_p=0.9 keeps only it; at T=1 it would keep two.
    assert kept(filter_logits(logits, rows(0.25), rows(0, dtype=torch.long), rows(0.9))) == [[0]]
    assert kept(filter_logits(logits, rows(1.0), rows(0, dtype=torch.long), rows(0.9))) == [[0, 1, 2]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_scores_of_seen_ids() -> None:
    logits = torch.tensor([[2.0, -2.0, 0.0, 3.0], [2.0, -2.0, 0.0, 3.0]])
    seen = torch.zeros(2, 4, dtype=torch.bool)
    mark_seen(seen, torch.tensor([0, 3]))
    mark_seen(seen, torch.tensor([1, 3]))  # a repeat is penalised once
    mark_seen(seen, torch.tensor([2, 3]))
    out = apply_repetition_penalty(logits, seen, rows(2.0, 1.5))
    torch.testing.assert_close(out, torch.tensor([[1.0, -4.0, 0.0, 3.0], [2.0, -2.0, 0.0, 2.0]]))


def test_talker_suppression_masks_control_ids_except_eos() -> None:
    mask = suppress_mask(3072, 2048, 2150)
    assert not mask[:2048].any()
    assert mask[2048:].sum() == 1023 and not mask[2150]
    out = suppress(torch.zeros(2, 3072), mask)
    assert torch.isinf(out[:, 2048]).all() and (out[:, 2150] == 0).all() and (out[:, :2048] == 0).all()


def test_min_length_masks_eos_only_in_active_rows() -> None:
    out = mask_eos(torch.zeros(2, 3072), 2150, torch.tensor([True, False]))
    assert out[0, 2150] == NEG and out[1, 2150] == 0
    assert torch.isfinite(out[0, :2150]).all()


def _sample(logits, seeds, counters, temperature=1.0, top_k=0, top_p=1.0, greedy=False):
    B = logits.shape[0]
    return sample(
        logits,
        torch.full((B,), temperature),
        torch.full((B,), top_k, dtype=torch.long),
        torch.full((B,), top_p),
        torch.full((B,), greedy),
        seeds,
        counters,
    )


def test_same_seed_and_counter_give_the_same_sample_whatever_the_other_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    seeds = torch.tensor([7, 7, 8, 9, 10, 11])
    counters = torch.tensor([3, 4, 3, 0, 1, 2])
    batch = _sample(logits, seeds, counters)
    for i in range(6):
        assert _sample(logits[i : i + 1], seeds[i : i + 1], counters[i : i + 1]) == batch[i]
    shuffled = _sample(
        torch.cat((torch.randn(3, 100), logits[:1])), torch.tensor([1, 2, 3, 7]), torch.tensor([0, 0, 0, 3])
    )
    assert shuffled[-1] == batch[0]


def test_noise_differs_across_seeds_counters_and_vocab_entries() -> None:
    u = uniform_noise(torch.tensor([0, 0, 1, -1, 2**40]), torch.tensor([0, 1, 0, 0, 0]), 2048)
    assert ((u > 0) & (u < 1)).all()
    assert len({tuple(r.tolist()) for r in u}) == 5
    assert abs(u.mean().item() - 0.5) < 0.01
    assert u[0].unique().numel() > 2000


def test_greedy_rows_take_the_argmax_and_sampling_rows_do_not_always() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.9, 0.8]]).expand(64, -1)
    counters = torch.arange(64)
    greedy = _sample(logits, torch.zeros(64, dtype=torch.long), counters, greedy=True)
    assert (greedy == 1).all()
    drawn = _sample(logits, torch.zeros(64, dtype=torch.long), counters)
    assert drawn.unique().numel() >= 3


def test_sample_frequencies_match_softmax_of_the_filtered_logits() -> None:
    n = 40000
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0, -3.0]]).expand(n, -1)
    seeds = torch.full((n,), 1234, dtype=torch.long)
    counters = torch.arange(n)
    for temperature, top_k in ((1.0, 0), (0.7, 3)):
        drawn = _sample(logits, seeds, counters, temperature=temperature, top_k=top_k)
        freq = torch.bincount(drawn, minlength=5).float() / n
        expected = filter_logits(logits[:1], torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([1.0]))
        expected = expected.softmax(-1)[0]
        # 5 standard errors of a frequency at n=40000 is at most 0.0125.
        tol = 5 * math.sqrt(0.25 / n)
        assert (freq - expected).abs().max() < tol, (freq, expected)
        if top_k:
            assert freq[3:].sum() == 0
