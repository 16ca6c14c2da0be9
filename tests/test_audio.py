"""Audio input: reading common formats, mono mix-down, soxr resampling to 24 kHz."""

import io

import numpy as np
import pytest
import soundfile as sf
from media_helpers import ffmpeg_clip

from qwen_tts.audio import (
    ACCEPTED_FORMATS,
    ACCEPTED_SUBTYPES,
    MAX_CHANNELS,
    MAX_SAMPLE_RATE,
    AudioError,
    AudioTooLong,
    load_audio,
    load_mono_24k,
    read_mono,
    resample,
    sniff_format,
    to_mono,
)
from qwen_tts.audio import SAMPLE_RATE as TARGET_SR

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


# --- read_mono: clips from outside, checked from the header, decoded in blocks ---------------------------------
def encoded(x: np.ndarray, sr: int, fmt: str, subtype: str | None = None) -> io.BytesIO:
    buf = io.BytesIO()
    sf.write(buf, x, sr, format=fmt, subtype=subtype)
    buf.seek(0)
    return buf


@pytest.mark.parametrize(
    ("fmt", "subtype", "sr", "channels"),
    [
        ("WAV", "PCM_16", 44100, 2),
        ("WAV", "FLOAT", 48000, 8),
        ("WAVEX", "PCM_24", 96000, 3),
        ("FLAC", "PCM_24", 22050, 5),
        ("OGG", "VORBIS", 48000, 2),
        ("OGG", "OPUS", 48000, 1),
        ("MP3", "MPEG_LAYER_III", 44100, 2),
        ("MP3", "MPEG_LAYER_III", 22050, 2),  # MPEG-2: decodes differently unless sought to the start first
    ],
)
@pytest.mark.parametrize("block_frames", [1000, 4096, 1 << 16])
def test_read_mono_is_bit_identical_to_reading_whole_then_to_mono(fmt, subtype, sr, channels, block_frames):
    x = tone(220.0, sr, 1.3, channels) * 2.2  # past full scale: some samples clip
    buf = encoded(x, sr, fmt, subtype)
    whole, whole_sr = load_audio(io.BytesIO(buf.getvalue()))
    got = read_mono(buf, clip_level=0.999, block_frames=block_frames)
    assert (got.sample_rate, got.channels, got.format, got.subtype) == (whole_sr, channels, fmt, subtype)
    assert got.samples.dtype == np.float32 and got.frames == whole.shape[0]
    np.testing.assert_array_equal(got.samples, to_mono(whole))  # the model's parity: the same bits
    assert got.clipped == np.count_nonzero(np.abs(whole) >= 0.999) > 0


def test_read_mono_reads_a_path_and_an_empty_file(tmp_path):
    path = tmp_path / "a.flac"
    sf.write(path, tone(300.0, 16000, 0.5, 2), 16000)
    got = read_mono(path)
    assert (got.frames, got.channels, got.sample_rate) == (8000, 2, 16000)
    empty = read_mono(encoded(np.zeros((0, 2), np.float32), 16000, "WAV"))
    assert empty.frames == 0 and empty.samples.shape == (0,)
    with pytest.raises(OSError):
        read_mono(tmp_path / "missing.wav")


def _flac_of_unknown_length() -> io.BytesIO:
    # STREAMINFO's 36-bit total-samples field zeroed, as an encoder writing to a pipe leaves it.
    data = bytearray(encoded(tone(300.0, 16000, 1.0), 16000, "FLAC").getvalue())
    assert data[:4] == b"fLaC"
    packed = int.from_bytes(data[18:26], "big") & ~((1 << 36) - 1)
    data[18:26] = packed.to_bytes(8, "big")
    return io.BytesIO(bytes(data))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: encoded(tone(300.0, 16000, 0.5), 16000, "AIFF", "PCM_16"),
            f"AIFF (PCM_16) is not an accepted format; accepted: {ACCEPTED_FORMATS}",
        ),
        (
            lambda: encoded(tone(300.0, 16000, 0.5), 16000, "WAV", "GSM610"),
            f"WAV (GSM610) is not an accepted format; accepted: {ACCEPTED_FORMATS}",
        ),
        (
            lambda: encoded(np.zeros((100, 9), np.float32), 16000, "WAV"),
            "9 channels; the limit is 8 (mix it down to mono first)",
        ),
        (
            lambda: encoded(np.zeros((100, 1), np.float32), 384000, "WAV"),
            "sample rate 384000 Hz; the limit is 192000 Hz (resample it first, e.g. to 48000 Hz)",
        ),
        (
            _flac_of_unknown_length,
            "its header does not give its length (a stream written without seeking back?); re-encode it, "
            "e.g. ffmpeg -i clip.flac clip.wav",
        ),
        (
            lambda: io.BytesIO(b"\x00\x00\x00\x1cftypisom\x00\x00\x02\x00isomiso2mp41" + bytes(100)),
            "cannot decode this file as MP4/M4A audio (Invalid data found when processing input)",
        ),
        (
            lambda: io.BytesIO(b"\x1a\x45\xdf\xa3" + bytes(100)),
            "cannot decode this file as WebM/Matroska audio (Invalid data found when processing input)",
        ),
        (
            lambda: io.BytesIO(b"this is not audio at all" * 10),
            f"cannot decode this file as audio (not one of {ACCEPTED_FORMATS}; libsndfile: Format not recognised)",
        ),
        (
            lambda: io.BytesIO(encoded(tone(300.0, 16000, 0.5), 16000, "WAV").getvalue()[:30]),
            f"cannot decode this file as audio (not one of {ACCEPTED_FORMATS}; libsndfile: Error in WAV file. No "
            "'data' chunk marker)",
        ),
    ],
    ids=["aiff", "gsm-wav", "channels", "rate", "unknown-length", "m4a", "webm", "junk", "truncated"],
)
def test_read_mono_refuses_from_the_header_in_one_line_without_a_repr(monkeypatch, make, message):
    def must_not_decode(*args, **kwargs):
        raise AssertionError("decoded a clip its header already refuses")

    source = make()
    monkeypatch.setattr(sf.SoundFile, "read", must_not_decode)
    with pytest.raises(AudioError) as e:
        read_mono(source)
    assert str(e.value) == message
    assert "0x" not in str(e.value) and "object at" not in str(e.value)


def test_read_mono_refuses_a_long_clip_from_its_header(monkeypatch):
    monkeypatch.setattr(sf.SoundFile, "read", lambda *a, **k: pytest.fail("decoded a clip too long by its header"))
    with pytest.raises(AudioTooLong) as e:
        read_mono(encoded(np.zeros(16000 * 3 + 1, np.float32), 16000, "WAV"), max_seconds=3.0)
    assert e.value.seconds == pytest.approx(3.0 + 1 / 16000)


def test_read_mono_refuses_non_finite_samples_and_unreadable_messages_carry_no_repr():
    x = np.zeros((5000, 2), dtype=np.float32)
    x[4500, 1] = np.inf
    with pytest.raises(AudioError, match=r"^audio contains NaN or infinite samples$"):
        read_mono(encoded(x, 16000, "WAV", "FLOAT"), block_frames=1024)
    with pytest.raises(AudioError) as e:
        load_audio(io.BytesIO(b"junk" * 100))
    assert str(e.value) == "<stream>: not a readable audio file (Format not recognised)"


def test_accepted_subtypes_are_all_readable_here():
    for fmt, subtypes in ACCEPTED_SUBTYPES.items():
        assert fmt in sf.available_formats()
        assert subtypes <= set(sf.available_subtypes(fmt)), fmt
    assert MAX_CHANNELS == 8 and MAX_SAMPLE_RATE == 192_000


# --- containers libsndfile cannot read, through FFmpeg (PyAV) ------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "container", "codec", "rate", "slack"),
    [
        ("m4a", "MP4/M4A", "AAC", 44100, 2048),  # AAC: 1024 samples of priming and the last frame's padding
        ("alac.m4a", "MP4/M4A", "ALAC", 44100, 0),
        ("aac", "AAC (ADTS)", "AAC", 44100, 2048),
        ("webm", "WebM/Matroska", "OPUS", 48000, 0),
    ],
)
def test_read_mono_decodes_phone_and_browser_recordings(kind, container, codec, rate, slack):
    x = tone(440.0, 44100, 2.0, channels=2)
    clip = read_mono(io.BytesIO(ffmpeg_clip(x, 44100, kind)), max_seconds=60)
    assert (clip.format, clip.subtype, clip.sample_rate, clip.channels) == (container, codec, rate, 2)
    expected = round(len(x) * rate / 44100)
    assert expected <= clip.frames <= expected + slack
    # The channel mean of 0.5 and 0.25 sines is a 0.375 sine at 440 Hz: RMS 0.265.
    assert np.sqrt(np.mean(clip.samples**2)) == pytest.approx(0.375 / np.sqrt(2), rel=0.05)
    assert dominant_hz(clip.samples, rate) == pytest.approx(440.0, abs=2.0)
    assert clip.clipped == 0


def test_read_mono_refuses_a_long_m4a_from_its_header_and_a_live_webm_as_it_decodes(monkeypatch):
    long_m4a = ffmpeg_clip(tone(300.0, 16000, 4.0), 16000, "m4a")
    monkeypatch.setattr("av.container.InputContainer.demux", lambda *a, **k: pytest.fail("decoded a clip too long"))
    with pytest.raises(AudioTooLong) as e:
        read_mono(io.BytesIO(long_m4a), max_seconds=3.0)
    assert e.value.seconds == pytest.approx(4.0, abs=0.1)
    monkeypatch.undo()
    # A browser's WebM states no duration: the decoded length is counted, and decoding stops just past the limit.
    live = ffmpeg_clip(tone(300.0, 16000, 10.0), 16000, "webm", live=True)
    with pytest.raises(AudioTooLong) as e:
        read_mono(io.BytesIO(live), max_seconds=3.0)
    assert 3.0 < e.value.seconds < 3.1


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: ffmpeg_clip(tone(300.0, 16000, 2.0), 16000, "m4a")[:400],
            "cannot decode 'memo.m4a' as MP4/M4A audio (Invalid data found when processing input)",
        ),
        (
            lambda: ffmpeg_clip(tone(300.0, 48000, 1.0), 48000, "ac3.mp4"),
            f"MP4/M4A with ac3 audio is not an accepted format; accepted: {ACCEPTED_FORMATS}",
        ),
        (
            lambda: b"\xff\xf1" + bytes(range(256)) * 4,
            "cannot decode 'memo.m4a' as AAC (ADTS) audio (its header gives no sample rate or channel count)",
        ),
        (
            lambda: ffmpeg_clip(tone(300.0, 16000, 1.0, channels=1), 16000, "webm")[:60],
            "cannot decode 'memo.m4a' as WebM/Matroska audio (",  # then FFmpeg's reason, which varies by version
        ),
    ],
    ids=["truncated-m4a", "ac3-in-mp4", "adts-garbage", "truncated-webm"],
)
def test_broken_or_unaccepted_ffmpeg_input_is_one_line_naming_file_and_format(make, message):
    """What the file is comes from its content (an ADTS stream named .m4a is read as ADTS); the name is quoted."""
    with pytest.raises(AudioError) as e:
        read_mono(io.BytesIO(make()), max_seconds=60, name="memo.m4a")
    assert str(e.value) == message if message.endswith(")") else str(e.value).startswith(message)
    assert "0x" not in str(e.value) and "object at" not in str(e.value)


def test_sniff_format_tells_audio_by_its_first_bytes():
    x = tone(300.0, 16000, 0.5)
    assert sniff_format(encoded(x, 16000, "WAV").getvalue()[:12]) == "WAV"
    assert sniff_format(encoded(x, 16000, "FLAC").getvalue()[:12]) == "FLAC"
    assert sniff_format(encoded(x, 16000, "MP3").getvalue()[:12]) == "MP3"
    assert sniff_format(ffmpeg_clip(x, 16000, "m4a")[:12]) == "MP4/M4A"
    assert sniff_format(ffmpeg_clip(x, 16000, "aac")[:12]) == "AAC (ADTS)"
    assert sniff_format(ffmpeg_clip(x, 16000, "webm")[:12]) == "WebM/Matroska"
    assert sniff_format(b"clip.wav|ann|Hello") is None
    assert sniff_format("ünïcode list".encode()) is None
