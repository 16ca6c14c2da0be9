"""The sort-free sampler kernel (qwen_tts/fastpath/sample_kernel.py) against `sampling.sample`, the sampler it replaces.

Without a GPU the kernel runs in Triton's interpreter (conftest.py); on CUDA, on the device.
"""

from __future__ import annotations

import pytest
import torch

from qwen_tts.fastpath.decode_attention import HAVE_TRITON
from qwen_tts.model import sampling

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton (the interpreter on CPU)")

if HAVE_TRITON:
    from qwen_tts.fastpath import sample_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def settings(rows: int, g: torch.Generator, top_p: bool) -> tuple[torch.Tensor, ...]:
    """Per-row temperature, top_k, top_p, greedy, seed, counter across their ranges and edges."""
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.1
    temperature[::11] = 0.0  # temperature 0: greedy
    top_k = torch.randint(0, 80, (rows,), generator=g)
    top_k[::7] = 1
    top_k[3::13] = 5000  # above the vocab: everything kept
    tp = torch.rand(rows, generator=g) * 0.9 + 0.05 if top_p else torch.ones(rows)
    greedy = torch.rand(rows, generator=g) < 0.1
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=g)
    counters = torch.randint(0, 2**40, (rows,), generator=g)
    return temperature, top_k, tp, greedy, seeds, counters


def on(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def draw_args(seed: int, rows: int, vocab: int, top_p: bool) -> list[torch.Tensor]:
    """Continuous logits (scale 3) and `settings` for a draw, from one generator, on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    return on(DEVICE, torch.randn(rows, vocab, generator=g) * 3, *settings(rows, g, top_p))


@pytest.mark.parametrize(
    ("vocab", "dtype"),
    [(2048, torch.bfloat16), (3072, torch.float32), (1000, torch.float32)],
    ids=["code-predictor-bf16", "talker-float32", "odd-vocab"],
)
def test_top_k_draws_equal_the_sorting_sampler(vocab, dtype) -> None:
    """Without top-p the kernel finds the sort's k-th largest logit exactly: the same ids survive and the same
    Gumbel noise picks among them, so every draw equals `sampling.sample`'s, including rows with suppressed (-inf)
    ids, k above the vocab, k = 1, greedy and temperature 0, 64-bit seeds and counters, and bf16 logits (read as
    float32, as `sample` casts them)."""
    g = torch.Generator().manual_seed(vocab)
    rows = 48
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    logits[:8, vocab // 2 :] = float("-inf")  # fewer finite ids than some rows' k
    logits[8:16] = logits[8:16].round()  # ties at the k-th value: all kept, in both
    args = on(DEVICE, logits, *settings(rows, g, top_p=False))
    for offset in (0, 15):
        want = sampling.sample(args[0].float(), *args[1:-1], args[-1] + offset)
        got = sample_kernel.sample(*args, counter_offset=offset)
        assert got.dtype == torch.long and got.shape == (rows,)
        assert torch.equal(got, want), (got != want).nonzero().flatten().tolist()
    # The draws do depend on the noise: another offset moves some of them.
    assert not torch.equal(sample_kernel.sample(*args, counter_offset=1), sample_kernel.sample(*args))


def test_top_p_draws_equal_the_sorting_sampler_on_untied_logits() -> None:
    """With top-p < 1 the kernel's cut (the largest logit whose mass is <= 1 - top_p) drops the ids HF's sorted
    cumulative sum drops; on continuous logits (no ties) the draws are the same."""
    args = draw_args(3, rows=64, vocab=2048, top_p=True)
    want = sampling.sample(*args)
    got = sample_kernel.sample(*args)
    assert torch.equal(got, want), (got != want).nonzero().flatten().tolist()


def test_top_p_keeps_exactly_the_nucleus() -> None:
    """Probabilities 0.5, 0.25, 0.125, ... : top_p 0.7 keeps the first two ids, 0.9 the first four (their mass
    0.9375 is the first >= 0.9), 0.3 only the largest; many draws show every kept id and no other."""
    vocab = 16
    base = torch.log(torch.tensor([0.5**i for i in range(1, vocab + 1)]))
    rows = 160
    logits = base.repeat(rows, 1)
    for top_p, kept in ((0.7, 2), (0.9, 4), (0.3, 1)):
        temperature = torch.ones(rows)
        top_k = torch.zeros(rows, dtype=torch.long)
        tp = torch.full((rows,), top_p)
        greedy = torch.zeros(rows, dtype=torch.bool)
        seeds = torch.arange(rows)
        counters = torch.zeros(rows, dtype=torch.long)
        args = on(DEVICE, logits, temperature, top_k, tp, greedy, seeds, counters)
        got = sample_kernel.sample(*args).cpu()
        assert set(got.tolist()) == set(range(kept)), (top_p, sorted(set(got.tolist())))
        assert torch.equal(got, sampling.sample(*args).cpu())


def test_a_row_draws_the_same_alone_and_in_a_batch() -> None:
    args = draw_args(11, rows=24, vocab=2048, top_p=True)
    batch = sample_kernel.sample(*args)
    for i in (0, 17):
        alone = sample_kernel.sample(*(a[i : i + 1] for a in args))
        assert alone.item() == batch[i].item()


def test_reads_a_strided_view_and_an_empty_batch() -> None:
    g = torch.Generator().manual_seed(5)
    rows, vocab = 12, 3072
    wide = torch.randn(rows, 2 * vocab, generator=g).to(DEVICE)
    view = wide[:, :vocab]  # rows strided by 2 * vocab
    s = on(DEVICE, *settings(rows, g, top_p=False))
    assert torch.equal(sample_kernel.sample(view, *s), sampling.sample(view.contiguous(), *s))
    empty = [t[:0] for t in (view, *s)]
    assert sample_kernel.sample(*empty).shape == (0,)


def test_the_warp_count_leaves_the_draws_alone_and_bad_sizes_are_refused() -> None:
    vocab = 2048
    args = draw_args(13, rows=8, vocab=vocab, top_p=False)
    want = sampling.sample(*args)
    for n in (2048, 256):
        assert sample_kernel.num_warps(vocab, n) == 2048 // n
        assert torch.equal(sample_kernel.sample(*args, warp_elements=n), want)
    assert sample_kernel.num_warps(3072, 256) == 16  # 4096 / 256, the cap
    assert sample_kernel.num_warps(vocab) == 4
    for bad in (0, 100, 8192):
        with pytest.raises(ValueError, match="power of two from 32 to 4096"):
            sample_kernel.sample(*args, warp_elements=bad)


@pytest.mark.parametrize("top_p", [False, True], ids=["top-k", "top-k-and-top-p"])
def test_greedy_rows_branch_around_the_draw_with_the_same_ids(top_p) -> None:
    """`greedy_branch`: greedy rows (flagged, or temperature 0) skip the filters and the noise. Every id is
    the same as without the branch and as `sampling.sample`'s, in a batch that mixes greedy and sampled rows; the
    greedy rows' ids are their logits' argmax."""
    g = torch.Generator().manual_seed(17)
    rows, vocab = 40, 2048
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature, top_k, tp, greedy, seeds, counters = settings(rows, g, top_p=top_p)
    greedy[:rows:3] = True
    args = on(DEVICE, logits, temperature, top_k, tp, greedy, seeds, counters)
    is_greedy = args[4] | (args[1] <= 0)
    assert 0 < int(is_greedy.sum()) < rows  # both kinds of row in the batch
    draws = {branch: sample_kernel.sample(*args, greedy_branch=branch) for branch in (True, False)}
    assert torch.equal(draws[True], draws[False])
    assert torch.equal(draws[True][is_greedy], args[0].argmax(-1)[is_greedy])
    if not top_p:  # top-p's cut may differ from the sort's at ties (the module's docstring); top-k's may not
        assert torch.equal(draws[True], sampling.sample(*args))
    # The sampled rows are draws, not argmaxes: the noise moves some of them.
    assert not torch.equal(draws[True][~is_greedy], args[0].argmax(-1)[~is_greedy])


@pytest.mark.parametrize("feed", [True, False], ids=["feeds-the-next-pass", "last-pass"])
def test_sample_feed_draws_as_sample_and_adds_and_gathers_the_drawn_rows(feed) -> None:
    """`sample_feed` (FastPath.cp_fused_feed): the ids are `sampling.sample`'s (greedy and sampled rows
    mixed), written into a column of a wider codes tensor and nowhere else; the codec sum gains each id's embedding
    row as `codec_sum + emb[ids]` does, bit for bit; the next input is each id's table row (rows wider than one
    block of the kernel's loop, and of two widths), and without a table nothing else is written."""
    g = torch.Generator().manual_seed(23)
    rows, vocab, hs, hn = 10, 2048, 1100, 700
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(torch.bfloat16)
    s = settings(rows, g, top_p=False)
    s[3][:4] = True  # greedy rows as well as sampled ones
    emb = torch.randn(vocab, hs, generator=g).to(torch.bfloat16)
    table = torch.randn(vocab, hn, generator=g).to(torch.bfloat16)
    codec_sum = torch.randn(rows, hs, generator=g) * 10
    logits, *s = on(DEVICE, logits, *s)
    emb, table, codec_sum = on(DEVICE, emb, table, codec_sum)
    codes = torch.full((rows, 15), -1, dtype=torch.long, device=DEVICE)
    nxt = torch.full((rows, hn), 7.0, dtype=torch.bfloat16, device=DEVICE)
    before = codec_sum.clone()

    ids = sampling.sample(logits.float(), *s[:-1], s[-1] + 6)
    sample_kernel.sample_feed(
        logits, *s, 6, codes[:, 5], emb, codec_sum, table if feed else None, nxt if feed else None
    )

    assert torch.equal(codes[:, 5], ids)
    assert bool((codes[:, :5] == -1).all()) and bool((codes[:, 6:] == -1).all())
    assert torch.equal(codec_sum, before + emb[ids])
    assert not torch.equal(codec_sum, before)
    if feed:
        assert torch.equal(nxt, table[ids])
    else:
        assert bool((nxt == 7.0).all())
    assert len(set(ids.tolist())) > 3


def test_sample_feed_refuses_mismatched_buffers() -> None:
    logits = torch.zeros(2, 64, device=DEVICE)
    s = on(DEVICE, torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2), torch.ones(2, dtype=torch.bool))
    s += on(DEVICE, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    emb, total = torch.zeros(64, 8, device=DEVICE), torch.zeros(2, 8, device=DEVICE)
    codes = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="codes must be"):
        sample_kernel.sample_feed(logits, *s, 0, codes.int(), emb, total)
    with pytest.raises(ValueError, match="emb must be"):
        sample_kernel.sample_feed(logits, *s, 0, codes, emb[:32], total)
    with pytest.raises(ValueError, match="codec_sum must be"):
        sample_kernel.sample_feed(logits, *s, 0, codes, emb, total.bfloat16())
    with pytest.raises(ValueError, match="come together"):
        sample_kernel.sample_feed(logits, *s, 0, codes, emb, total, emb)
    with pytest.raises(ValueError, match="table must be"):
        sample_kernel.sample_feed(logits, *s, 0, codes, emb, total, emb[:32], torch.zeros(2, 8, device=DEVICE))
