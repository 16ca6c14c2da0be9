"""Sampling rules (HF processor and warper semantics) and the counter-based noise."""

from __future__ import annotations

import math

import pytest
import torch

from qwen_tts.model.sampling import (
    UNIT_MAX,
    apply_repetition_penalty,
    filter_logits,
    gumbel_noise,
    hash_to_unit,
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


# (seed, counter, vocab index) whose hash has all 24 top bits set: the old mapping gave u == 1.0 there, so infinite
# noise and a NaN score for a filtered id, which argmax picked. Found by brute force over 4096 seeds x 64 counters x
# 3072 ids (49 of ~805M); each is an input here, the test recomputes everything from it.
ALL_ONES_HASH = [
    (48, 5, 2514), (211, 53, 1516), (305, 26, 1509), (319, 38, 2643), (402, 39, 3009), (481, 9, 2009),
    (508, 58, 1977), (537, 6, 2276), (588, 61, 1487), (890, 25, 452), (1127, 6, 1282), (1331, 47, 602),
    (1403, 23, 499), (1706, 19, 2619), (1728, 52, 1307), (1790, 33, 2656), (1926, 38, 1942), (2060, 61, 341),
    (2073, 34, 3012), (2154, 54, 2581), (2183, 25, 113), (2324, 30, 2135), (2411, 41, 2566), (2629, 30, 2735),
    (2927, 42, 2992), (2933, 49, 473), (3013, 21, 990), (3044, 20, 1200), (3171, 39, 2221), (3178, 5, 1800),
    (3299, 55, 1974), (3313, 1, 1153), (3326, 9, 1375), (3327, 1, 57), (3380, 2, 1157), (3472, 57, 2849),
    (3487, 24, 1450), (3502, 61, 2902), (3571, 21, 1943), (3603, 34, 1942), (3620, 2, 1007), (3628, 13, 758),
    (3752, 60, 2932), (3780, 16, 1418), (3792, 29, 1028), (3828, 15, 566), (3872, 50, 2635), (3916, 53, 2195),
    (3926, 19, 398),
]  # fmt: skip


def test_hash_to_unit_is_strictly_inside_0_1_for_every_24_bit_value() -> None:
    k = torch.arange(1 << 24, dtype=torch.int64)
    u = hash_to_unit((k << 8) | 0xA5)  # the low 8 bits are dropped
    assert u.dtype == torch.float32
    assert u.min().item() == 2.0**-25 and u.max().item() == UNIT_MAX < 1.0
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert bool((u[1:] >= u[:-1]).all())  # monotone: no value wraps
    # Every value but the top one is the exact (k + 0.5) / 2**24 rounded to float32, as before the fix.
    exact = ((k[:-1].double() + 0.5) / 2**24).float()
    assert torch.equal(u[:-1], exact)
    g = -torch.log(-torch.log(u))
    assert bool(torch.isfinite(g).all())


def test_known_all_ones_hashes_give_finite_noise() -> None:
    for seed, counter, idx in ALL_ONES_HASH:
        u = uniform_noise(torch.tensor([seed]), torch.tensor([counter]), 3072)[0, idx]
        assert u.item() == UNIT_MAX, (seed, counter, idx)
        g = gumbel_noise(torch.tensor([seed]), torch.tensor([counter]), 3072)
        assert bool(torch.isfinite(g).all()), (seed, counter)


def test_a_suppressed_id_never_wins_at_the_known_all_ones_hashes() -> None:
    # The talker's own rule: control ids >= 2048 suppressed except EOS; several of the known ids are control ids.
    mask = suppress_mask(3072, 2048, 2150)
    for seed, counter, idx in ALL_ONES_HASH:
        logits = torch.zeros(1, 3072)
        logits[0, idx] = -2.0
        own = torch.zeros(3072, dtype=torch.bool)
        own[idx] = True
        for m in (mask | own, own):
            for top_k, top_p in ((50, 1.0), (0, 1.0), (0, 0.9)):
                got = _sample(
                    suppress(logits, m), torch.tensor([seed]), torch.tensor([counter]), top_k=top_k, top_p=top_p
                )
                assert got.item() != idx and not m[got.item()], (seed, counter, idx, top_k, top_p)


def test_ids_outside_top_k_never_win_over_many_seed_counter_pairs() -> None:
    n = 8192
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(n, 3072, generator=g) * 3
    seeds = torch.randint(0, 1 << 62, (n,), generator=g)
    counters = torch.randint(0, 1 << 20, (n,), generator=g)
    # Include every known bad pair, with its id pushed out of the top 8.
    for r, (seed, counter, idx) in enumerate(ALL_ONES_HASH):
        seeds[r], counters[r] = seed, counter
        logits[r, idx] = logits[r].min() - 1
    drawn = _sample(logits, seeds, counters, temperature=0.8, top_k=8)
    top8 = logits.topk(8, dim=-1).indices
    assert bool((top8 == drawn[:, None]).any(dim=1).all())
    # And the draws are not all the argmax: the noise really is in play.
    assert (drawn != logits.argmax(-1)).float().mean().item() > 0.2


def _chi2_quantile(dof: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at the normal quantile z."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8), (0.9, 5, 0.7)],
)
def test_draws_follow_softmax_of_the_filtered_logits_chi_square(temperature, top_k, top_p) -> None:
    n = 60000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.4, 0.0, -0.5, -1.5, -3.0]]).expand(n, -1)
    drawn = _sample(
        logits,
        torch.full((n,), 99, dtype=torch.long),
        torch.arange(n),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    filtered = filter_logits(logits[:1], torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))[0]
    keep = torch.isfinite(filtered)
    counts = torch.bincount(drawn, minlength=8).double()
    assert counts[~keep].sum() == 0  # a filtered id is never drawn
    expected = filtered[keep].double().softmax(-1) * n
    chi2 = ((counts[keep] - expected) ** 2 / expected).sum().item()
    dof = int(keep.sum()) - 1
    assert dof >= 1
    assert chi2 < _chi2_quantile(dof, 3.719), (chi2, dof)  # p = 1e-4


def test_top_k_then_top_p_match_hand_computed_probabilities() -> None:
    # HF order: top-k first, then top-p on the renormalised survivors.
    probs = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])
    logits = probs.log()[None]
    out = filter_logits(logits, rows(1.0), rows(3, dtype=torch.long), rows(0.7))
    # top-3 renormalised: 0.4706, 0.2941, 0.2353; ascending cumulative 0.2353, 0.5294, 1 -> top_p 0.7 drops id 2.
    # (top-p first would keep ids 0-2: its ascending cumulative over all five is 0.05, 0.15, 0.35, ...)
    assert kept(out) == [[0, 1]]
    torch.testing.assert_close(out.softmax(-1)[0, :2], torch.tensor([0.40 / 0.65, 0.25 / 0.65]))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_noise_on_cuda_eager_graphed_and_compiled_equals_the_cpu_noise() -> None:
    k = torch.arange(1 << 24, dtype=torch.int64, device="cuda")
    u = hash_to_unit(k << 8)
    assert u.max().item() == UNIT_MAX and u.min().item() == 2.0**-25
    assert torch.equal(u.cpu(), hash_to_unit(torch.arange(1 << 24, dtype=torch.int64) << 8))

    seeds = torch.tensor([s for s, _, _ in ALL_ONES_HASH] + list(range(1000, 1200)))
    counters = torch.tensor([c for _, c, _ in ALL_ONES_HASH] + list(range(200)))
    cpu = uniform_noise(seeds, counters, 3072)
    s_cu, c_cu = seeds.cuda(), counters.cuda()
    assert torch.equal(uniform_noise(s_cu, c_cu, 3072).cpu(), cpu)
    compiled = torch.compile(uniform_noise, dynamic=False, fullgraph=True)
    assert torch.equal(compiled(s_cu, c_cu, 3072).cpu(), cpu)

    # Sampling with every known all-ones id filtered, eager, compiled and replayed from a CUDA graph.
    n = len(ALL_ONES_HASH)
    # Random logits: with ties, which tied ids top-p keeps depends on the sort's tie order (not the same on CPU).
    logits = torch.randn(n, 3072, generator=torch.Generator().manual_seed(0)).cuda()
    mask = suppress_mask(3072, 2048, 2150, "cuda").expand(n, -1).clone()
    for r, (_, _, idx) in enumerate(ALL_ONES_HASH):
        mask[r, idx] = True
    logits = suppress(logits, mask)
    args = (
        logits,
        torch.full((n,), 0.9, device="cuda"),
        torch.full((n,), 50, dtype=torch.long, device="cuda"),
        torch.full((n,), 0.95, device="cuda"),
        torch.zeros(n, dtype=torch.bool, device="cuda"),
        s_cu[:n],
        c_cu[:n],
    )
    eager = sample(*args)
    assert not mask.gather(1, eager[:, None]).any()
    assert torch.equal(torch.compile(sample, dynamic=False)(*args), eager)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sample(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample(*args)
    graph.replay()
    assert torch.equal(out, eager)
    # The same draws as on the CPU.
    assert torch.equal(eager.cpu(), sample(*(a.cpu() for a in args)))


def test_infinite_noise_cannot_make_a_filtered_id_win(monkeypatch) -> None:
    import qwen_tts.model.sampling as sampling

    def inf_at_3(seeds, counters, vocab):
        g = torch.zeros(seeds.shape[0], vocab)
        g[:, 3] = float("inf")
        return g

    monkeypatch.setattr(sampling, "gumbel_noise", inf_at_3)
    logits = torch.tensor([[1.0, 2.0, 0.5, -5.0, 0.0]]).expand(4, -1)
    for top_k in (2, 3):
        got = _sample(logits, torch.arange(4), torch.arange(4), top_k=top_k)
        assert (got == 1).all(), got  # id 3 is outside the top-k: its +inf noise must not count
    assert (_sample(logits, torch.arange(4), torch.arange(4), top_k=0) == 3).all()  # unfiltered, +inf wins
