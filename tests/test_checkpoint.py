"""The random checkpoint writer: official layout, spec-complete weights, determinism, input-dependent outputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qwen_tts.model.config import ModelConfig
from qwen_tts.model.random_checkpoint import (
    CODEC_IDS,
    OFFICIAL_SPECIAL_IDS,
    checkpoint_spec,
    model_config,
    weights_digest,
    write_random_checkpoint,
    write_text_tokenizer,
)
from qwen_tts.model.tokenizer import TextTokenizer

LAYOUT = [
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "model.safetensors",
    "speech_tokenizer/config.json",
    "speech_tokenizer/configuration.json",
    "speech_tokenizer/preprocessor_config.json",
    "speech_tokenizer/model.safetensors",
]


def _tensors(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


def test_tiny_checkpoint_has_the_official_layout(tiny_checkpoint):
    for rel in LAYOUT:
        assert (tiny_checkpoint / rel).is_file(), rel
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_tts"
    assert cfg["architectures"] == ["Qwen3TTSForConditionalGeneration"]
    assert (cfg["tts_model_type"], cfg["tokenizer_type"]) == ("base", "qwen3_tts_tokenizer_12hz")
    talker = cfg["talker_config"]
    assert {k: talker[k] for k in CODEC_IDS} == CODEC_IDS
    assert talker["codec_language_id"]["english"] == 2050 and talker["codec_language_id"]["chinese"] == 2055
    assert talker["spk_id"] == {} and talker["spk_is_dialect"] == {}
    assert sum(talker["rope_scaling"]["mrope_section"]) * 2 == talker["head_dim"] == 32
    assert talker["code_predictor_config"]["num_code_groups"] == 16
    # The official loader rejects a model_type key here (reference doc section 9).
    assert "model_type" not in cfg["speaker_encoder_config"]
    st = json.loads((tiny_checkpoint / "speech_tokenizer/config.json").read_text())
    assert st["decoder_config"]["codebook_dim"] == 16 and st["decoder_config"]["head_dim"] == 16
    enc = st["encoder_config"]
    assert enc["vector_quantization_hidden_dimension"] == enc["codebook_dim"]
    assert enc["upsample_groups"] == enc["hidden_size"]
    gen = json.loads((tiny_checkpoint / "generation_config.json").read_text())
    assert gen["top_k"] == 50 and gen["repetition_penalty"] == 1.05 and gen["max_new_tokens"] == 8192


def test_tiny_checkpoint_is_small_and_keeps_codec_framing(tiny_checkpoint):
    total = sum(p.stat().st_size for p in tiny_checkpoint.rglob("*") if p.is_file())
    assert total < 10 * 2**20
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    assert cfg.speech_tokenizer.decoder.total_upsample == 1920
    assert cfg.talker.codebook_size == 2048 and cfg.speech_tokenizer.decoder.codebook_size == 2048
    assert cfg.talker.code_predictor.hidden_size == 32 and cfg.talker.head_dim == 32


def test_weights_cover_the_spec_exactly_with_release_dtypes(tiny_checkpoint):
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    main_spec, st_spec = checkpoint_spec(cfg)
    for file, spec, dtype in (
        (tiny_checkpoint / "model.safetensors", main_spec, torch.bfloat16),
        (tiny_checkpoint / "speech_tokenizer/model.safetensors", st_spec, torch.float32),
    ):
        tensors = _tensors(file)
        assert {k: tuple(v.shape) for k, v in tensors.items()} == spec
        assert {v.dtype for v in tensors.values()} == {dtype}
    assert any(k.startswith("encoder.quantizer.acoustic") for k in st_spec)  # the Mimi encoder the official loads
    assert "decoder.quantizer.rvq_first.input_proj.weight" in st_spec  # unused by decode, present in releases


def test_same_seed_same_bytes_other_seed_other_weights(tiny_checkpoint, tmp_path):
    again = write_random_checkpoint(tmp_path / "again", size="tiny", seed=0)
    other = write_random_checkpoint(tmp_path / "other", size="tiny", seed=1)
    for rel in LAYOUT:
        assert (again / rel).read_bytes() == (tiny_checkpoint / rel).read_bytes(), rel
    assert weights_digest(again) == weights_digest(tiny_checkpoint)
    assert weights_digest(other) != weights_digest(tiny_checkpoint)
    a = _tensors(tiny_checkpoint / "model.safetensors")["talker.codec_head.weight"]
    b = _tensors(other / "model.safetensors")["talker.codec_head.weight"]
    assert not torch.equal(a, b)


def test_float32_main_weights_on_request(tmp_path):
    path = write_random_checkpoint(tmp_path / "f32", size="tiny", dtype=torch.float32)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("talker.model.norm.weight").dtype == torch.float32


def test_random_values_are_variance_preserving(tiny_checkpoint):
    main = {k: v.float() for k, v in _tensors(tiny_checkpoint / "model.safetensors").items()}
    st = _tensors(tiny_checkpoint / "speech_tokenizer/model.safetensors")
    q = main["talker.model.layers.0.self_attn.q_proj.weight"]
    assert q.std().item() == pytest.approx(1 / math.sqrt(q.shape[1]), rel=0.15)
    assert main["talker.model.text_embedding.weight"].std().item() == pytest.approx(1.0, rel=0.1)
    assert main["talker.model.norm.weight"].mean().item() == pytest.approx(1.0, abs=0.1)
    assert main["talker.text_projection.linear_fc1.bias"].abs().mean().item() > 0.03
    usage = [v for k, v in st.items() if k.endswith("cluster_usage")]
    assert usage and all(bool((u > 0).all()) for u in usage)
    snake = torch.cat([v for k, v in st.items() if k.endswith((".alpha", ".beta"))])
    assert snake.abs().max().item() < 1.0
    final = st["decoder.decoder.6.conv.weight"]
    assert final.std().item() < 0.5 * (1 / math.sqrt(final[0].numel()))  # the small waveform conv


def test_spec_of_full_sizes_has_official_shapes():
    big, small = checkpoint_spec(model_config("1.7b"))[0], checkpoint_spec(model_config("0.6b"))[0]
    assert big["talker.model.text_embedding.weight"] == (151936, 2048)
    assert big["talker.text_projection.linear_fc2.weight"] == (2048, 2048)
    assert small["talker.text_projection.linear_fc2.weight"] == (1024, 2048)
    assert big["talker.model.layers.27.mlp.gate_proj.weight"] == (6144, 2048)
    assert big["talker.code_predictor.small_to_mtp_projection.weight"] == (1024, 2048)
    assert not any("small_to_mtp_projection" in k for k in small)
    assert big["talker.code_predictor.model.codec_embedding.14.weight"] == (2048, 2048)
    assert big["speaker_encoder.fc.weight"] == (2048, 3072, 1) and small["speaker_encoder.fc.weight"] == (1024, 3072, 1)
    # Parameter counts from the released file sizes (reference doc section 1).
    assert sum(math.prod(s) for s in big.values()) == 1_928_677_440
    assert sum(math.prod(s) for s in small.values()) == 914_643_008
    st = checkpoint_spec(model_config("1.7b"))[1]
    assert st["decoder.quantizer.rvq_rest.vq.layers.14._codebook.embedding_sum"] == (2048, 256)
    assert st["encoder.quantizer.acoustic_residual_vector_quantizer.layers.30.codebook.embed_sum"] == (2048, 256)


def test_generated_tokenizer_frames_the_role_as_three_tokens(tiny_checkpoint):
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    tok = TextTokenizer.from_pretrained(tiny_checkpoint)
    newline = tok.encode("\n")
    assert newline == [198]  # "Ċ", as in Qwen2's vocab
    ids = tok.chat_ids("Hello world")
    assert ids[:3] == [cfg.im_start_token_id, cfg.assistant_token_id, 198]
    assert ids[-5:] == [cfg.im_end_token_id, 198, cfg.im_start_token_id, cfg.assistant_token_id, 198]
    assert tok.encode("<tts_pad><tts_text_bos><tts_text_eod>") == [
        cfg.tts_pad_token_id,
        cfg.tts_bos_token_id,
        cfg.tts_eos_token_id,
    ]
    assert max(tok.encode("Grüße, 你好 🙂")) < cfg.talker.text_vocab_size


def test_full_size_tokenizer_puts_specials_at_official_ids(tmp_path):
    ids = write_text_tokenizer(tmp_path, full_ids=True)
    tok = TextTokenizer.from_pretrained(tmp_path)  # checks every added token got its configured id
    for name, official in OFFICIAL_SPECIAL_IDS.items():
        assert ids[name] == official == tok.token_to_id(name)
    assert tok.chat_ids("the voice")[:3] == [151644, ids["assistant"], 198]


def _greedy(model, text: str, language: str, xvector: torch.Tensor) -> torch.Tensor:
    from qwen_tts.model.reference_loop import generate_codes

    return generate_codes(
        model.talker, model.config, model.tokenizer, text, xvector, language, max_frames=12, min_new_tokens=12
    )


def test_greedy_codes_depend_on_text_language_and_xvector(tiny_qwen3tts):
    m = tiny_qwen3tts
    x = torch.randn(m.config.xvector_dim, generator=torch.Generator().manual_seed(0))
    y = torch.randn(m.config.xvector_dim, generator=torch.Generator().manual_seed(1))
    base = _greedy(m, "The quick brown fox.", "english", x)
    assert base.shape == (12, 16)
    variants = {
        "text": _greedy(m, "Hello world, a voice test.", "english", x),
        "language": _greedy(m, "The quick brown fox.", "german", x),
        "auto": _greedy(m, "The quick brown fox.", "auto", x),
        "xvector": _greedy(m, "The quick brown fox.", "english", y),
    }
    for name, codes in variants.items():
        assert (codes[:, 0] != base[:, 0]).float().mean().item() > 0.5, name


def test_code2wav_output_sits_well_inside_the_clamp(tiny_qwen3tts):
    codes = torch.randint(0, 2048, (2, 16, 10), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        wav = tiny_qwen3tts.code2wav(codes)
    assert wav.shape == (2, 10 * 1920)
    assert 0.05 < wav.abs().mean().item() < 0.4
    assert (wav.abs() > 0.999).float().mean().item() < 0.01
    assert (wav[0] - wav[1]).abs().mean().item() > 0.01  # different codes, different audio
