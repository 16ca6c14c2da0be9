"""Talker, code predictor, prompt and reference loop on tiny random configs (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwen_tts.model.config import ModelConfig
from qwen_tts.model.layers import DecoderStack, apply_rope
from qwen_tts.model.prompt import (
    TEXT_TRACK_GROUP,
    HeadCache,
    IclRows,
    TextTable,
    build_prompt,
    build_text_prompts,
    normalize_language,
)
from qwen_tts.model.random_checkpoint import CODEC_IDS, OFFICIAL_SPECIAL_IDS, layer_stack, token_id_keys
from qwen_tts.model.reference_loop import generate_codes
from qwen_tts.model.talker import Talker

LANGS = {"english": 2050, "german": 2053, "chinese": 2055, "sichuan_dialect": 2062}


def tiny_config(hidden: int = 32, cp_hidden: int = 32, text_hidden: int = 48, layers: int = 2) -> ModelConfig:
    """Talker hidden 32, head_dim 32, 2 heads, 1 kv head; codec vocab and special ids as released."""
    norm_rope = dict(rms_norm_eps=1e-6, rope_theta=1e6)
    talker = dict(
        **layer_stack(hidden, 2 * hidden, layers, 2, 1, 32),
        **norm_rope,
        vocab_size=3072,
        max_position_embeddings=32768,
        num_code_groups=16,
        text_hidden_size=text_hidden,
        text_vocab_size=151936,
        **CODEC_IDS,
        codec_language_id=LANGS,
        rope_scaling={"interleaved": True, "mrope_section": [8, 4, 4], "rope_type": "default"},
        code_predictor_config=dict(
            **layer_stack(cp_hidden, 2 * cp_hidden, 2, 2, 1, 32),
            **norm_rope,
            vocab_size=2048,
            max_position_embeddings=65536,
            num_code_groups=16,
        ),
    )
    return ModelConfig.from_dict(
        dict(
            talker_config=talker,
            speaker_encoder_config=dict(enc_dim=hidden, sample_rate=24000),
            tts_model_type="base",
            **token_id_keys(OFFICIAL_SPECIAL_IDS),
        )
    )


def random_talker(cfg: ModelConfig, seed: int = 0) -> Talker:
    """Variance-preserving random weights, so outputs depend on the inputs (the default init nearly ignores them)."""
    torch.manual_seed(seed)
    talker = Talker(cfg.talker).eval()
    with torch.no_grad():
        for name, p in talker.named_parameters():
            if p.ndim == 1:
                p.copy_(0.02 * torch.randn_like(p) if name.endswith("bias") else 1 + 0.1 * torch.randn_like(p))
            elif "embedding" in name:
                p.normal_()
            else:
                p.normal_(std=p.shape[1] ** -0.5)
    return talker


def full_forward_no_cache(stack: DecoderStack, x: torch.Tensor) -> torch.Tensor:
    """Independent whole-sequence forward with a plain causal mask, built from the stack's submodules."""
    B, T, _ = x.shape
    cos, sin = stack.rotary_emb(torch.arange(T, device=x.device)[None].expand(B, -1), x.dtype)
    cos, sin = cos[:, :, None], sin[:, :, None]
    for layer in stack.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(a.q_norm(a.q_proj(h).view(B, T, -1, a.head_dim)), cos, sin).transpose(1, 2)
        k = apply_rope(a.k_norm(a.k_proj(h).view(B, T, -1, a.head_dim)), cos, sin).transpose(1, 2)
        v = a.v_proj(h).view(B, T, -1, a.head_dim).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + a.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return stack.norm(x)


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return tiny_config(hidden=64, cp_hidden=32)


@pytest.fixture(scope="module")
def talker(cfg: ModelConfig) -> Talker:
    return random_talker(cfg)


def test_step_by_step_cached_decode_equals_full_forward_without_cache(talker: Talker) -> None:
    torch.manual_seed(1)
    T, P = 12, 5
    x = torch.randn(1, T, talker.cfg.hidden_size)
    expected = full_forward_no_cache(talker.model, x)
    cache = talker.new_cache(slots=1, max_len=32)
    slot = torch.tensor([0])
    out = [talker(x[:, :P], torch.arange(P)[None], cache, slot, kv_len=P)]
    for t in range(P, T):
        out.append(talker(x[:, t : t + 1], torch.tensor([[t]]), cache, slot, kv_len=t + 1))
    torch.testing.assert_close(torch.cat(out, dim=1), expected, atol=1e-5, rtol=1e-5)


def test_prefill_in_one_call_equals_full_forward_without_cache(talker: Talker) -> None:
    torch.manual_seed(2)
    x = torch.randn(1, 9, talker.cfg.hidden_size)
    cache = talker.new_cache(slots=2, max_len=16)
    got = talker(x, torch.arange(9)[None], cache, torch.tensor([1]), kv_len=9)
    torch.testing.assert_close(got, full_forward_no_cache(talker.model, x), atol=1e-5, rtol=1e-5)


def _prefill(talker: Talker, cache, slot: int, x: torch.Tensor) -> None:
    talker(x, torch.arange(x.shape[1])[None], cache, torch.tensor([slot]), kv_len=x.shape[1])


def test_rows_at_different_positions_in_one_call_equal_each_row_alone(talker: Talker) -> None:
    torch.manual_seed(3)
    H = talker.cfg.hidden_size
    seq_a, seq_b = torch.randn(1, 5, H), torch.randn(1, 9, H)
    step = torch.randn(2, 1, H)

    batched = talker.new_cache(slots=3, max_len=16)
    _prefill(talker, batched, 2, seq_a)
    _prefill(talker, batched, 0, seq_b)
    got = talker(step, torch.tensor([[5], [9]]), batched, torch.tensor([2, 0]), kv_len=10)

    for row, (seq, pos) in enumerate([(seq_a, 5), (seq_b, 9)]):
        alone = talker.new_cache(slots=1, max_len=16)
        _prefill(talker, alone, 0, seq)
        ref = talker(step[row : row + 1], torch.tensor([[pos]]), alone, torch.tensor([0]), kv_len=pos + 1)
        torch.testing.assert_close(got[row : row + 1], ref, atol=1e-5, rtol=1e-5)


def test_slots_are_isolated(talker: Talker) -> None:
    torch.manual_seed(4)
    H = talker.cfg.hidden_size
    seq = torch.randn(1, 6, H)
    step = torch.randn(1, 1, H)
    outs = []
    for other in (torch.randn(1, 6, H), 100 * torch.randn(1, 6, H)):
        cache = talker.new_cache(slots=2, max_len=8)
        _prefill(talker, cache, 1, seq)
        _prefill(talker, cache, 0, other)
        k0 = cache.k[:, 0].clone()
        outs.append(talker(step, torch.tensor([[6]]), cache, torch.tensor([1]), kv_len=7))
        assert torch.equal(cache.k[:, 0], k0), "a step on slot 1 wrote into slot 0"
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def _expected_names(cfg: ModelConfig, with_projection: bool) -> set[str]:
    block = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    ]
    names = {f"model.layers.{i}.{b}" for i in range(cfg.talker.num_hidden_layers) for b in block}
    names |= {
        f"code_predictor.model.layers.{i}.{b}"
        for i in range(cfg.talker.code_predictor.num_hidden_layers)
        for b in block
    }
    names |= {"model.norm.weight", "model.codec_embedding.weight", "model.text_embedding.weight", "codec_head.weight"}
    names |= {f"text_projection.linear_fc{i}.{w}" for i in (1, 2) for w in ("weight", "bias")}
    names |= {"code_predictor.model.norm.weight"}
    names |= {f"code_predictor.model.codec_embedding.{j}.weight" for j in range(15)}
    names |= {f"code_predictor.lm_head.{j}.weight" for j in range(15)}
    if with_projection:
        names |= {"code_predictor.small_to_mtp_projection.weight", "code_predictor.small_to_mtp_projection.bias"}
    return names


@pytest.mark.parametrize(("hidden", "with_projection"), [(64, True), (32, False)], ids=["1.7B-style", "0.6B-style"])
def test_state_dict_names_and_shapes_follow_the_checkpoint_layout(hidden: int, with_projection: bool) -> None:
    cfg = tiny_config(hidden=hidden, cp_hidden=32, text_hidden=48)
    sd = Talker(cfg.talker).state_dict()
    assert set(sd) == _expected_names(cfg, with_projection)
    assert sd["model.text_embedding.weight"].shape == (151936, 48)
    assert sd["text_projection.linear_fc2.weight"].shape == (hidden, 48)
    assert sd["code_predictor.model.codec_embedding.0.weight"].shape == (2048, hidden)
    assert sd["code_predictor.lm_head.14.weight"].shape == (2048, 32)
    assert sd["code_predictor.model.layers.0.self_attn.q_proj.weight"].shape == (64, 32)  # 2 heads x 32
    if with_projection:
        assert sd["code_predictor.small_to_mtp_projection.weight"].shape == (32, hidden)


def test_rope_frequencies_stay_float32_when_the_module_is_cast_to_bf16() -> None:
    talker = Talker(tiny_config().talker).to(torch.bfloat16)
    inv = talker.model.rotary_emb.inv_freq
    assert inv.dtype == torch.float32
    torch.testing.assert_close(inv, 1.0 / (1e6 ** (torch.arange(0, 32, 2).float() / 32)))


def _argmax_sampler(log: list | None = None):
    def sample(j: int, logits: torch.Tensor) -> torch.Tensor:
        if log is not None:
            log.append((j, logits.clone()))
        return logits.argmax(-1)

    return sample


def test_code_predictor_returns_15_codes_and_the_sum_of_all_16_embeddings(talker: Talker) -> None:
    torch.manual_seed(5)
    H = talker.cfg.hidden_size
    h, cb0 = torch.randn(3, H), torch.randint(0, 2048, (3,))
    log: list = []
    codes, codec_sum = talker.code_predictor(h, talker.embed_codec(cb0), _argmax_sampler(log))
    assert codes.shape == (3, 15) and codes.dtype == torch.long
    assert [j for j, _ in log] == list(range(15))
    assert all(lg.shape == (3, 2048) for _, lg in log)
    emb = talker.code_predictor.model.codec_embedding
    expected = talker.embed_codec(cb0) + sum(emb[j](codes[:, j]) for j in range(15))
    torch.testing.assert_close(codec_sum, expected, atol=1e-5, rtol=1e-5)
    assert len(set(codes[0].tolist())) > 3, "codes do not depend on the step"


def test_code_predictor_loop_equals_one_teacher_forced_forward(talker: Talker) -> None:
    torch.manual_seed(6)
    H = talker.cfg.hidden_size
    cp = talker.code_predictor
    h, cb0 = torch.randn(2, H), torch.randint(0, 2048, (2,))
    log: list = []
    codes, _ = cp(h, talker.embed_codec(cb0), _argmax_sampler(log))
    seq = [h, talker.embed_codec(cb0)] + [cp.model.codec_embedding[j](codes[:, j]) for j in range(14)]
    x = cp.small_to_mtp_projection(torch.stack(seq, dim=1))  # (2, 16, H_cp)
    hidden = full_forward_no_cache(cp.model, x)
    for j, logits in log:
        torch.testing.assert_close(logits, cp.lm_head[j](hidden[:, j + 1]), atol=1e-4, rtol=1e-4)


def test_code_predictor_rows_do_not_depend_on_the_batch(talker: Talker) -> None:
    torch.manual_seed(7)
    H = talker.cfg.hidden_size
    h, cb0 = torch.randn(4, H), torch.randint(0, 2048, (4,))
    codes, codec_sum = talker.code_predictor(h, talker.embed_codec(cb0), _argmax_sampler())
    for i in (0, 3):
        c1, e1 = talker.code_predictor(h[i : i + 1], talker.embed_codec(cb0[i : i + 1]), _argmax_sampler())
        assert torch.equal(c1[0], codes[i])
        torch.testing.assert_close(e1[0], codec_sum[i], atol=1e-5, rtol=1e-5)


def test_code_predictor_without_projection_has_no_projection_tensors() -> None:
    cfg = tiny_config(hidden=32, cp_hidden=32)
    talker = random_talker(cfg)
    assert not any("small_to_mtp" in k for k in talker.state_dict())
    codes, codec_sum = talker.code_predictor(torch.randn(2, 32), torch.randn(2, 32), _argmax_sampler())
    assert codes.shape == (2, 15) and codec_sum.shape == (2, 32)


def test_code_predictor_input_tables_hold_the_projected_rows_and_leave_the_codes_alone(cfg: ModelConfig) -> None:
    """CodePredictor.build_input_tables (FastPath.cp_input_tables): 14 tables, each row the projection of its
    embedding row; a frame's codes and embedding sum with the tables equal those without; an Identity projection
    builds nothing."""
    talker = random_talker(cfg, seed=3)
    cp = talker.code_predictor
    V, H_cp = cp.cfg.vocab_size, cp.cfg.hidden_size
    assert cp.build_input_tables() == 14 * V * H_cp * 4
    assert cp.input_tables.shape == (14, V, H_cp)
    ids = torch.tensor([0, 7, V - 1])
    for j in (0, 13):
        want = cp.small_to_mtp_projection(cp.model.codec_embedding[j](ids))
        torch.testing.assert_close(cp.input_tables[j][ids], want, atol=1e-6, rtol=1e-6)
    torch.manual_seed(8)
    h, cb0 = torch.randn(4, talker.cfg.hidden_size), torch.randint(0, 2048, (4,))
    log_tables: list = []
    codes_t, sum_t = cp(h, talker.embed_codec(cb0), _argmax_sampler(log_tables))
    cp.input_tables = None
    log: list = []
    codes, codec_sum = cp(h, talker.embed_codec(cb0), _argmax_sampler(log))
    assert torch.equal(codes_t, codes)
    torch.testing.assert_close(sum_t, codec_sum, atol=1e-6, rtol=1e-6)
    for (_, a), (_, b) in zip(log_tables, log, strict=True):  # every pass's logits, not only their argmax
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(set(codes[0].tolist())) > 3
    flat = random_talker(tiny_config(hidden=32, cp_hidden=32)).code_predictor
    assert flat.build_input_tables() == 0 and flat.input_tables is None


def _argmax_feed(calls: list):
    """A `feed` hook in torch ops (the kernel's own test is in test_sample_kernel.py): argmax, then the code, the
    sum and the next input written into the buffers the code predictor hands over."""

    def feed(j, logits, codes, table_e, codec_sum, table_x, x) -> None:
        calls.append((j, table_e.data_ptr(), None if table_x is None else table_x.data_ptr()))
        ids = logits.argmax(-1)
        codes.copy_(ids)
        codec_sum += table_e[ids]
        if table_x is not None:
            x.copy_(table_x[ids])

    return feed


@pytest.mark.parametrize("shape", ["projected-tables", "no-projection"])
def test_a_feed_hook_gives_the_codes_and_sums_of_the_sampling_path(shape) -> None:
    """CodePredictor.forward's `feed` (FastPath.cp_fused_feed): each pass hands the hook its logits, its
    column of the codes, codebook j's embedding table, the codec sum and the next input's table (the projected
    input table, or the embedding table itself without a projection; none at the last pass). The codes and sums
    equal the sampling path's. Behind a projection without input tables the hook is not used."""
    cfg = tiny_config(hidden=64, cp_hidden=32) if shape == "projected-tables" else tiny_config(hidden=32, cp_hidden=32)
    talker = random_talker(cfg, seed=5)
    cp = talker.code_predictor
    if shape == "projected-tables":
        cp.build_input_tables()
    torch.manual_seed(10)
    h, cb0 = torch.randn(3, talker.cfg.hidden_size), torch.randint(0, 2048, (3,))
    want_codes, want_sum = cp(h, talker.embed_codec(cb0), _argmax_sampler())
    calls: list = []
    codes, codec_sum = cp(h, talker.embed_codec(cb0), _argmax_sampler(), _argmax_feed(calls))
    assert torch.equal(codes, want_codes) and torch.equal(codec_sum, want_sum)
    assert len(set(codes[0].tolist())) > 3
    emb = [m.weight.data_ptr() for m in cp.model.codec_embedding]
    inputs = [t.data_ptr() for t in cp.input_tables] if shape == "projected-tables" else emb[:14]
    assert calls == [(j, emb[j], inputs[j] if j < 14 else None) for j in range(15)]
    if shape == "projected-tables":
        cp.input_tables = None
        unused: list = []
        codes, codec_sum = cp(h, talker.embed_codec(cb0), _argmax_sampler(), _argmax_feed(unused))
        assert unused == [] and torch.equal(codes, want_codes)


class _EagerKernels:
    """A `StepKernels` whose one-token passes are the eager stack's over the positions written so far."""

    prompt_one_pass = False

    def __init__(self, head_linear=None) -> None:
        self.head_linear = head_linear

    def stack_step(self, stack, x, positions, cache, slots, shared_slots=False):
        return stack(x[:, None], positions[:, None], cache, slots, int(positions.max()) + 1)[:, 0]


def test_a_head_linear_hook_runs_every_head_matmul(cfg: ModelConfig) -> None:
    """The kernels' head_linear (Talker.use_kernels; the fast path's small_m_heads): each of a frame's 16 head
    matmuls goes through the hook with the head's own weight, and the logits are the heads' own."""
    talker = random_talker(cfg, seed=4)
    calls: list = []

    def hook(x, w):
        calls.append(w.data_ptr())
        return F.linear(x, w)

    torch.manual_seed(9)
    h, cb0 = torch.randn(2, talker.cfg.hidden_size), torch.randint(0, 2048, (2,))
    want_logits = talker.logits(h)
    talker.use_kernels(_EagerKernels())
    want = talker.residual_codes(h, talker.embed_codec(cb0), _argmax_sampler())
    talker.use_kernels(_EagerKernels(hook))
    torch.testing.assert_close(talker.logits(h), want_logits)
    got = talker.residual_codes(h, talker.embed_codec(cb0), _argmax_sampler())
    assert torch.equal(got[0], want[0])
    heads = [talker.codec_head.weight] + [m.weight for m in talker.code_predictor.lm_head]
    assert calls == [w.data_ptr() for w in heads]


def _embed_text(talker: Talker, i: int) -> torch.Tensor:
    return talker.embed_text(torch.tensor([i]))[0]


def _embed_codec(talker: Talker, i: int) -> torch.Tensor:
    return talker.embed_codec(torch.tensor([i]))[0]


ROLE = [151644, 271, 198]
TEXT = [272, 320, 332, 290]


def _prompt_parts(cfg: ModelConfig, talker: Talker, language: str, non_streaming: bool):
    """build_prompt of TEXT with a random x-vector, and what its rows are made of: the x-vector, the text pad, bos and
    eos embeddings, and the codec embedding of an id."""
    xv = torch.randn(cfg.talker.hidden_size)
    p = build_prompt(cfg, talker, TEXT, ROLE, xv, language, non_streaming=non_streaming)
    tpad, tbos, teos = (_embed_text(talker, i) for i in (151671, 151672, 151673))
    return p, xv, tpad, tbos, teos, lambda i: _embed_codec(talker, i)


def test_non_streaming_prompt_puts_the_whole_text_in_the_prefill(cfg: ModelConfig, talker: Talker) -> None:
    tc = cfg.talker
    p, xv, tpad, tbos, teos, C = _prompt_parts(cfg, talker, "English", non_streaming=True)
    m = len(TEXT)
    assert p.prefill.shape == (3 + 6 + m + 1 + 1, tc.hidden_size)
    assert p.trailing.shape == (0, tc.hidden_size)
    torch.testing.assert_close(p.pad, tpad)
    expected = [_embed_text(talker, i) for i in ROLE]
    expected += [tpad + C(i) for i in (2154, 2156, 2050, 2157)] + [tpad + xv, tbos + C(2148)]
    expected += [_embed_text(talker, i) + C(2148) for i in TEXT] + [teos + C(2148), tpad + C(2149)]
    torch.testing.assert_close(p.prefill, torch.stack(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("non_streaming", [False, True])
def test_cached_heads_give_every_prompt_the_bits_of_one_built_afresh(cfg: ModelConfig, talker: Talker, non_streaming):
    """HeadCache builds each language's head once and fills in the x-vector row: prompts of several languages and
    voices, x-vector and ICL, are those build_prompt builds without it, bit for bit."""
    heads = HeadCache()
    g = torch.Generator().manual_seed(5)
    icl = IclRows([300, 301, 302], torch.randn(4, cfg.talker.hidden_size, generator=g))
    for language in ("English", "auto", "german", "english", "AUTO"):
        for ref in (None, icl):
            xv = torch.randn(cfg.talker.hidden_size, generator=g)
            a = build_prompt(cfg, talker, TEXT, ROLE, xv, language, non_streaming, ref, heads)
            b = build_prompt(cfg, talker, TEXT, ROLE, xv, language, non_streaming, ref)
            for name in ("prefill", "trailing", "pad", "end"):
                assert torch.equal(getattr(a, name), getattr(b, name)), (language, ref is None, name)
    assert len(heads._heads) == 3  # english, auto, german
    with pytest.raises(ValueError, match="x-vector must have shape"):
        heads.head(cfg, talker, ROLE, torch.zeros(3), "auto")


def test_streaming_auto_prompt_feeds_the_rest_of_the_text_as_trailing(cfg: ModelConfig, talker: Talker) -> None:
    p, xv, tpad, tbos, teos, C = _prompt_parts(cfg, talker, "auto", non_streaming=False)
    expected = [_embed_text(talker, i) for i in ROLE]
    expected += [tpad + C(i) for i in (2155, 2156, 2157)] + [tpad + xv, tbos + C(2148)]
    expected += [_embed_text(talker, TEXT[0]) + C(2149)]
    torch.testing.assert_close(p.prefill, torch.stack(expected), atol=1e-5, rtol=1e-5)
    trailing = torch.stack([_embed_text(talker, i) for i in TEXT[1:]] + [teos])
    torch.testing.assert_close(p.trailing, trailing, atol=1e-5, rtol=1e-5)


def _group_row(talker: Talker, token: int, pad: int) -> torch.Tensor:
    """P(token) projected as the first row of a pad-filled group of TEXT_TRACK_GROUP rows."""
    return talker.embed_text(torch.tensor([token] + [pad] * (TEXT_TRACK_GROUP - 1)))[0]


def test_a_text_table_row_is_its_token_projected_in_a_group_whatever_came_before(cfg: ModelConfig) -> None:
    """Rows are the group projection of their token bit for bit: across growth past the first storage, across
    tokens first seen together or apart, and after the table starts over at its limit."""
    talker = random_talker(cfg, seed=3)
    pad = cfg.tts_pad_token_id
    g = torch.Generator().manual_seed(11)
    table = TextTable(talker, pad, limit=40)
    seen: list[int] = []
    with torch.inference_mode():
        for n in (5, 1, 17, 3, 30, 8):  # 40 rows: the table starts over partway
            ids = torch.randint(0, 150000, (n,), generator=g).tolist() + seen[-2:]
            got = table.rows(ids)
            assert got.shape == (len(ids), cfg.talker.hidden_size)
            for k, t in enumerate(ids):
                assert torch.equal(got[k], _group_row(talker, t, pad)), (n, k)
            assert len(table) <= table.limit
            seen += ids
        wide = list(range(1000, 1050))  # more distinct tokens than the table holds: projected, not kept
        got = table.rows(wide + wide[:3])
        assert torch.equal(got[50:], got[:3])
        assert all(torch.equal(got[k], _group_row(talker, t, pad)) for k, t in enumerate(wide[:20]))
        assert table.rows([]).shape == (0, cfg.talker.hidden_size)
    with pytest.raises(ValueError, match="limit must be at least"):
        TextTable(talker, pad, limit=4)


@pytest.mark.parametrize("non_streaming", [False, True])
def test_prompts_from_a_text_table_are_the_grouped_prompts_within_rounding(cfg: ModelConfig, non_streaming) -> None:
    """x-vector and ICL prompts (texts longer and shorter than the reference block) built with a text table have
    the layout and values of the ones without, and a token's text row is the same bits in every prompt."""
    talker = random_talker(cfg, seed=4)
    table = TextTable(talker, cfg.tts_pad_token_id)
    g = torch.Generator().manual_seed(6)
    xv = torch.randn(cfg.talker.hidden_size, generator=g)
    icl = IclRows([300, 301, 302], torch.randn(6, cfg.talker.hidden_size, generator=g))
    long_text = torch.randint(0, 150000, (37,), generator=g).tolist()
    with torch.inference_mode():
        for text in (TEXT, long_text, long_text[:2]):
            for ref in (None, icl):
                a = build_prompt(cfg, talker, text, ROLE, xv, "english", non_streaming, ref, table=table)
                b = build_prompt(cfg, talker, text, ROLE, xv, "english", non_streaming, ref)
                for name in ("prefill", "trailing", "pad", "end"):
                    x, y = getattr(a, name), getattr(b, name)
                    assert x.shape == y.shape, (len(text), ref is None, name)
                    torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        # streaming x-vector: the trailing track is the table's rows of text[1:], then teos
        if not non_streaming:
            p = build_prompt(cfg, talker, long_text, ROLE, xv, "english", False, table=table)
            assert torch.equal(p.trailing[:-1], table.rows(long_text[1:]))
            assert torch.equal(p.trailing[:-1][5], _group_row(talker, long_text[6], cfg.tts_pad_token_id))


def test_prompts_built_together_are_the_bits_of_prompts_built_one_by_one(cfg: ModelConfig) -> None:
    """build_text_prompts over texts of several lengths and languages (tokens first seen in the batch among them)
    gives each request the prefill, trailing, pad and end build_prompt gives it with the same heads and table."""
    talker = random_talker(cfg, seed=7)
    heads, table = HeadCache(), TextTable(talker, cfg.tts_pad_token_id)
    g = torch.Generator().manual_seed(8)
    texts = [TEXT, torch.randint(0, 150000, (23,), generator=g).tolist(), [5], [*TEXT, 9, 9, 9]]
    languages = ["English", "auto", "german", "english"]
    xs = [torch.randn(cfg.talker.hidden_size, generator=g) for _ in texts]
    with torch.inference_mode():
        together = build_text_prompts(cfg, talker, texts, ROLE, xs, languages, heads, table)
        for text, x, language, got in zip(texts, xs, languages, together, strict=True):
            want = build_prompt(cfg, talker, text, ROLE, x, language, True, None, heads, table)
            for name in ("prefill", "trailing", "pad", "end"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (len(text), language, name)
        assert build_text_prompts(cfg, talker, [], ROLE, [], [], heads, table) == []
        with pytest.raises(ValueError, match="text_ids is empty"):
            build_text_prompts(cfg, talker, [TEXT, []], ROLE, xs[:2], languages[:2], heads, table)
        with pytest.raises(ValueError, match="x-vector must have shape"):
            build_text_prompts(cfg, talker, [TEXT], ROLE, [torch.zeros(3)], ["auto"], heads, table)


def test_normalize_language_is_case_insensitive_and_names_the_allowed_list(cfg: ModelConfig) -> None:
    assert normalize_language(cfg, None) == "auto"
    assert normalize_language(cfg, "AUTO") == "auto"
    assert normalize_language(cfg, "English") == "english"
    with pytest.raises(ValueError, match=r"'klingon'.*auto, chinese, english, german"):
        normalize_language(cfg, "klingon")
    with pytest.raises(ValueError, match="sichuan_dialect"):  # dialects are not offered, as in the official wrapper
        normalize_language(cfg, "sichuan_dialect")


class _FixedTokenizer:
    """chat_ids for a fixed framed sequence, so the loop tests need no tokenizer files."""

    def chat_ids(self, text: str) -> list[int]:
        return [*ROLE, *TEXT, 151645, 198, *ROLE]


def _bias_eos(monkeypatch: pytest.MonkeyPatch, talker: Talker, cfg: ModelConfig, value: float) -> None:
    """Add `value` to the EOS logit at every step (large: EOS always wins; very negative: it never does)."""
    bias = torch.zeros(cfg.talker.vocab_size)
    bias[cfg.talker.codec_eos_token_id] = value
    monkeypatch.setattr(talker, "logits", lambda h: Talker.logits(talker, h) + bias)


@pytest.mark.parametrize("min_new_tokens", [2, 5])
def test_generation_stops_at_eos_only_after_min_new_tokens(
    cfg: ModelConfig, talker: Talker, monkeypatch: pytest.MonkeyPatch, min_new_tokens: int
) -> None:
    _bias_eos(monkeypatch, talker, cfg, 1e4)
    codes = generate_codes(
        talker, cfg, _FixedTokenizer(), "x", torch.randn(64), max_frames=20, min_new_tokens=min_new_tokens
    )
    assert codes.shape == (min_new_tokens, 16)
    assert (codes[:, 0] < cfg.talker.codebook_size).all()


def test_generation_emits_exactly_max_frames_without_eos(
    cfg: ModelConfig, talker: Talker, monkeypatch: pytest.MonkeyPatch
) -> None:
    _bias_eos(monkeypatch, talker, cfg, -1e4)
    codes = generate_codes(talker, cfg, _FixedTokenizer(), "x", torch.randn(64), max_frames=7, greedy=False, seed=1)
    assert codes.shape == (7, 16)
    assert ((codes >= 0) & (codes < 2048)).all()


def test_sampled_generation_is_reproducible_per_seed(cfg: ModelConfig, talker: Talker) -> None:
    xv = torch.randn(64)

    def run(seed: int) -> torch.Tensor:
        return generate_codes(
            talker, cfg, _FixedTokenizer(), "x", xv, max_frames=6, greedy=False, seed=seed, min_new_tokens=6
        )

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
