"""Mel front end (filterbank, log-mel framing) and the ECAPA-TDNN speaker encoder."""

import math

import pytest
import torch

from qwen_tts.model.config import SpeakerEncoderConfig
from qwen_tts.model.mel import mel_filterbank, mel_frames, mel_spectrogram, min_samples_for_frames
from qwen_tts.model.speaker_encoder import SpeakerEncoder


def test_filterbank_shape_and_non_negative():
    fb = mel_filterbank()
    assert fb.shape == (128, 513)
    assert fb.dtype == torch.float32
    assert fb.min() >= 0
    assert (fb.sum(dim=1) > 0).all()  # no empty filter at 128 mels / 1024-point FFT


def test_filterbank_slaney_normalisation_gives_unit_area():
    # Each triangle has peak 2/width (Hz), so its area in Hz is 1: sum(weights) * bin spacing == 1
    # once the FFT bins are fine enough to sample every triangle well.
    fb = mel_filterbank(sr=24000, n_fft=8192)
    area = fb.sum(dim=1) * (24000 / 8192)
    torch.testing.assert_close(area, torch.ones(128), atol=2e-3, rtol=0)


def test_filterbank_matches_librosa_values():
    # librosa 0.11.0 filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000), a few entries.
    fb = mel_filterbank()
    expected = {
        (0, 1): 0.03355042636394501,
        (0, 2): 0.00856908317655325,
        (10, 12): 0.02425544150173664,
        (60, 80): 0.01747637428343296,
        (127, 486): 0.00027299943030811846,
    }
    for (m, k), v in expected.items():
        assert fb[m, k].item() == pytest.approx(v, rel=1e-6)
    assert fb[0, 0] == 0 and fb[0, 3] == 0  # filter 0 spans only bins 1..2
    assert fb[127, 484] == 0


def test_mel_frames_formula():
    for n in (385, 512, 1000, 24000, 24000 * 3 + 17):
        mel = mel_spectrogram(torch.zeros(2, n))
        assert mel.shape == (2, mel_frames(n), 128)
        assert mel_frames(n) == (n + 768 - 1024) // 256 + 1


def test_silence_log_mel_is_the_floor():
    # sqrt(1e-9) magnitude times a row sum of ~0.042 is below the 1e-5 clamp: every bin is log(1e-5).
    mel = mel_spectrogram(torch.zeros(1, 4000))
    torch.testing.assert_close(mel, torch.full_like(mel, math.log(1e-5)))


def test_tone_lands_in_its_mel_band():
    t = torch.arange(24000) / 24000
    mel = mel_spectrogram(0.5 * torch.sin(2 * math.pi * 1000 * t)[None])
    band = mel[0, 10:-10].mean(dim=0).argmax().item()
    centres = mel_filterbank().argmax(dim=1) * (24000 / 1024)  # Hz of each filter's peak bin
    assert abs(centres[band].item() - 1000) < 60


def tiny_encoder(seed: int = 0) -> SpeakerEncoder:
    cfg = SpeakerEncoderConfig(
        enc_dim=24,
        enc_channels=(32, 32, 32, 32, 96),
        enc_attention_channels=16,
        enc_res2net_scale=4,
        enc_se_channels=8,
    )
    model = SpeakerEncoder(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 3:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1] * p.shape[2]))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def test_state_dict_keys_mirror_checkpoint_names():
    keys = set(SpeakerEncoder(SpeakerEncoderConfig(enc_dim=16)).state_dict())
    assert {
        "blocks.0.conv.weight",
        "blocks.1.tdnn1.conv.weight",
        "blocks.1.res2net_block.blocks.6.conv.bias",
        "blocks.3.se_block.conv2.weight",
        "blocks.3.tdnn2.conv.bias",
        "mfa.conv.weight",
        "asp.tdnn.conv.weight",
        "asp.conv.bias",
        "fc.weight",
    } <= keys
    assert len(keys) == 2 * (1 + 3 * (1 + 7 + 1 + 2) + 1 + 2 + 1)  # weight + bias per conv


def test_embed_shape_dtype_and_determinism():
    model = tiny_encoder()
    wav = 0.3 * torch.randn(24000, generator=torch.Generator().manual_seed(1))
    a, b = model.embed(wav), model.embed(wav.clone())
    assert a.shape == (24,) and a.dtype == torch.float32
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)
    torch.testing.assert_close(a, model(mel_spectrogram(wav[None]))[0])


def test_embedding_depends_on_the_voice():
    model = tiny_encoder()
    g = torch.Generator().manual_seed(2)
    t = torch.arange(24000) / 24000
    low = 0.3 * torch.sin(2 * math.pi * 150 * t) + 0.01 * torch.randn(24000, generator=g)
    high = 0.3 * torch.sin(2 * math.pi * 2500 * t) + 0.01 * torch.randn(24000, generator=g)
    a, b = model.embed(low), model.embed(high)
    assert (a - b).abs().max() > 0.05 * a.abs().max()


def test_batched_forward_equals_per_row():
    model = tiny_encoder()
    mel = mel_spectrogram(0.3 * torch.randn(3, 8000, generator=torch.Generator().manual_seed(3)))
    with torch.no_grad():
        batched = model(mel)
        rows = torch.cat([model(mel[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(batched, rows)


def test_too_short_audio_is_a_clear_error():
    model = tiny_encoder()
    need = model.min_samples
    assert need == min_samples_for_frames(5) == 1280  # reflect pad 4 frames in the dilation-4 Res2Net convs
    model.embed(torch.zeros(need))
    with pytest.raises(ValueError, match="too short"):
        model.embed(torch.zeros(need - 1))
    with pytest.raises(ValueError, match="mono"):
        model.embed(torch.zeros(2, need))
