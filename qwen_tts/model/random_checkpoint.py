"""Random Qwen3-TTS-12Hz Base checkpoints in the official layout (tiny for tests, 0.6B / 1.7B for benchmarks).

Writes every file that qwen-tts 0.1.1 `Qwen3TTSModel.from_pretrained` reads (config.json, generation_config.json,
preprocessor_config.json, a Qwen2 BPE tokenizer, bf16 model.safetensors, and speech_tokenizer/ with the fp32
Mimi encoder + Code2Wav decoder), so the same random weights can be run through the official package and
through ours (parity). Tensor names and shapes come from the spec functions below, written from the config;
tests/reference/make_fixture.py proves them complete against the official models' state_dicts.

Weights are variance preserving (std 1/sqrt(fan_in), norms near 1, unit embeddings) so outputs depend on every
input; the official small-std init gives codes that ignore the text and voice (reference doc section 9).
Only torch, safetensors and the standard library are used: the reference venv imports this file too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from qwen_tts.model.config import Code2WavConfig, DecoderLayersConfig, ModelConfig, SpeakerEncoderConfig, TalkerConfig

Spec = dict[str, tuple[int, ...]]

# "tiny-mtp" is tiny with a code predictor narrower than the talker, so it has a small_to_mtp_projection as
# 1.7B does (tiny, like 0.6B, has none): CPU parity covers both code-predictor input paths.
SIZES = ("tiny", "tiny-mtp", "0.6b", "1.7b")
TINY_SIZES = ("tiny", "tiny-mtp")
TOKENIZER_ENV = "QWEN_TTS_TOKENIZER_DIR"
# Measured with the official decoder: mean |wav| about 0.2 (tiny) and 0.16 (1.7B), peaks below the clamp.
RESIDUAL_BRANCH_SCALE = 0.3
WAVEFORM_CONV_SCALE = 0.06

CODEC_LANGUAGE_ID = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
}
CODEC_IDS = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_think_id": 2154,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
GENERATION_CONFIG = {
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.9,
    "top_p": 1.0,
    "top_k": 50,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_p": 1.0,
    "subtalker_top_k": 50,
    "max_new_tokens": 8192,
}

# --------------------------------------------------------------------------------------------------------------
# Text tokenizer: a small byte-level BPE with Qwen2's special tokens.

# Special tokens in the order (and, for full sizes, at the ids) of the released Qwen3-TTS tokenizer_config.json.
OFFICIAL_SPECIAL_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|audio_start|>": 151669,
    "<|audio_end|>": 151670,
    "<tts_pad>": 151671,
    "<tts_text_bos>": 151672,
    "<tts_text_eod>": 151673,
    "<tts_text_bos_single>": 151674,
    "<|audio_pad|>": 151675,
}
FULL_TEXT_VOCAB_SIZE = 151936

# Words that become single tokens. "assistant" must: the official framing takes ids[:3] of
# "<|im_start|>assistant\n" as the role prefix. It comes first so no other merge can split it.
_BPE_WORDS = (
    "assistant",
    "Ġthe",
    "Ġand",
    "Ġto",
    "Ġof",
    "Ġis",
    "Ġa",
    "Hello",
    "Ġworld",
    "Ġvoice",
    "Ġspeech",
    "Ġtest",
    "ing",
    "er",
    "Ġquick",
    "Ġbrown",
    "Ġfox",
    "ĠThe",
    "Ġsynthesis",
    "ĠĠ",
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to chr(256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


def _byte_order() -> list[int]:
    # Qwen2's vocab lists the printable bytes first, then the remapped ones, so "Ċ" is 198 and "Ġ" is 220.
    m = bytes_to_unicode()
    printable = [b for b in range(256) if m[b] == chr(b)]
    return printable + [b for b in range(256) if m[b] != chr(b)]


def small_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocab (256 byte tokens + merged words) and merges of the generated tokenizer."""
    m = bytes_to_unicode()
    vocab = {m[b]: i for i, b in enumerate(_byte_order())}
    merges: list[tuple[str, str]] = []
    for word in _BPE_WORDS:
        cur = word[0]
        for ch in word[1:]:
            if cur + ch not in vocab:
                merges.append((cur, ch))
                vocab[cur + ch] = len(vocab)
            cur += ch
    return vocab, merges


def _tokenizer_config(specials: dict[str, int]) -> dict[str, Any]:
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok, i in sorted(specials.items(), key=lambda kv: kv[1])
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in specials if t != "<|endoftext|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generated_tokenizer(full_ids: bool) -> tuple[dict[str, int], list[tuple[str, str]], dict[str, int]]:
    """(vocab, merges, special-token ids) of the generated tokenizer; full_ids puts specials at official ids."""
    vocab, merges = small_bpe()
    if full_ids:
        # HF's fast tokenizer (what the official processor uses, built from these files) numbers added tokens
        # consecutively after the vocab, so the ids below 151643 and the gap 151646..151668 must be filled.
        # The fillers are plain vocab entries that no merge produces, so no text ever maps to them.
        first = min(OFFICIAL_SPECIAL_IDS.values())
        vocab.update({f"<|unused_{i}|>": i for i in range(len(vocab), first)})
        specials = dict(OFFICIAL_SPECIAL_IDS)
        taken = set(specials.values())
        specials.update({f"<|extra_{i}|>": i for i in range(first, max(taken) + 1) if i not in taken})
    else:
        specials = {tok: len(vocab) + k for k, tok in enumerate(OFFICIAL_SPECIAL_IDS)}
    return vocab, merges, specials


def write_text_tokenizer(root: str | Path, full_ids: bool) -> dict[str, int]:
    """Write vocab.json, merges.txt, tokenizer_config.json of the generated tokenizer; return its ids."""
    root = Path(root)
    vocab, merges, specials = generated_tokenizer(full_ids)
    (root / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (root / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    _write_json(root / "tokenizer_config.json", _tokenizer_config(specials))
    return {**specials, "assistant": vocab["assistant"]}


def _copy_tokenizer(src: Path, root: Path) -> dict[str, int]:
    """Copy a real Qwen2 tokenizer (vocab.json, merges.txt, tokenizer_config.json); return its ids."""
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copyfile(src / name, root / name)
    vocab = json.loads((src / "vocab.json").read_text(encoding="utf-8"))
    added = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8")).get("added_tokens_decoder", {})
    ids = {v["content"]: int(k) for k, v in added.items()}
    missing = [
        t for t in ("<|im_start|>", "<|im_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>") if t not in ids
    ]
    if missing or "assistant" not in vocab:
        raise ValueError(f"{src}: not a Qwen3-TTS tokenizer (missing {missing or ['assistant']})")
    return {**ids, "assistant": int(vocab["assistant"])}


# --------------------------------------------------------------------------------------------------------------
# Configs.


def layer_stack(hidden: int, inter: int, layers: int, heads: int, kv: int, head_dim: int) -> dict[str, int]:
    """A decoder stack's six widths and counts as config keys (a config.json's, or DecoderLayersConfig's)."""
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
    )


def _sizes(size: str) -> dict[str, Any]:
    """Per-size architecture numbers (official values for 0.6b / 1.7b, reference doc section 1)."""
    if size in TINY_SIZES:
        return dict(
            talker=layer_stack(32, 64, 2, 2, 1, 32),
            mrope_section=[8, 4, 4],
            text_hidden_size=64,
            predictor=layer_stack(32, 64, 2, 2, 1, 16) if size == "tiny" else layer_stack(24, 48, 2, 2, 1, 16),
            speaker=dict(
                enc_channels=[32, 32, 32, 32, 96],
                enc_kernel_sizes=[5, 3, 3, 3, 1],
                enc_dilations=[1, 2, 3, 4, 1],
                enc_attention_channels=16,
                enc_res2net_scale=8,
                enc_se_channels=16,
            ),
            decoder=dict(
                layer_stack(32, 64, 2, 2, 2, 16),
                latent_dim=64,
                decoder_dim=96,
                codebook_dim=16,
            ),
            encoder=dict(
                num_filters=4,
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=16,
                intermediate_size=64,
                codebook_dim=8,
                vector_quantization_hidden_dimension=8,
                upsample_groups=32,
                num_quantizers=16,
            ),
            model_size=size,
        )
    if size not in ("0.6b", "1.7b"):
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    hidden, inter = (2048, 6144) if size == "1.7b" else (1024, 3072)
    return dict(
        talker=layer_stack(hidden, inter, 28, 16, 8, 128),
        mrope_section=[24, 20, 20],
        text_hidden_size=2048,
        predictor=layer_stack(1024, 3072, 5, 16, 8, 128),
        speaker={},
        decoder=dict(layer_stack(512, 1024, 8, 16, 16, 64), latent_dim=1024, decoder_dim=1536, codebook_dim=512),
        encoder=dict(
            num_filters=64,
            hidden_size=512,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=2048,
            codebook_dim=256,
            vector_quantization_hidden_dimension=256,
            upsample_groups=512,
            num_quantizers=32,
        ),
        model_size="1b7" if size == "1.7b" else "0b6",
    )


# What the talker's and the code predictor's entries of config.json share, in the released files' order: the
# activation, norm and RoPE base, then (after each one's RoPE scaling and positions) the attention's settings.
_ACT_NORM_ROPE = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000)
_ATTENTION = dict(
    attention_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    use_cache=True,
    use_sliding_window=False,
    sliding_window=None,
)


# config.json's special-token keys and the tokens they name.
_TOKEN_ID_KEYS = (
    ("assistant_token_id", "assistant"), ("im_start_token_id", "<|im_start|>"), ("im_end_token_id", "<|im_end|>"),
    ("tts_pad_token_id", "<tts_pad>"), ("tts_bos_token_id", "<tts_text_bos>"), ("tts_eos_token_id", "<tts_text_eod>"),
)  # fmt: skip


def token_id_keys(text_ids: dict[str, int]) -> dict[str, int]:
    """config.json's special-token id keys for a tokenizer's ids, in the released order (assistant_token_id only
    where `text_ids` has "assistant")."""
    return {key: text_ids[token] for key, token in _TOKEN_ID_KEYS if token in text_ids}


def model_config_dict(size: str, text_ids: dict[str, int], text_vocab_size: int) -> dict[str, Any]:
    """The top-level config.json, shaped like the released one."""
    s = _sizes(size)
    hidden = s["talker"]["hidden_size"]
    predictor = dict(
        s["predictor"],
        vocab_size=2048,
        num_code_groups=16,
        **_ACT_NORM_ROPE,
        rope_scaling=None,
        max_position_embeddings=65536,
        **_ATTENTION,
        max_window_layers=28,
        layer_types=["full_attention"] * s["predictor"]["num_hidden_layers"],
        model_type="qwen3_tts_talker_code_predictor",
    )
    talker = dict(
        s["talker"],
        code_predictor_config=predictor,
        vocab_size=3072,
        text_vocab_size=text_vocab_size,
        text_hidden_size=s["text_hidden_size"],
        num_code_groups=16,
        **_ACT_NORM_ROPE,
        rope_scaling={"interleaved": True, "mrope_section": s["mrope_section"], "rope_type": "default"},
        max_position_embeddings=32768,
        **_ATTENTION,
        position_id_per_seconds=13,
        **CODEC_IDS,
        codec_language_id=dict(CODEC_LANGUAGE_ID),
        spk_id={},
        spk_is_dialect={},
        model_type="qwen3_tts_talker",
    )
    # Released checkpoints carry only enc_dim and sample_rate; a model_type key here breaks the official loader.
    speaker = dict(enc_dim=hidden, sample_rate=24000, **s["speaker"])
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "model_type": "qwen3_tts",
        **token_id_keys(text_ids),
        "speaker_encoder_config": speaker,
        "talker_config": talker,
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": s["model_size"],
        "tts_model_type": "base",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.3",
    }


def speech_tokenizer_config_dict(size: str) -> dict[str, Any]:
    """speech_tokenizer/config.json: the Code2Wav decoder config plus a consistent Mimi encoder config."""
    s = _sizes(size)
    decoder = dict(
        s["decoder"],
        attention_bias=False,
        codebook_size=2048,
        hidden_act="silu",
        layer_scale_initial_scale=0.01,
        max_position_embeddings=8000,
        num_quantizers=16,
        num_semantic_quantizers=1,
        rms_norm_eps=1e-5,
        rope_theta=10000,
        semantic_codebook_size=4096,
        sliding_window=72,
        upsample_rates=[8, 5, 4, 3],
        upsampling_ratios=[2, 2],
        vector_quantization_hidden_dimension=s["decoder"]["codebook_dim"],
    )
    encoder = dict(
        s["encoder"],
        _frame_rate=12.5,
        attention_bias=False,
        attention_dropout=0.0,
        audio_channels=1,
        codebook_size=2048,
        compress=2,
        dilation_growth_rate=2,
        hidden_act="gelu",
        initializer_range=0.02,
        kernel_size=7,
        last_kernel_size=3,
        layer_scale_initial_scale=0.01,
        max_position_embeddings=8000,
        model_type="mimi",
        norm_eps=1e-5,
        num_residual_layers=1,
        num_semantic_quantizers=1,
        pad_mode="constant",
        residual_kernel_size=3,
        rope_theta=10000.0,
        sampling_rate=24000,
        sliding_window=250,
        trim_right_ratio=1.0,
        upsampling_ratios=[8, 6, 5, 4],
        use_cache=False,
        use_causal_conv=True,
        use_conv_shortcut=False,
        use_streaming=False,
        dtype="float32",
    )
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": 16,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
        "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920,
        "decoder_config": decoder,
        "encoder_config": encoder,
        "transformers_version": "4.57.3",
    }


# --------------------------------------------------------------------------------------------------------------
# Tensor specs (names and shapes), written from the config.


def decoder_layer_spec(c: DecoderLayersConfig | Code2WavConfig, qk_norm: bool = True) -> Spec:
    """One Qwen3-style block: attention (optional per-head q/k RMSNorm), SwiGLU MLP, two pre-norms."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, i = c.hidden_size, c.intermediate_size
    spec: Spec = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    if qk_norm:
        spec["self_attn.q_norm.weight"] = (c.head_dim,)
        spec["self_attn.k_norm.weight"] = (c.head_dim,)
    return spec


def _stack(prefix: str, n: int, layer: Spec) -> Spec:
    return {f"{prefix}.{i}.{k}": v for i in range(n) for k, v in layer.items()}


def talker_spec(c: TalkerConfig) -> Spec:
    """`talker.*` tensors (prefix removed), code predictor included."""
    cp = c.code_predictor
    h, th = c.hidden_size, c.text_hidden_size
    spec: Spec = {
        "model.text_embedding.weight": (c.text_vocab_size, th),
        "model.codec_embedding.weight": (c.vocab_size, h),
        **_stack("model.layers", c.num_hidden_layers, decoder_layer_spec(c)),
        "model.norm.weight": (h,),
        "text_projection.linear_fc1.weight": (th, th),
        "text_projection.linear_fc1.bias": (th,),
        "text_projection.linear_fc2.weight": (h, th),
        "text_projection.linear_fc2.bias": (h,),
        "codec_head.weight": (c.vocab_size, h),
    }
    groups = c.num_code_groups - 1
    spec.update({f"code_predictor.model.codec_embedding.{g}.weight": (cp.vocab_size, h) for g in range(groups)})
    spec.update(_stack("code_predictor.model.layers", cp.num_hidden_layers, decoder_layer_spec(cp)))
    spec["code_predictor.model.norm.weight"] = (cp.hidden_size,)
    spec.update({f"code_predictor.lm_head.{g}.weight": (cp.vocab_size, cp.hidden_size) for g in range(groups)})
    if cp.hidden_size != h:  # 1.7B only; for 0.6B the projection is an identity with no tensors
        spec["code_predictor.small_to_mtp_projection.weight"] = (cp.hidden_size, h)
        spec["code_predictor.small_to_mtp_projection.bias"] = (cp.hidden_size,)
    return spec


def _conv(name: str, out_ch: int, in_ch: int, k: int, bias: bool = True) -> Spec:
    spec: Spec = {f"{name}.weight": (out_ch, in_ch, k)}
    if bias:
        spec[f"{name}.bias"] = (out_ch,)
    return spec


def speaker_encoder_spec(c: SpeakerEncoderConfig) -> Spec:
    """`speaker_encoder.*` tensors (prefix removed) of the ECAPA-TDNN."""
    ch, ks = c.enc_channels, c.enc_kernel_sizes
    spec = _conv("blocks.0.conv", ch[0], c.mel_dim, ks[0])
    for b in range(1, len(ch) - 1):
        p, width = f"blocks.{b}", ch[b]
        part = width // c.enc_res2net_scale
        spec.update(_conv(f"{p}.tdnn1.conv", width, ch[b - 1], 1))
        for j in range(c.enc_res2net_scale - 1):
            spec.update(_conv(f"{p}.res2net_block.blocks.{j}.conv", part, part, ks[b]))
        spec.update(_conv(f"{p}.tdnn2.conv", width, width, 1))
        spec.update(_conv(f"{p}.se_block.conv1", c.enc_se_channels, width, 1))
        spec.update(_conv(f"{p}.se_block.conv2", width, c.enc_se_channels, 1))
    spec.update(_conv("mfa.conv", ch[-1], ch[-1], ks[-1]))
    spec.update(_conv("asp.tdnn.conv", c.enc_attention_channels, ch[-1] * 3, 1))
    spec.update(_conv("asp.conv", ch[-1], c.enc_attention_channels, 1))
    spec.update(_conv("fc", c.enc_dim, ch[-1] * 2, 1))
    return spec


def code2wav_spec(c: Code2WavConfig) -> Spec:
    """`decoder.*` tensors of speech_tokenizer/model.safetensors (prefix removed), incl. the unused input_proj."""
    half = c.codebook_dim // 2
    spec: Spec = {}
    for name, n in (("rvq_first", 1), ("rvq_rest", c.num_quantizers - 1)):
        p = f"quantizer.{name}"
        spec[f"{p}.input_proj.weight"] = (half, c.codebook_dim, 1)
        spec[f"{p}.output_proj.weight"] = (c.codebook_dim, half, 1)
        for q in range(n):
            spec[f"{p}.vq.layers.{q}._codebook.cluster_usage"] = (c.codebook_size,)
            spec[f"{p}.vq.layers.{q}._codebook.embedding_sum"] = (c.codebook_size, half)
    spec.update(_conv("pre_conv.conv", c.latent_dim, c.codebook_dim, 3))
    t = "pre_transformer"
    layer = decoder_layer_spec(c, qk_norm=False)
    layer["self_attn_layer_scale.scale"] = (c.hidden_size,)
    layer["mlp_layer_scale.scale"] = (c.hidden_size,)
    spec.update(_stack(f"{t}.layers", c.num_hidden_layers, layer))
    spec[f"{t}.norm.weight"] = (c.hidden_size,)
    spec[f"{t}.input_proj.weight"] = (c.hidden_size, c.latent_dim)
    spec[f"{t}.input_proj.bias"] = (c.hidden_size,)
    spec[f"{t}.output_proj.weight"] = (c.latent_dim, c.hidden_size)
    spec[f"{t}.output_proj.bias"] = (c.latent_dim,)
    lat = c.latent_dim
    for u, r in enumerate(c.upsampling_ratios):
        p = f"upsample.{u}"
        spec.update(_conv(f"{p}.0.conv", lat, lat, r))  # ConvTranspose1d weight is (in, out, k)
        spec.update(_conv(f"{p}.1.dwconv.conv", lat, 1, 7))
        spec.update({f"{p}.1.norm.weight": (lat,), f"{p}.1.norm.bias": (lat,)})
        spec.update({f"{p}.1.pwconv1.weight": (4 * lat, lat), f"{p}.1.pwconv1.bias": (4 * lat,)})
        spec.update({f"{p}.1.pwconv2.weight": (lat, 4 * lat), f"{p}.1.pwconv2.bias": (lat,)})
        spec[f"{p}.1.gamma"] = (lat,)
    spec.update(_conv("decoder.0.conv", c.decoder_dim, lat, 7))
    for b, r in enumerate(c.upsample_rates, start=1):
        cin, cout = c.decoder_dim // 2 ** (b - 1), c.decoder_dim // 2**b
        p = f"decoder.{b}.block"
        spec.update({f"{p}.0.alpha": (cin,), f"{p}.0.beta": (cin,)})
        spec[f"{p}.1.conv.weight"] = (cin, cout, 2 * r)  # ConvTranspose1d
        spec[f"{p}.1.conv.bias"] = (cout,)
        for unit in (2, 3, 4):
            u = f"{p}.{unit}"
            spec.update({f"{u}.act1.alpha": (cout,), f"{u}.act1.beta": (cout,)})
            spec.update(_conv(f"{u}.conv1.conv", cout, cout, 7))
            spec.update({f"{u}.act2.alpha": (cout,), f"{u}.act2.beta": (cout,)})
            spec.update(_conv(f"{u}.conv2.conv", cout, cout, 1))
    out_dim = c.decoder_dim // 2 ** len(c.upsample_rates)
    n = len(c.upsample_rates) + 1
    spec.update({f"decoder.{n}.alpha": (out_dim,), f"decoder.{n}.beta": (out_dim,)})
    spec.update(_conv(f"decoder.{n + 1}.conv", 1, out_dim, 7))
    return spec


def mimi_encoder_spec(e: dict[str, Any]) -> Spec:
    """`encoder.*` tensors (prefix removed): transformers' MimiModel without its decoder parts (ICL only)."""
    nf, ch = int(e["num_filters"]), int(e["num_filters"])
    spec = _conv("encoder.layers.0.conv", nf, int(e.get("audio_channels", 1)), int(e["kernel_size"]))
    idx = 1
    compress = int(e.get("compress", 2))
    for ratio in reversed(e["upsampling_ratios"]):
        for _ in range(int(e.get("num_residual_layers", 1))):
            spec.update(_conv(f"encoder.layers.{idx}.block.1.conv", ch // compress, ch, int(e["residual_kernel_size"])))
            spec.update(_conv(f"encoder.layers.{idx}.block.3.conv", ch, ch // compress, 1))
            idx += 1
        idx += 1  # ELU
        spec.update(_conv(f"encoder.layers.{idx}.conv", ch * 2, ch, 2 * int(ratio)))
        ch *= 2
        idx += 1
    idx += 1  # ELU
    h = int(e["hidden_size"])
    spec.update(_conv(f"encoder.layers.{idx}.conv", h, ch, int(e["last_kernel_size"])))
    heads, kv, hd = int(e["num_attention_heads"]), int(e["num_key_value_heads"]), int(e["head_dim"])
    inter = int(e["intermediate_size"])
    layer: Spec = {
        "self_attn.q_proj.weight": (heads * hd, h),
        "self_attn.k_proj.weight": (kv * hd, h),
        "self_attn.v_proj.weight": (kv * hd, h),
        "self_attn.o_proj.weight": (h, heads * hd),
        "mlp.fc1.weight": (inter, h),
        "mlp.fc2.weight": (h, inter),
        "input_layernorm.weight": (h,),
        "input_layernorm.bias": (h,),
        "post_attention_layernorm.weight": (h,),
        "post_attention_layernorm.bias": (h,),
        "self_attn_layer_scale.scale": (h,),
        "mlp_layer_scale.scale": (h,),
    }
    spec.update(_stack("encoder_transformer.layers", int(e["num_hidden_layers"]), layer))
    spec["downsample.conv.weight"] = (h, h, 2 * compress)
    vq, dim, size = int(e["vector_quantization_hidden_dimension"]), int(e["codebook_dim"]), int(e["codebook_size"])
    semantic = int(e.get("num_semantic_quantizers", 1))
    for name, n in (("semantic", semantic), ("acoustic", int(e["num_quantizers"]) - semantic)):
        p = f"quantizer.{name}_residual_vector_quantizer"
        spec[f"{p}.input_proj.weight"] = (vq, h, 1)
        spec[f"{p}.output_proj.weight"] = (h, vq, 1)
        for q in range(n):
            spec[f"{p}.layers.{q}.codebook.initialized"] = (1,)
            spec[f"{p}.layers.{q}.codebook.cluster_usage"] = (size,)
            spec[f"{p}.layers.{q}.codebook.embed_sum"] = (size, dim)
    return spec


def _prefixed(prefix: str, spec: Spec) -> Spec:
    return {f"{prefix}.{k}": v for k, v in spec.items()}


def checkpoint_spec(cfg: ModelConfig) -> tuple[Spec, Spec]:
    """(model.safetensors spec, speech_tokenizer/model.safetensors spec) with their file prefixes."""
    main = _prefixed("talker", talker_spec(cfg.talker))
    if cfg.speaker_encoder is not None:
        main.update(_prefixed("speaker_encoder", speaker_encoder_spec(cfg.speaker_encoder)))
    st: Spec = {}
    if cfg.speech_tokenizer is not None:
        st.update(_prefixed("encoder", mimi_encoder_spec(cfg.speech_tokenizer.encoder)))
        st.update(_prefixed("decoder", code2wav_spec(cfg.speech_tokenizer.decoder)))
    return main, st


# --------------------------------------------------------------------------------------------------------------
# Random values.


def _init_rule(name: str, shape: tuple[int, ...]) -> tuple[str, float, float]:
    """(kind, a, b) for one tensor: ("normal", mean, std), ("uniform", low, high) or ("const", value, 0)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "initialized":
        return "const", 1.0, 0.0
    if leaf == "cluster_usage":
        return "uniform", 0.5, 2.0  # positive: entries are embedding_sum / usage
    if leaf in ("alpha", "beta"):
        return "normal", 0.0, 0.1  # SnakeBeta log-parameters near 0
    if leaf in ("scale", "gamma"):
        return "uniform", 0.05, 0.3  # layer scales: big enough that every branch matters
    if "norm" in name.rsplit(".", 2)[-2] and len(shape) == 1:
        return ("normal", 0.0, 0.05) if leaf == "bias" else ("normal", 1.0, 0.1)
    if leaf == "bias":
        return "normal", 0.0, 0.1  # non-zero so a dropped bias (a known port bug) changes outputs
    if leaf in ("embedding_sum", "embed_sum") or "embedding" in name:
        return "normal", 0.0, 1.0
    fan_in = math.prod(shape[1:])
    # Transposed convs store (in, out, k); each output sample sees in * k / stride weights.
    if re.fullmatch(r"decoder\.upsample\.\d+\.0\.conv\.weight", name):
        fan_in = shape[0]  # kernel == stride
    elif re.fullmatch(r"decoder\.decoder\.\d+\.block\.1\.conv\.weight", name):
        fan_in = 2 * shape[0]  # kernel == 2 * stride
    return "normal", 0.0, 1.0 / math.sqrt(max(1, fan_in))


def _std_factor(name: str, shape: tuple[int, ...]) -> float:
    """Extra scale for Code2Wav convs so the waveform stays well inside its [-1, 1] clamp."""
    if re.fullmatch(r"decoder\.decoder\.\d+\.block\.[2-4]\.conv2\.conv\.weight", name):
        return RESIDUAL_BRANCH_SCALE  # three residual units per block would otherwise triple the amplitude
    if name.startswith("decoder.decoder.") and name.endswith(".conv.weight") and shape[0] == 1:
        return WAVEFORM_CONV_SCALE
    return 1.0


def _tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    # One generator per tensor, seeded by (seed, name): values do not depend on which other tensors exist.
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    kind, a, b = _init_rule(name, shape)
    if kind == "const":
        return torch.full(shape, a)
    if kind == "uniform":
        return torch.rand(shape, generator=g) * (b - a) + a
    return torch.randn(shape, generator=g) * (b * _std_factor(name, shape)) + a


def random_state(spec: Spec, seed: int, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Random tensors for `spec` (sorted by name), deterministic for a seed."""
    for name in sorted(spec):
        yield name, _tensor(name, spec[name], seed).to(dtype).contiguous()


# --------------------------------------------------------------------------------------------------------------
# Writer.


def _text_vocab_size(size: str, text_ids: dict[str, int]) -> int:
    # Tiny: the smallest multiple of 64 holding every id (the released vocab is padded the same way).
    return -(-(max(text_ids.values()) + 1) // 64) * 64 if size in TINY_SIZES else FULL_TEXT_VOCAB_SIZE


def model_config(size: str) -> ModelConfig:
    """The typed config a `write_random_checkpoint(size=...)` checkpoint has (generated tokenizer), no files."""
    vocab, _, specials = generated_tokenizer(full_ids=size not in TINY_SIZES)
    text_ids = {**specials, "assistant": vocab["assistant"]}
    main = model_config_dict(size, text_ids, _text_vocab_size(size, text_ids))
    return ModelConfig.from_dict(main, speech_tokenizer_config_dict(size))


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_random_checkpoint(
    path: str | Path,
    size: str = "tiny",
    seed: int = 0,
    dtype: torch.dtype | None = None,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write a complete random checkpoint directory in the official layout and return its path.

    `dtype` is the main model.safetensors dtype (default bfloat16, as released); the speech tokenizer is
    always float32. Full sizes use `tokenizer_dir` (or $QWEN_TTS_TOKENIZER_DIR) for a real Qwen2 tokenizer
    when given, else a small generated BPE whose special tokens sit at the official ids.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    root = Path(path)
    (root / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    dtype = dtype or torch.bfloat16

    tiny = size in TINY_SIZES
    tok_src = tokenizer_dir or (os.environ.get(TOKENIZER_ENV) if not tiny else None)
    if tok_src and not tiny:
        text_ids = _copy_tokenizer(Path(tok_src), root)
    else:
        text_ids = write_text_tokenizer(root, full_ids=not tiny)
    main_cfg = model_config_dict(size, text_ids, _text_vocab_size(size, text_ids))
    st_cfg = speech_tokenizer_config_dict(size)
    _write_json(root / "config.json", main_cfg)
    _write_json(root / "generation_config.json", GENERATION_CONFIG)
    _write_json(
        root / "preprocessor_config.json",
        {
            "padding_side": "left",
            "padding_value": 0.0,
            "processor_class": "Qwen3TTSProcessor",
            "return_attention_mask": True,
        },
    )
    st = root / "speech_tokenizer"
    _write_json(st / "config.json", st_cfg)
    _write_json(st / "configuration.json", {"framework": "pytorch", "task": "text-to-speech", "allow_remote": True})
    _write_json(
        st / "preprocessor_config.json",
        {
            "chunk_length_s": None,
            "feature_extractor_type": "EncodecFeatureExtractor",
            "feature_size": 1,
            "overlap": None,
            "padding_side": "right",
            "padding_value": 0.0,
            "return_attention_mask": True,
            "sampling_rate": 24000,
        },
    )

    cfg = ModelConfig.from_dict(main_cfg, st_cfg)
    main_spec, st_spec = checkpoint_spec(cfg)
    save_file(dict(random_state(main_spec, seed, dtype)), root / "model.safetensors", metadata={"format": "pt"})
    save_file(dict(random_state(st_spec, seed, torch.float32)), st / "model.safetensors", metadata={"format": "pt"})
    return root


def weights_digest(path: str | Path) -> str:
    """sha256 over both weight files and both configs: changes whenever the writer's output changes."""
    root = Path(path)
    h = hashlib.sha256()
    for rel in (
        "config.json",
        "model.safetensors",
        "speech_tokenizer/config.json",
        "speech_tokenizer/model.safetensors",
    ):
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    return h.hexdigest()
