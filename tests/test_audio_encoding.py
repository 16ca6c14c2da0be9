"""Audio encoding: every format decodes back to the signal, streams decode like whole files, clipping is safe."""

from __future__ import annotations

import io
import wave

import av
import numpy as np
import pytest
import soundfile as sf

from tts_server.audio_encoding import (
    FORMATS,
    StreamEncoder,
    UnsupportedFormatError,
    encode,
    get_format,
    streaming_wav_header,
    to_int16,
)

SR = 24000


def _tone(seconds: float = 1.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(SR * seconds)) / SR
    return (amp * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def _decode(data: bytes) -> tuple[np.ndarray, int]:
    x, sr = sf.read(io.BytesIO(data), dtype="float32")
    return x, sr


def test_all_formats_the_api_promises_are_available() -> None:
    # Fails loudly on a libsndfile without MP3/Opus, instead of the server refusing them at run time.
    assert {"wav", "pcm", "f32le", "flac", "mp3", "opus", "aac"} <= set(FORMATS)


def test_unknown_format_names_the_available_ones() -> None:
    with pytest.raises(UnsupportedFormatError, match=r"'m4a' is not supported.*aac.*mp3"):
        get_format("m4a")


def _decode_aac(data: bytes) -> np.ndarray:
    """An ADTS stream decoded by FFmpeg, as float32 mono (the demuxer named, as a client's player picks it)."""
    with av.open(io.BytesIO(data), format="aac") as container:
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
        assert container.streams.audio[0].sample_rate == SR
    return np.concatenate(frames)


def test_whole_wav_has_a_length_correct_header() -> None:
    x = _tone(1.5)
    data = encode(x, "wav", SR)
    assert int.from_bytes(data[4:8], "little") == len(data) - 8  # RIFF size
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnframes(), w.getframerate(), w.getnchannels(), w.getsampwidth()) == (len(x), SR, 1, 2)


def test_aac_is_adts_and_decodes_to_the_signal_length() -> None:
    x = _tone(1.0)
    data = encode(x, "aac", SR)
    assert data[0] == 0xFF and data[1] & 0xF6 == 0xF0  # ADTS syncword, layer 0
    assert get_format("aac").media_type == "audio/aac"
    y = _decode_aac(data)
    # AAC's 1024-sample priming and the last frame's padding: under 0.1 s.
    assert len(x) <= len(y) < len(x) + 0.1 * SR
    assert abs(np.sqrt(np.mean(y**2)) - np.sqrt(np.mean(x**2))) < 0.05


def test_streamed_aac_is_incremental_and_equals_the_whole_file() -> None:
    x = _tone(2.0)
    parts = _stream("aac", x, 4800)
    assert sum(len(p) for p in parts[:-1]) > 0.5 * sum(len(p) for p in parts)
    assert b"".join(parts) == encode(x, "aac", SR)


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_lossless_formats_round_trip_to_16_bit_precision(fmt: str) -> None:
    x = _tone()
    y, sr = _decode(encode(x, fmt, SR))
    assert sr == SR and y.shape == x.shape
    np.testing.assert_allclose(y, x, atol=1 / 32767 + 1e-6)


def test_pcm_is_int16_little_endian_and_f32le_is_exact() -> None:
    x = _tone(0.1)
    pcm = np.frombuffer(encode(x, "pcm", SR), dtype="<i2")
    np.testing.assert_array_equal(pcm, np.round(x * 32767).astype(np.int16))
    f32 = np.frombuffer(encode(x, "f32le", SR), dtype="<f4")
    np.testing.assert_array_equal(f32, x)


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_lossy_formats_decode_to_about_the_same_length_and_energy(fmt: str) -> None:
    x = _tone(1.0)
    y, sr = _decode(encode(x, fmt, SR))
    assert sr == SR
    # Encoder delay and padding add at most a few frames.
    assert abs(len(y) - len(x)) < 0.1 * SR
    assert abs(np.sqrt(np.mean(y**2)) - np.sqrt(np.mean(x**2))) < 0.05


def test_out_of_range_samples_are_clipped_not_wrapped() -> None:
    x = np.array([1.5, -1.5, 2.0, 0.25], dtype=np.float32)
    assert to_int16(x).tolist() == [32767, -32767, 32767, 8192]
    y, _ = _decode(encode(x, "wav", SR))
    # A wrapped 1.5 would come back negative.
    assert y[0] > 0.99 and y[1] < -0.99 and y[2] > 0.99


def test_streaming_wav_header_declares_unknown_length() -> None:
    h = streaming_wav_header(SR)
    assert len(h) == 44 and h[:4] == b"RIFF" and h[8:16] == b"WAVEfmt "
    assert h[4:8] == b"\xff\xff\xff\xff" and h[40:44] == b"\xff\xff\xff\xff"
    assert int.from_bytes(h[24:28], "little") == SR


def _stream(fmt: str, x: np.ndarray, chunk: int) -> list[bytes]:
    enc = StreamEncoder(fmt, SR)
    parts = [enc.feed(x[i : i + chunk]) for i in range(0, len(x), chunk)]
    parts.append(enc.close())
    return parts


def test_streamed_wav_is_header_then_int16_samples() -> None:
    x = _tone(0.5)
    data = b"".join(_stream("wav", x, 5000))
    assert data[:44] == streaming_wav_header(SR)
    np.testing.assert_array_equal(np.frombuffer(data[44:], dtype="<i2"), to_int16(x))


def test_streamed_f32le_concatenates_to_the_signal() -> None:
    x = _tone(0.5)
    parts = _stream("f32le", x, 4800)
    assert len([p for p in parts if p]) == 3
    np.testing.assert_array_equal(np.frombuffer(b"".join(parts), dtype="<f4"), x)


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_streamed_lossy_formats_decode_like_whole_files(fmt: str) -> None:
    x = _tone(2.0)
    parts = _stream(fmt, x, 4800)
    # Bytes leave before the end: the stream is really incremental.
    assert sum(len(p) for p in parts[:-1]) > 0
    y, sr = _decode(b"".join(parts))
    whole, _ = _decode(encode(x, fmt, SR))
    assert sr == SR
    # A stream cannot carry the gapless trim (LAME tag) of a whole file: up to ~100 ms of codec delay.
    assert abs(len(y) - len(whole)) < 0.1 * SR
    assert abs(np.sqrt(np.mean(y**2)) - np.sqrt(np.mean(x**2))) < 0.05


def test_streamed_flac_equals_the_whole_file_except_for_the_unknown_totals() -> None:
    x = _tone(2.0)
    parts = _stream("flac", x, 4800)
    assert sum(len(p) for p in parts[:-1]) > 0
    streamed, whole = b"".join(parts), encode(x, "flac", SR)
    assert len(streamed) == len(whole) and streamed[:4] == b"fLaC"
    # STREAMINFO (bytes 8..42) is the only difference: a stream cannot know its total sample count
    # or MD5 up front, and FLAC defines 0 as "unknown" for both.
    info = streamed[8:42]
    assert int.from_bytes(info[13:18], "big") & ((1 << 36) - 1) == 0
    assert streamed[42:] == whole[42:]
    y, _ = _decode(streamed[:8] + whole[8:42] + streamed[42:])
    np.testing.assert_allclose(y, x, atol=1 / 32767 + 1e-6)
