"""Record what the official qwen-tts 0.1.1 speech tokenizer encoder computes on our tiny random checkpoint.

Runs in the reference venv (.venv-ref, see README.md), never in ours:

    .venv-ref/bin/python tests/reference/make_encoder_fixture.py --out tests/reference/fixture_encoder_tiny.pt

Writes the tiny checkpoint (seed 0) with our writer, loads it with `Qwen3TTSModel.from_pretrained` (float32; its Mimi
encoder runs SDPA attention whatever the loader is asked), checks that the official speech tokenizer holds exactly
the tensors our writer wrote, and encodes each clip of `encoder_clips.CLIPS` through `model.speech_tokenizer.encode(wav, sr=rate)`, the call
`create_voice_clone_prompt` makes for ICL reference codes (channel mean and librosa resampling included). It records
the codes and the latents the quantizer receives (captured at `MimiSplitResidualVectorQuantizer.encode`), and asserts
that the codes say something about the quantizer: many distinct codes in every codebook, none dominating. It also records how the official config classes read
three encoder configs (the tiny one, the released shape, an empty one), for our config parser.
`tests/test_codec_encoder.py` compares ours against the file with the .venv only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path

import numpy as np
import torch
from encoder_clips import CLIPS, fingerprint, make_clip
from make_fixture import check_official_state_dicts, import_official, import_ours, save_fixture, tiny_meta, write_tiny

# MimiConfig attributes that `qwen_tts.model.codec_encoder.MimiEncoderConfig` reads under the same names.
CONFIG_FIELDS = (
    "sampling_rate", "audio_channels", "hidden_size", "num_filters", "num_residual_layers", "kernel_size",
    "last_kernel_size", "residual_kernel_size", "dilation_growth_rate", "pad_mode", "compress", "codebook_size",
    "codebook_dim", "num_quantizers", "num_semantic_quantizers", "vector_quantization_hidden_dimension",
    "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "norm_eps", "rope_theta", "attention_bias",
)  # fmt: skip
# Every codebook, over all clips, must use at least this many distinct codes, none in more than MAX_SHARE of frames.
MIN_DISTINCT = 24
MAX_SHARE = 0.4


@contextlib.contextmanager
def capture_latents(mimi):
    """The latents each `quantizer.encode` call receives, (hidden, T) per call (batch 1)."""
    quantizer = mimi.quantizer
    original = quantizer.encode
    seen: list[torch.Tensor] = []

    def encode(embeddings, *args, **kwargs):
        assert embeddings.shape[0] == 1
        seen.append(embeddings[0].detach().float().cpu().clone())
        return original(embeddings, *args, **kwargs)

    quantizer.encode = encode
    try:
        yield seen
    finally:
        quantizer.encode = original


def check_codes_are_informative(codes: torch.Tensor) -> None:
    """codes (frames, 16) of all clips: each codebook varied, so equal codes prove the quantizer, not a constant."""
    for q in range(codes.shape[1]):
        values, counts = codes[:, q].unique(return_counts=True)
        share = counts.max().item() / codes.shape[0]
        if len(values) < MIN_DISTINCT or share > MAX_SHARE:
            raise SystemExit(
                f"codebook {q}: {len(values)} distinct codes, the most common in {share:.0%} of {codes.shape[0]} "
                "frames: random codebooks not loaded, or latents that do not reach them"
            )
    print(f"codes: {codes.shape[0]} frames, distinct per codebook {[len(codes[:, q].unique()) for q in range(16)]}")


def encode(tokenizer, wav: np.ndarray, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (T, 16), latents (hidden, T')) of one clip through the official speech tokenizer."""
    with capture_latents(tokenizer.model.encoder) as seen:
        codes = tokenizer.encode(wav, sr=rate).audio_codes[0].cpu()
    (latents,) = seen
    return codes, latents


def record_configs(ours, ckpt: Path) -> list[dict]:
    """How the official config classes read encoder configs (the tiny one, the released shape, an empty one that
    leaves every value at MimiConfig's defaults): the fields `MimiEncoderConfig` parses, and the frame rates."""
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config

    dicts = {
        "tiny": json.loads((ckpt / "speech_tokenizer" / "config.json").read_text()),
        "1.7b": ours.random_checkpoint.speech_tokenizer_config_dict("1.7b"),
        "defaults": {"encoder_config": {"model_type": "mimi"}},
    }
    out = []
    for name, d in dicts.items():
        c = Qwen3TTSTokenizerV2Config(**d)
        e = c.encoder_config
        values = {k: getattr(e, k) for k in CONFIG_FIELDS}
        values["upsampling_ratios"] = list(e.upsampling_ratios)
        values.update(
            frame_rate=float(e.frame_rate),
            seanet_frame_rate=int(e.encodec_frame_rate),
            valid_quantizers=int(c.encoder_valid_num_quantizers),
            downsample_rate=int(c.encode_downsample_rate),
        )
        out.append({"name": name, "config_json": json.dumps(d), "official": values})
    return out


@torch.inference_mode()
def record(out: Path, seed: int) -> None:
    ours = import_ours(["model.random_checkpoint"])
    off = import_official()
    ckpt = write_tiny(ours, seed, "qwen_tts_encoder_fixture_")
    tts = off.Qwen3TTSModel.from_pretrained(str(ckpt), dtype=torch.float32, device_map="cpu")
    check_official_state_dicts(tts, ckpt)
    tokenizer = tts.model.speech_tokenizer
    mimi = tokenizer.model.encoder
    cfg = mimi.config
    assert cfg.num_key_value_heads >= 1 and cfg.num_attention_heads % cfg.num_key_value_heads == 0, "bad head layout"
    assert mimi.encoder_transformer.layers[0].self_attn.num_key_value_groups >= 1
    # The loader's attn_implementation reaches the tokenizer's config but not its Mimi sub-config: the official
    # encoder runs SDPA whatever is asked (so never FlashAttention 2, the one path with the sliding window).
    assert cfg._attn_implementation == "sdpa", cfg._attn_implementation
    print(f"Mimi attention: {cfg._attn_implementation}, {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} kv")

    clips = []
    for name, rate, channels, samples in CLIPS:
        wav = make_clip(name, rate, channels, samples)
        codes, latents = encode(tokenizer, wav, rate)
        samples_24k = math.ceil(samples * (24000 / rate))  # librosa.resample(fix=True)
        assert codes.shape == (-(-samples_24k // 1920), 16), (name, tuple(codes.shape))
        assert latents.shape[1] >= codes.shape[0], (name, tuple(latents.shape))
        if channels == 1:
            # The ICL prompt's own call path gives the same codes (it cannot take stereo numpy input: it assigns
            # the channel mean into the (wav, sr) tuple).
            item = tts.create_voice_clone_prompt(ref_audio=(wav, rate), ref_text="reference")[0]
            assert torch.equal(item.ref_code.cpu(), codes), name
        clips.append(
            dict(
                name=name,
                sample_rate=rate,
                channels=channels,
                samples=samples,
                fingerprint=torch.from_numpy(fingerprint(wav)),
                codes=codes.to(torch.int16),  # < 2048: int16 halves the file
                latents=latents[:, : codes.shape[0]].transpose(0, 1).contiguous(),  # (T, hidden)
            )
        )
        print(f"{name}: {samples} samples at {rate} Hz x{channels} -> {tuple(codes.shape)}")
    check_codes_are_informative(torch.cat([c["codes"] for c in clips]).long())

    fx = {
        "meta": tiny_meta(ours, ckpt, seed, numpy=np.__version__, attention=cfg._attn_implementation),
        "clips": clips,
        "configs": record_configs(ours, ckpt),
    }
    save_fixture(fx, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("fixture_encoder_tiny.pt"))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    record(a.out, a.seed)


if __name__ == "__main__":
    main()
