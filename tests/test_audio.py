"""Audio input: reading common formats, mono mix-down, soxr resampling to 24 kHz."""

import io

import numpy as np
import pytest
import soundfile as sf

from qwen_tts.audio import SAMPLE_RATE as TARGET_SR
from qwen_tts.audio import AudioError, load_audio, load_mono_24k, resample, to_mono

FORMATS = [
    ("wav", "WAV", "PCM_16", 1e-4),
    ("flac", "FLAC", "PCM_24", 1e-6),
    ("ogg", "OGG", "VORBIS", None),
    ("mp3", "MP3", "MPEG_LAYER_III", None),
]


def tone(freq: float, sr: int, seconds: float, channels: int = 1) -> np.ndarray:
    t = np.arange(int(sr * seconds)) / sr
    x = 0.5 * np.sin(2 * np.pi * freq * t).astype(np.float32)
    # Channel c is scaled by (c + 1) / channels, so channels differ and the mono mean has a known level.
    return np.stack([x * (c + 1) / channels for c in range(channels)], axis=1)


def dominant_hz(x: np.ndarray, sr: int) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spec) * sr / len(x))


@pytest.mark.parametrize("ext,fmt,subtype,tol", FORMATS, ids=[f[0] for f in FORMATS])
@pytest.mark.parametrize("sr,channels", [(16000, 1), (44100, 2), (48000, 2)])
def test_load_audio_reads_format_rate_and_channels(tmp_path, ext, fmt, subtype, tol, sr, channels):
    if fmt not in sf.available_formats():
        pytest.skip(f"libsndfile here cannot handle {fmt}")
    x = tone(440.0, sr, 0.5, channels)
    path = tmp_path / f"clip.{ext}"
    sf.write(path, x, sr, format=fmt, subtype=subtype)
    data, got_sr = load_audio(path)
    assert got_sr == sr
    assert data.dtype == np.float32 and data.ndim == 2 and data.shape[1] == channels
    if tol is not None:  # lossless: samples come back
        np.testing.assert_allclose(data, x, atol=tol)
    else:  # lossy codecs may pad or delay; the tone and its level survive
        assert abs(data.shape[0] - x.shape[0]) < 0.1 * sr
        assert abs(dominant_hz(data[:, -1], sr) - 440.0) < 5.0
        assert 0.3 < np.abs(data[:, -1]).max() < 0.7


def test_load_audio_accepts_file_objects():
    buf = io.BytesIO()
    sf.write(buf, tone(300.0, 22050, 0.2), 22050, format="WAV")
    buf.seek(0)
    data, sr = load_audio(buf)
    assert sr == 22050 and data.shape == (4410, 1)


def test_unreadable_files_raise_audio_error(tmp_path):
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"this is not audio at all" * 10)
    with pytest.raises(AudioError, match=r"junk\.wav: not a readable audio file"):
        load_audio(junk)
    with pytest.raises(AudioError, match="not a readable audio file"):
        load_audio(tmp_path / "missing.flac")


def test_non_finite_samples_are_rejected(tmp_path):
    x = np.zeros((100, 1), dtype=np.float32)
    x[50] = np.nan
    path = tmp_path / "nan.wav"
    sf.write(path, x, 16000, subtype="FLOAT")
    with pytest.raises(AudioError, match="NaN"):
        load_audio(path)


def test_to_mono_averages_channels():
    x = np.array([[1.0, 0.0, -0.5], [0.2, 0.4, 0.6]], dtype=np.float32)
    np.testing.assert_allclose(to_mono(x), [1.0 / 6.0, 0.4], rtol=1e-6)
    mono = np.array([0.1, -0.2], dtype=np.float64)
    assert to_mono(mono).dtype == np.float32
    with pytest.raises(ValueError):
        to_mono(np.zeros((2, 2, 2)))


@pytest.mark.parametrize("sr_in,n", [(44100, 44100), (16000, 12345), (48000, 7), (8000, 1), (22050, 0)])
def test_resample_length_is_ceil_of_ratio_like_librosa(sr_in, n):
    y = resample(np.zeros(n, dtype=np.float32), sr_in)
    # librosa multiplies by the float ratio, so 44100 samples at 44.1 kHz give ceil(24000.000000000004) = 24001.
    assert y.shape == (int(np.ceil(n * (TARGET_SR / sr_in))),)
    assert y.dtype == np.float32


def test_resample_same_rate_is_identity():
    x = np.linspace(-1, 1, 100, dtype=np.float32)
    np.testing.assert_array_equal(resample(x, 24000, 24000), x)


def test_stereo_44k_tone_becomes_24k_mono_with_same_pitch(tmp_path):
    path = tmp_path / "tone.wav"
    sf.write(path, tone(440.0, 44100, 1.0, channels=2), 44100, subtype="FLOAT")
    y = load_mono_24k(path)
    assert y.shape == (24001,) and y.dtype == np.float32  # librosa's float-ratio ceil, see above
    assert dominant_hz(y, TARGET_SR) == pytest.approx(440.0, abs=1.0)
    # Channels at 0.5 and 1.0 of the 0.5 amplitude: the mean has amplitude 0.375, kept by the resampler.
    assert np.abs(y[1000:-1000]).max() == pytest.approx(0.375, abs=0.005)


def test_resample_keeps_channels():
    x = tone(1000.0, 16000, 0.25, channels=2)
    y = resample(x, 16000)
    assert y.shape == (6000, 2)
    assert dominant_hz(y[:, 1], TARGET_SR) == pytest.approx(1000.0, abs=4.0)
