"""Strict checkpoint loading: every tensor accounted for, clear errors, the two known port traps checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwen_tts.model.codec_decoder import Code2Wav
from qwen_tts.model.loading import (
    CheckpointError,
    check_rope,
    check_text_projection_bias,
    load_model,
    load_speaker_encoder,
)
from qwen_tts.model.random_checkpoint import code2wav_spec, model_config, speaker_encoder_spec, talker_spec
from qwen_tts.model.speaker_encoder import SpeakerEncoder
from qwen_tts.model.talker import Talker


def _read(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


def _edit_weights(file: Path, edit) -> None:
    tensors = _read(file)
    edit(tensors)
    save_file(tensors, file)


def _edit_config(root: Path, edit, name: str = "config.json") -> None:
    cfg = json.loads((root / name).read_text())
    edit(cfg)
    (root / name).write_text(json.dumps(cfg))


def _shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def test_tiny_loads_with_documented_dtypes(tiny_checkpoint):
    m = load_model(tiny_checkpoint)
    assert m.dtype == torch.float32 and m.device == torch.device("cpu")
    assert m.speaker_encoder is None and m.path == tiny_checkpoint
    assert m.config.talker.hidden_size == 32
    bf = load_model(tiny_checkpoint, dtype=torch.bfloat16, speaker_encoder=True)
    assert bf.talker.codec_head.weight.dtype == torch.bfloat16
    assert bf.speaker_encoder.fc.weight.dtype == torch.bfloat16
    assert bf.code2wav.pre_conv.conv.weight.dtype == torch.float32  # Code2Wav always float32
    assert not bf.talker.training and not any(p.requires_grad for p in bf.talker.parameters())


def test_loaded_values_equal_the_file(tiny_qwen3tts, tiny_checkpoint):
    main = _read(tiny_checkpoint / "model.safetensors")
    st = _read(tiny_checkpoint / "speech_tokenizer/model.safetensors")
    m = tiny_qwen3tts
    for name, t in m.talker.state_dict().items():
        assert torch.equal(t, main[f"talker.{name}"].float()), name
    for name, t in m.speaker_encoder.state_dict().items():
        assert torch.equal(t, main[f"speaker_encoder.{name}"].float()), name
    for name, t in m.code2wav.state_dict().items():
        assert torch.equal(t, st[f"decoder.{name}"]), name


def test_missing_tensor_is_named(tiny_copy):
    key = "talker.model.layers.1.mlp.down_proj.weight"
    _edit_weights(tiny_copy / "model.safetensors", lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=r"missing tensors: .*layers\.1\.mlp\.down_proj\.weight"):
        load_model(tiny_copy)


def test_unexpected_tensor_is_named(tiny_copy):
    _edit_weights(tiny_copy / "model.safetensors", lambda t: t.update({"talker.extra.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: talker\.extra\.weight"):
        load_model(tiny_copy)


def test_unexpected_decoder_tensor_is_named_but_encoder_group_is_ignored(tiny_copy):
    st = tiny_copy / "speech_tokenizer/model.safetensors"
    _edit_weights(st, lambda t: t.update({"encoder.anything.new": torch.zeros(2)}))
    load_model(tiny_copy)  # encoder.* is the Mimi encoder we never run
    _edit_weights(st, lambda t: t.update({"decoder.extra.bias": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: decoder\.extra\.bias"):
        load_model(tiny_copy)
    load_model(tiny_copy, code2wav=False)  # the speech tokenizer file is not read at all


def test_wrong_shape_names_expected_and_found(tiny_copy):
    key = "speech_tokenizer/model.safetensors"
    _edit_weights(tiny_copy / key, lambda t: t.update({"decoder.pre_conv.conv.weight": torch.zeros(64, 16, 5)}))
    with pytest.raises(
        CheckpointError, match=r"decoder\.pre_conv\.conv\.weight expected \(64, 16, 3\) found \(64, 16, 5\)"
    ):
        load_model(tiny_copy)


@pytest.mark.parametrize(
    ("section", "change", "message"),
    [
        ("talker_config", {"intermediate_size": 96}, r"mlp\.gate_proj\.weight expected \(96, 32\) found \(64, 32\)"),
        ("speaker_encoder_config", {"enc_dim": 48}, r"enc_dim 48 != talker hidden_size 32"),
    ],
    ids=["wider-than-the-weights", "xvector-width-not-the-talker-width"],
)
def test_config_that_disagrees_with_the_weights_is_refused(tiny_copy, section: str, change: dict, message: str):
    _edit_config(tiny_copy, lambda cfg: cfg[section].update(change))
    with pytest.raises(CheckpointError, match=message):
        load_model(tiny_copy)


def test_missing_config_key_is_named(tiny_copy):
    _edit_config(tiny_copy, lambda cfg: cfg["talker_config"].pop("codec_bos_id"))
    with pytest.raises(CheckpointError, match="codec_bos_id"):
        load_model(tiny_copy)
    with pytest.raises(CheckpointError, match="codec_bos_id"):
        load_speaker_encoder(tiny_copy)


def test_speaker_encoder_tensors_required_only_when_asked(tiny_copy):
    def drop(t):
        for k in [k for k in t if k.startswith("speaker_encoder.")]:
            t.pop(k)

    _edit_weights(tiny_copy / "model.safetensors", drop)
    assert load_model(tiny_copy).speaker_encoder is None
    with pytest.raises(CheckpointError, match=r"missing tensors: speaker_encoder\."):
        load_model(tiny_copy, speaker_encoder=True)


def test_load_speaker_encoder_reads_only_its_own_tensors(tiny_copy, tiny_qwen3tts):
    # A file with broken talker tensors still gives the voice extractor its encoder.
    _edit_weights(
        tiny_copy / "model.safetensors",
        lambda t: t.update({"talker.codec_head.weight": torch.zeros(1), "talker.junk": torch.zeros(1)}),
    )
    enc, cfg = load_speaker_encoder(tiny_copy)
    assert isinstance(enc, SpeakerEncoder) and cfg.speaker_encoder.enc_dim == 32
    wav = torch.sin(torch.arange(24000) * 0.05) * 0.3
    assert torch.equal(enc.embed(wav), tiny_qwen3tts.speaker_encoder.embed(wav))


def test_non_base_checkpoint_has_no_speaker_encoder(tiny_copy):
    _edit_config(tiny_copy, lambda cfg: cfg.update(tts_model_type="custom_voice"))
    with pytest.raises(CheckpointError, match="no speaker encoder"):
        load_speaker_encoder(tiny_copy)


def test_not_a_checkpoint_directory(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_model(tmp_path)


def test_truncated_weights_file(tiny_copy):
    f = tiny_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_model(tiny_copy)


def test_dropped_text_projection_bias_is_caught(tiny_checkpoint):
    m = load_model(tiny_checkpoint, code2wav=False)
    check_text_projection_bias(m.talker, tiny_checkpoint / "model.safetensors")
    with torch.no_grad():
        m.talker.text_projection.linear_fc2.bias.zero_()
    with pytest.raises(CheckpointError, match=r"text_projection\.linear_fc2\.bias"):
        check_text_projection_bias(m.talker, tiny_checkpoint / "model.safetensors")


@pytest.mark.parametrize("part", ["talker", "code_predictor", "code2wav"])
def test_zeroed_rope_frequencies_are_caught(tiny_checkpoint, part):
    m = load_model(tiny_checkpoint)
    check_rope(m.config, m.talker, m.code2wav)
    module = {"talker": m.talker.model, "code_predictor": m.talker.code_predictor, "code2wav": m.code2wav}[part]
    for name, buf in module.named_buffers():
        if name.endswith("inv_freq"):
            buf.zero_()
    with pytest.raises(CheckpointError, match="RoPE inverse frequencies"):
        check_rope(m.config, m.talker, m.code2wav)


@pytest.mark.parametrize("size", ["tiny", "tiny-mtp", "0.6b", "1.7b"])
def test_our_modules_match_the_spec_at_every_size(size):
    # Built on the meta device: shapes only, no memory, so CI checks the full sizes without GBs of weights.
    cfg = model_config(size)
    with torch.device("meta"):
        talker, enc, dec = (
            Talker(cfg.talker),
            SpeakerEncoder(cfg.speaker_encoder),
            Code2Wav(cfg.speech_tokenizer.decoder),
        )
    assert _shapes(talker) == talker_spec(cfg.talker)
    assert _shapes(enc) == speaker_encoder_spec(cfg.speaker_encoder)
    assert _shapes(dec) == code2wav_spec(cfg.speech_tokenizer.decoder)
    has_projection = "code_predictor.small_to_mtp_projection.weight" in _shapes(talker)
    assert has_projection == (size in ("1.7b", "tiny-mtp"))
