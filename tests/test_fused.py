"""The CUDA fast path (qwen_tts/fused.py, decode_attention.py) computes what the eager modules compute.

On a machine without a GPU the Triton kernel runs in Triton's interpreter and the compiled blocks through
inductor's CPU backend: slow, but the same code paths and the same arithmetic as on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from qwen_tts import fused
from qwen_tts.decode_attention import HAVE_TRITON, decode_attention, reference_decode_attention
from qwen_tts.loading import load_model

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("B", "Hq", "Hkv", "D", "slots", "L"),
    [(3, 16, 8, 128, 5, 100), (2, 4, 2, 32, 4, 40), (1, 8, 8, 16, 2, 20), (2, 6, 2, 32, 3, 50)],
)
def test_decode_attention_equals_gather_and_sdpa(B, Hq, Hkv, D, slots, L) -> None:
    g = torch.Generator().manual_seed(B * 100 + Hq)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    # q|k|v as views of one wide buffer (the fused path's layout: row strides wider than the heads).
    qkv = rand(B, (Hq + 2 * Hkv) * D)
    q = qkv[:, : Hq * D].reshape(B, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hkv) * D].reshape(B, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D :].reshape(B, Hkv, D)
    cache_k, cache_v = rand(slots, Hkv, L, D), rand(slots, Hkv, L, D)
    ref_k, ref_v = cache_k.double(), cache_v.double()
    slot_ids = torch.randperm(slots, generator=g)[:B].to(DEVICE)
    positions = torch.randint(0, L, (B,), generator=g).to(DEVICE)
    out = decode_attention(q, k, v, cache_k, cache_v, slot_ids, positions)
    ref = reference_decode_attention(q.double(), k.double(), v.double(), ref_k, ref_v, slot_ids, positions)
    assert out.shape == (B, Hq, D)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    # The new key and value landed at each row's position; nothing else in the cache moved.
    assert torch.equal(cache_k.double(), ref_k) and torch.equal(cache_v.double(), ref_v)


def test_decode_attention_takes_one_position_expanded_over_the_batch() -> None:
    g = torch.Generator().manual_seed(7)
    B, H, D, L = 4, 2, 16, 24
    q, k, v = (torch.randn(B, H, D, generator=g).to(DEVICE) for _ in range(3))
    cache_k, cache_v = (torch.randn(B, H, L, D, generator=g).to(DEVICE) for _ in range(2))
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    slots = torch.arange(B, device=DEVICE)
    positions = torch.tensor([5], device=DEVICE).expand(B)  # stride 0, as the code predictor passes it
    out = decode_attention(q, k, v, cache_k, cache_v, slots, positions)
    ref = reference_decode_attention(q, k, v, ref_k, ref_v, slots, positions)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


async def test_fused_engine_codes_equal_the_reference_loop(tiny_checkpoint) -> None:
    import test_engine_reference as ref_tests

    model = load_model(tiny_checkpoint, device=DEVICE)  # a private copy: enable() re-lays its weights
    before = {k: v.clone() for k, v in model.talker.state_dict().items()}
    cases = ref_tests.CASES[:3] + ref_tests.CASES[-2:]  # greedy, both text modes, top-p, the long penalised runs
    with ref_tests.eos_boost(model, 3.0):
        reqs = [ref_tests.request(model, i, text, opts) for i, (text, opts) in enumerate(cases)]
        expected = [ref_tests.reference(model, r) for r in reqs]  # eager modules
        assert fused.enable(model.talker) == len(model.talker.model.layers) + len(
            model.talker.code_predictor.model.layers
        )
        assert fused.is_enabled(model.talker)
        after = model.talker.state_dict()
        assert all(torch.equal(v, after[k]) for k, v in before.items())  # same weights, new layout
        handles = await ref_tests.engine_codes(model, reqs, padded=False)
    for (text, _), h, e in zip(cases, handles, expected, strict=True):
        got = torch.cat(h.codes) if h.codes else torch.zeros(0, 16, dtype=torch.long)
        assert torch.equal(got, e), text
    assert len({e.shape[0] for e in expected}) >= 3  # EOS at different frames: the boundary rules are in play
