"""Typed configuration for Qwen3-TTS-12Hz Base checkpoints.

Parses `config.json` and `speech_tokenizer/config.json` of the official layout (qwen-tts 0.1.1,
`configuration_qwen3_tts.py` and `configuration_qwen3_tts_tokenizer_v2.py`). Every value is read from the
files: the official Python defaults are stale (codec_eos 4198, 20 layers, 32 code groups), so a key that
a real checkpoint always carries is required here rather than defaulted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A checkpoint config is missing a key or holds a value we cannot use."""


def _req(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"{where}: missing required key {key!r}")
    return d[key]


@dataclass(frozen=True)
class AttentionStackConfig:
    """What every Qwen3-style transformer stack has: the talker's, the code predictor's, the codec decoder's."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    @staticmethod
    def _stack_kw(
        d: dict[str, Any], where: str, heads: int, hidden: int, rms_norm_eps: float, rope_theta: float | None
    ) -> dict[str, Any]:
        """The stack's keys but max_position_embeddings, read in the order the errors name them; `heads` and
        `hidden` are read first by the caller, and `rope_theta` is required where it has no default."""
        return dict(
            hidden_size=hidden,
            intermediate_size=int(_req(d, "intermediate_size", where)),
            num_hidden_layers=int(_req(d, "num_hidden_layers", where)),
            num_attention_heads=heads,
            num_key_value_heads=int(_req(d, "num_key_value_heads", where)),
            # The official modules use getattr(config, "head_dim", hidden // heads).
            head_dim=int(d.get("head_dim", hidden // heads)),
            rms_norm_eps=float(d.get("rms_norm_eps", rms_norm_eps)),
            rope_theta=float(_req(d, "rope_theta", where) if rope_theta is None else d.get("rope_theta", rope_theta)),
        )


@dataclass(frozen=True)
class DecoderLayersConfig(AttentionStackConfig):
    """A Qwen3-style decoder stack (talker or code predictor)."""

    vocab_size: int
    hidden_act: str = "silu"

    @classmethod
    def _from_dict(cls, d: dict[str, Any], where: str) -> dict[str, Any]:
        heads = int(_req(d, "num_attention_heads", where))
        hidden = int(_req(d, "hidden_size", where))
        kw = dict(
            **cls._stack_kw(d, where, heads, hidden, rms_norm_eps=1e-6, rope_theta=None),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            vocab_size=int(_req(d, "vocab_size", where)),
            hidden_act=str(d.get("hidden_act", "silu")),
        )
        if kw["hidden_act"] != "silu":
            raise ConfigError(f"{where}: hidden_act {kw['hidden_act']!r} is not supported (only 'silu')")
        if heads % kw["num_key_value_heads"]:
            raise ConfigError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
        return kw


@dataclass(frozen=True)
class CodePredictorConfig(DecoderLayersConfig):
    """The sub-talker that predicts residual codebooks 1..15 for each frame."""

    num_code_groups: int = 16

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CodePredictorConfig:
        where = "talker_config.code_predictor_config"
        kw = cls._from_dict(d, where)
        return cls(**kw, num_code_groups=int(_req(d, "num_code_groups", where)))


@dataclass(frozen=True)
class TalkerConfig(DecoderLayersConfig):
    """The talker: a Qwen3 decoder over summed text + codec embeddings, emitting codebook-0 ids."""

    code_predictor: CodePredictorConfig = None  # type: ignore[assignment]
    num_code_groups: int = 16
    text_hidden_size: int = 2048
    text_vocab_size: int = 151936
    codec_eos_token_id: int = 2150
    codec_think_id: int = 2154
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    codec_language_id: dict[str, int] = field(default_factory=dict)
    rope_scaling: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TalkerConfig:
        where = "talker_config"
        kw = cls._from_dict(d, where)
        ids = {
            k: int(_req(d, k, where))
            for k in (
                "codec_eos_token_id",
                "codec_think_id",
                "codec_nothink_id",
                "codec_think_bos_id",
                "codec_think_eos_id",
                "codec_pad_id",
                "codec_bos_id",
            )
        }
        langs = {str(k).lower(): int(v) for k, v in dict(_req(d, "codec_language_id", where)).items()}
        cfg = cls(
            **kw,
            **ids,
            code_predictor=CodePredictorConfig.from_dict(_req(d, "code_predictor_config", where)),
            num_code_groups=int(_req(d, "num_code_groups", where)),
            text_hidden_size=int(_req(d, "text_hidden_size", where)),
            text_vocab_size=int(_req(d, "text_vocab_size", where)),
            codec_language_id=langs,
            rope_scaling=d.get("rope_scaling"),
        )
        if cfg.num_code_groups != cfg.code_predictor.num_code_groups:
            raise ConfigError("talker and code predictor disagree on num_code_groups")
        return cfg

    @property
    def codebook_size(self) -> int:
        """Ids below this are codebook-0 codes; ids at or above it are control ids."""
        return self.code_predictor.vocab_size


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """ECAPA-TDNN x-vector encoder (`speaker_encoder.*`, Base checkpoints only)."""

    enc_dim: int
    mel_dim: int = 128
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeakerEncoderConfig:
        # Released checkpoints carry only enc_dim and sample_rate; the rest are the class defaults.
        tuples = ("enc_channels", "enc_kernel_sizes", "enc_dilations")
        kw = {
            k: (tuple(int(x) for x in v) if k in tuples else v) for k, v in d.items() if k in cls.__dataclass_fields__
        }
        if "enc_dim" not in kw:
            raise ConfigError("speaker_encoder_config: missing required key 'enc_dim'")
        return cls(**kw)


@dataclass(frozen=True)
class Code2WavConfig(AttentionStackConfig):
    """The 12 Hz speech tokenizer's decoder (codes -> 24 kHz waveform)."""

    codebook_size: int
    codebook_dim: int
    latent_dim: int
    decoder_dim: int
    sliding_window: int
    layer_scale_initial_scale: float
    num_quantizers: int
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Code2WavConfig:
        where = "speech_tokenizer decoder_config"
        heads = int(_req(d, "num_attention_heads", where))
        hidden = int(_req(d, "hidden_size", where))
        return cls(
            codebook_size=int(_req(d, "codebook_size", where)),
            codebook_dim=int(_req(d, "codebook_dim", where)),
            latent_dim=int(_req(d, "latent_dim", where)),
            decoder_dim=int(_req(d, "decoder_dim", where)),
            **cls._stack_kw(d, where, heads, hidden, rms_norm_eps=1e-5, rope_theta=10000.0),
            sliding_window=int(_req(d, "sliding_window", where)),
            layer_scale_initial_scale=float(d.get("layer_scale_initial_scale", 0.01)),
            max_position_embeddings=int(d.get("max_position_embeddings", 8000)),
            num_quantizers=int(_req(d, "num_quantizers", where)),
            upsample_rates=tuple(int(x) for x in _req(d, "upsample_rates", where)),
            upsampling_ratios=tuple(int(x) for x in _req(d, "upsampling_ratios", where)),
        )

    @property
    def total_upsample(self) -> int:
        """Waveform samples per codec frame (1920 for the released tokenizer)."""
        n = 1
        for r in (*self.upsample_rates, *self.upsampling_ratios):
            n *= r
        return n


@dataclass(frozen=True)
class SpeechTokenizerConfig:
    """`speech_tokenizer/config.json`: decoder settings plus the (ICL-only) Mimi encoder's raw dict."""

    decoder: Code2WavConfig
    encoder: dict[str, Any]
    encoder_valid_num_quantizers: int
    input_sample_rate: int
    output_sample_rate: int
    decode_upsample_rate: int
    encode_downsample_rate: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeechTokenizerConfig:
        where = "speech_tokenizer/config.json"
        cfg = cls(
            decoder=Code2WavConfig.from_dict(_req(d, "decoder_config", where)),
            encoder=dict(d.get("encoder_config") or {}),
            encoder_valid_num_quantizers=int(d.get("encoder_valid_num_quantizers", 16)),
            input_sample_rate=int(d.get("input_sample_rate", 24000)),
            output_sample_rate=int(d.get("output_sample_rate", 24000)),
            decode_upsample_rate=int(_req(d, "decode_upsample_rate", where)),
            encode_downsample_rate=int(d.get("encode_downsample_rate", 1920)),
        )
        if cfg.decoder.total_upsample != cfg.decode_upsample_rate:
            raise ConfigError(
                f"{where}: decoder upsampling {cfg.decoder.total_upsample} != decode_upsample_rate {cfg.decode_upsample_rate}"
            )
        return cfg


@dataclass(frozen=True)
class ModelConfig:
    """Top-level `config.json` of a Qwen3-TTS-12Hz checkpoint, plus its speech tokenizer config."""

    talker: TalkerConfig
    speaker_encoder: SpeakerEncoderConfig | None
    speech_tokenizer: SpeechTokenizerConfig | None
    tts_model_type: str
    tts_model_size: str
    im_start_token_id: int
    im_end_token_id: int
    tts_pad_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int
    assistant_token_id: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], speech_tokenizer: dict[str, Any] | None = None) -> ModelConfig:
        where = "config.json"
        model_type = str(d.get("tts_model_type", "base"))
        spk = d.get("speaker_encoder_config")
        cfg = cls(
            talker=TalkerConfig.from_dict(_req(d, "talker_config", where)),
            speaker_encoder=SpeakerEncoderConfig.from_dict(spk) if (spk and model_type == "base") else None,
            speech_tokenizer=SpeechTokenizerConfig.from_dict(speech_tokenizer) if speech_tokenizer else None,
            tts_model_type=model_type,
            tts_model_size=str(d.get("tts_model_size", "")),
            im_start_token_id=int(_req(d, "im_start_token_id", where)),
            im_end_token_id=int(_req(d, "im_end_token_id", where)),
            tts_pad_token_id=int(_req(d, "tts_pad_token_id", where)),
            tts_bos_token_id=int(_req(d, "tts_bos_token_id", where)),
            tts_eos_token_id=int(_req(d, "tts_eos_token_id", where)),
            assistant_token_id=int(d["assistant_token_id"]) if "assistant_token_id" in d else None,
        )
        if cfg.speaker_encoder is not None and cfg.speaker_encoder.enc_dim != cfg.talker.hidden_size:
            raise ConfigError(
                f"{where}: speaker_encoder_config.enc_dim {cfg.speaker_encoder.enc_dim} != talker hidden_size {cfg.talker.hidden_size}"
            )
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` and, when present, `speech_tokenizer/config.json` under `path`."""
        root = Path(path)
        main_file = root / "config.json"
        if not main_file.is_file():
            raise ConfigError(f"{main_file}: not found (is this a Qwen3-TTS checkpoint directory?)")
        d = json.loads(main_file.read_text())
        st_file = root / "speech_tokenizer" / "config.json"
        st = json.loads(st_file.read_text()) if st_file.is_file() else None
        return cls.from_dict(d, st)

    @property
    def xvector_dim(self) -> int:
        """Width of a speaker x-vector for this model (the talker hidden size)."""
        return self.talker.hidden_size

    @property
    def languages(self) -> list[str]:
        """Languages the prompt builder accepts, lower case, plus 'auto' (dialect ids are CustomVoice-only, and
        the official wrapper drops them for Base checkpoints)."""
        return ["auto", *sorted(k for k in self.talker.codec_language_id if "dialect" not in k)]
