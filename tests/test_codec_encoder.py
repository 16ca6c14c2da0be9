"""The 12 Hz codec encoder (qwen_tts/model/codec_encoder.py): parity with the official qwen-tts 0.1.1 on the tiny
random checkpoint, against the committed fixture, and the loading of the released layout.

The fixture (tests/reference/fixture_encoder_tiny.pt) was recorded by tests/reference/make_encoder_fixture.py in the
reference venv; the clips are made again here by tests/reference/encoder_clips.py. Codes must be equal and the latents
within torch.testing.assert_close float32 defaults (rtol 1.3e-6, atol 1e-5).
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from reference_helpers import load_reference_fixture
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from qwen_tts.audio import to_mono
from qwen_tts.model.codec_encoder import (
    CodecEncoder,
    MimiEncoderConfig,
    load_codec_encoder,
    read_encoder_config,
    unused_tensor_prefixes,
)
from qwen_tts.model.loading import CheckpointError
from qwen_tts.model.model_paths import resolve_model_path
from qwen_tts.model.random_checkpoint import mimi_encoder_spec, speech_tokenizer_config_dict

REFERENCE = Path(__file__).parent / "reference"
FIXTURE = REFERENCE / "fixture_encoder_tiny.pt"
REGENERATE = (
    ".venv-ref/bin/python tests/reference/make_encoder_fixture.py --out tests/reference/fixture_encoder_tiny.pt"
)


def _clips_module():
    spec = importlib.util.spec_from_file_location("encoder_clips", REFERENCE / "encoder_clips.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


clips = _clips_module()


@pytest.fixture(scope="module")
def ref(tiny_checkpoint: Path) -> dict:
    return load_reference_fixture(FIXTURE, tiny_checkpoint, REGENERATE)


@pytest.fixture(scope="module")
def encoder(tiny_checkpoint: Path) -> CodecEncoder:
    return load_codec_encoder(tiny_checkpoint)


def _clip(case: dict) -> np.ndarray:
    wav = clips.make_clip(case["name"], case["sample_rate"], case["channels"], case["samples"])
    # The recording venv made the same clip (a different numpy may compute its sines a rounding apart, no more).
    assert_close(torch.from_numpy(clips.fingerprint(wav)), case["fingerprint"], msg=lambda m: f"{case['name']}: {m}")
    return wav


def test_fixture_covers_rates_channels_and_lengths(ref):
    cases = ref["clips"]
    assert len(cases) == len(clips.CLIPS)
    for rate in (16000, 24000, 44100):
        at_rate = [c for c in cases if c["sample_rate"] == rate]
        assert {c["channels"] for c in at_rate} == {1, 2}, rate
        seconds = [c["samples"] / rate for c in at_rate]
        assert min(seconds) < 1.0 and max(seconds) > 2.0, rate
    assert max(c["samples"] / c["sample_rate"] for c in cases) > 10.0  # past the transformer's sliding window
    assert any(c["samples"] % 1920 for c in cases if c["sample_rate"] == 24000)
    assert ref["meta"]["qwen_tts"] == "0.1.1"


@pytest.mark.parametrize("index", range(len(clips.CLIPS)), ids=[c[0] for c in clips.CLIPS])
def test_codes_equal_the_official_encoder(encoder, ref, index):
    case = ref["clips"][index]
    codes = encoder.encode(_clip(case), case["sample_rate"])
    want = case["codes"].long()
    assert codes.dtype == torch.int64 and codes.device.type == "cpu"
    samples_24k = math.ceil(case["samples"] * (24000 / case["sample_rate"]))
    assert codes.shape == want.shape == (encoder.frames(samples_24k), 16)
    assert torch.equal(codes, want), f"{(codes != want).sum()} of {want.numel()} codes differ"


@pytest.mark.parametrize("index", range(len(clips.CLIPS)), ids=[c[0] for c in clips.CLIPS])
def test_latents_match_the_official_encoder(encoder, ref, index):
    case = ref["clips"][index]
    latents = encoder.latents(_clip(case), case["sample_rate"])
    assert latents.dtype == torch.float32
    assert_close(latents, case["latents"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_codes_on_cuda_equal_the_official_encoder(tiny_checkpoint, ref, monkeypatch):
    # TF32 convolutions and matmuls round differently from the float32 reference: off, as in
    # test_snake_kernel.py.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    encoder = load_codec_encoder(tiny_checkpoint, device="cuda")
    assert encoder.device.type == "cuda"
    for case in ref["clips"]:
        codes = encoder.encode(_clip(case), case["sample_rate"])
        assert codes.device.type == "cpu"
        assert torch.equal(codes, case["codes"].long()), case["name"]
        assert_close(encoder.latents(_clip(case), case["sample_rate"]), case["latents"])


def test_codes_quantize_the_latents(encoder, ref):
    """The first code of each frame is the nearest semantic entry to the projected latent (recomputed directly)."""
    case = ref["clips"][0]
    latents = encoder.latents(_clip(case), case["sample_rate"])
    rvq = encoder.quantizer.semantic_residual_vector_quantizer
    projected = rvq.input_proj(latents.T[None])[0].T  # (T, codebook_dim)
    entries = rvq.layers[0].codebook.entries()
    nearest = ((projected[:, None] - entries[None]) ** 2).sum(-1).argmin(-1)
    assert torch.equal(nearest, encoder.encode(_clip(case), case["sample_rate"])[:, 0])
    assert len(set(nearest.tolist())) > 1


def test_input_forms_agree(encoder):
    """numpy or torch, (N,) or (N, 1): the same codes; (N, 2) is the channel mean (`qwen_tts.audio.to_mono`)."""
    wav = clips.make_clip("forms", 22050, 2, 20_000)
    mono = to_mono(wav)
    want = encoder.encode(mono, 22050)
    assert want.shape == (encoder.frames(-(-20_000 * 24000 // 22050)), 16)
    assert torch.equal(encoder.encode(torch.from_numpy(mono), 22050), want)
    assert torch.equal(encoder.encode(mono[:, None], 22050), want)
    assert torch.equal(encoder.encode(wav, 22050), want)
    assert torch.equal(encoder.encode(torch.from_numpy(wav), 22050), want)
    assert torch.equal(encoder.encode(torch.from_numpy(wav).double(), 22050), want)
    # float64 input is averaged in float64 before the cast, as the official front end does.
    wide = wav.astype(np.float64) + np.float64(1e-9)
    assert_close(
        encoder.latents(wide, 22050), encoder.latents(wide.mean(axis=1).astype(np.float32), 22050), rtol=0, atol=0
    )


@pytest.mark.parametrize(
    ("wav", "rate", "match"),
    [
        (np.zeros(0, np.float32), 24000, "empty"),
        (np.zeros((2, 3, 4), np.float32), 24000, "shape"),
        (np.zeros(100, np.int16), 24000, "float"),
        (torch.zeros(100, dtype=torch.int16), 24000, "float"),
        (np.array([0.0, np.nan], np.float32), 24000, "NaN"),
        (np.zeros(100, np.float32), 0, "sample_rate"),
    ],
)
def test_bad_audio_is_refused(encoder, wav, rate, match):
    with pytest.raises(ValueError, match=match):
        encoder.encode(wav, rate)


@pytest.mark.parametrize("index", range(3), ids=["tiny", "1.7b", "defaults"])
def test_config_reads_as_the_official_config_classes_do(ref, index):
    """Each field as transformers' MimiConfig (inside the official tokenizer config) holds it, defaults included."""
    case = ref["configs"][index]
    cfg = MimiEncoderConfig.from_tokenizer_dict(json.loads(case["config_json"]))
    official = case["official"]
    ours = {k: getattr(cfg, k) for k in official}
    ours["upsampling_ratios"] = list(cfg.upsampling_ratios)
    assert ours == official
    assert cfg.downsample_kernel == 4


def test_loads_the_demo_checkpoint_and_a_tokenizer_folder(tmp_path, encoder):
    wav = clips.make_clip("demo", 24000, 1, 4000)
    want = encoder.encode(wav, 24000)
    demo = resolve_model_path("demo", demo_dir=tmp_path / "demo")
    assert torch.equal(load_codec_encoder(demo).encode(wav, 24000), want)
    # A speech tokenizer folder alone (as the Qwen3-TTS-Tokenizer-12Hz repository ships it).
    assert torch.equal(load_codec_encoder(demo / "speech_tokenizer").encode(wav, 24000), want)


def test_released_layout_with_32_quantizers_keeps_the_first_16(tiny_copy, encoder):
    """The released tokenizer has 32 quantizers (31 acoustic) and keeps 16: the extra codebooks are in the file and
    never change the codes."""
    st = tiny_copy / "speech_tokenizer"
    cfg = json.loads((st / "config.json").read_text())
    assert cfg["encoder_config"]["num_quantizers"] == 16
    cfg["encoder_config"]["num_quantizers"] = 32
    (st / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(st / "model.safetensors")
    p = "encoder.quantizer.acoustic_residual_vector_quantizer.layers"
    g = torch.Generator().manual_seed(3)
    for i in range(15, 31):
        tensors[f"{p}.{i}.codebook.embed_sum"] = torch.randn(2048, 8, generator=g)
        tensors[f"{p}.{i}.codebook.cluster_usage"] = torch.rand(2048, generator=g) + 0.5
        tensors[f"{p}.{i}.codebook.initialized"] = torch.ones(1)
    save_file(tensors, st / "model.safetensors")
    wav = clips.make_clip("released", 16000, 1, 30_000)
    loaded = load_codec_encoder(tiny_copy)
    assert len(loaded.quantizer.acoustic_residual_vector_quantizer.layers) == 15
    assert torch.equal(loaded.encode(wav, 16000), encoder.encode(wav, 16000))


@pytest.mark.parametrize("size", ["0.6b", "1.7b"])
def test_full_size_layout_matches_the_checkpoint_names(size):
    """On the released shapes: every tensor the encoder holds is in the checkpoint's `encoder.*` with the same shape,
    and every other `encoder.*` tensor is one that encoding never reads."""
    st = speech_tokenizer_config_dict(size)
    cfg = MimiEncoderConfig.from_tokenizer_dict(st)
    assert (cfg.num_quantizers, cfg.valid_quantizers, cfg.hidden_size, cfg.downsample_kernel) == (32, 16, 512, 4)
    with torch.device("meta"):
        ours = {f"encoder.{k}": tuple(v.shape) for k, v in CodecEncoder(cfg).state_dict().items()}
    spec = {f"encoder.{k}": v for k, v in mimi_encoder_spec(st["encoder_config"]).items()}
    assert {k: spec.get(k) for k in ours} == ours
    unused = unused_tensor_prefixes(cfg)
    left = [k for k in spec if k not in ours]
    assert left and all(k.startswith(unused) for k in left)
    assert not any(k.startswith(unused) for k in ours)


def test_missing_or_misshapen_tensors_are_refused(tiny_copy):
    st = tiny_copy / "speech_tokenizer" / "model.safetensors"
    tensors = load_file(st)
    name = "encoder.encoder_transformer.layers.0.mlp.fc1.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, st)
    with pytest.raises(CheckpointError, match="wrong tensor shapes"):
        load_codec_encoder(tiny_copy)
    del tensors[name]
    save_file(tensors, st)
    with pytest.raises(CheckpointError, match="missing tensors"):
        load_codec_encoder(tiny_copy)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("use_streaming", True, "use_streaming"),
        ("num_key_value_heads", 3, "num_key_value_heads"),
        ("hidden_act", "relu", "hidden_act"),
        ("upsampling_ratios", [8, 6, 5, 2], "encode_downsample_rate"),
    ],
)
def test_unsupported_encoder_configs_are_refused(tiny_copy, key, value, match):
    path = tiny_copy / "speech_tokenizer" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["encoder_config"][key] = value
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        read_encoder_config(tiny_copy)


def test_a_checkpoint_without_a_speech_tokenizer_is_refused(tiny_copy):
    shutil.rmtree(tiny_copy / "speech_tokenizer")
    with pytest.raises(CheckpointError, match="speech_tokenizer"):
        load_codec_encoder(tiny_copy)
