"""Float32 PCM -> response bytes: wav, pcm, flac, mp3, opus, aac, whole or incrementally for streams.

wav, flac, mp3 and opus go through libsndfile (soundfile), aac (an ADTS stream, as OpenAI's `aac`) through FFmpeg's
own AAC encoder (PyAV), which libsndfile lacks. Both are fed our own int16 samples: clipped to [-1, 1] first
(libsndfile's float-to-integer conversion does not clip by default, so an out-of-range sample would wrap
around into a full-scale click), and scaled once, so wav, flac and pcm carry identical samples. `pcm` means raw
signed 16-bit little-endian mono (as OpenAI's `pcm`); `f32le` is raw float32 little-endian, the format of
/synthesize/stream.

A whole wav file has a length-correct header; only a streamed one (`StreamEncoder`) starts with the sizes
0xFFFFFFFF, since its length is not known when the header leaves.
"""

from __future__ import annotations

import importlib.util
import io
import struct
from dataclasses import dataclass

import numpy as np
import soundfile as sf


@dataclass(frozen=True)
class AudioFormat:
    name: str
    media_type: str
    sf_format: str | None  # None: raw samples written by us
    sf_subtype: str | None
    options: tuple[tuple[str, object], ...] = ()  # extra soundfile arguments
    av_codec: str | None = None  # encoded through PyAV (FFmpeg) with this encoder into `av_muxer`
    av_muxer: str | None = None
    bit_rate: int | None = None

    @property
    def sf_kwargs(self) -> dict:
        return {"format": self.sf_format, "subtype": self.sf_subtype, **dict(self.options)}


_ALL = {
    "wav": AudioFormat("wav", "audio/wav", "WAV", "PCM_16"),
    "pcm": AudioFormat("pcm", "audio/L16", None, None),
    "f32le": AudioFormat("f32le", "application/octet-stream", None, None),
    "flac": AudioFormat("flac", "audio/flac", "FLAC", "PCM_16"),
    # Constant bitrate (about 80 kb/s mono at 24 kHz): a stream's length is then known from its first frame,
    # where VBR needs a Xing header that can only be written once the stream has ended.
    "mp3": AudioFormat(
        "mp3", "audio/mpeg", "MP3", "MPEG_LAYER_III", (("bitrate_mode", "CONSTANT"), ("compression_level", 0.5))
    ),
    "opus": AudioFormat("opus", "audio/ogg", "OGG", "OPUS"),
    # AAC-LC in ADTS: every frame carries its own header, so the stream needs no index and plays from any cut.
    # 64 kb/s is transparent for 24 kHz mono speech.
    "aac": AudioFormat("aac", "audio/aac", None, None, av_codec="aac", av_muxer="adts", bit_rate=64_000),
}


def _available(fmt: AudioFormat) -> bool:
    if fmt.av_codec is not None:
        # PyAV's wheels carry FFmpeg with its own AAC encoder and ADTS muxer; it is imported on first use, so a
        # server that never encodes aac never loads FFmpeg.
        return importlib.util.find_spec("av") is not None
    if fmt.sf_format is None:
        return True
    return fmt.sf_format in sf.available_formats() and fmt.sf_subtype in sf.available_subtypes(fmt.sf_format)


# Formats this build can write (MP3 needs libsndfile >= 1.1, Opus needs >= 1.0.29; aac needs PyAV's FFmpeg).
FORMATS: dict[str, AudioFormat] = {name: f for name, f in _ALL.items() if _available(f)}


class UnsupportedFormatError(ValueError):
    pass


def get_format(name: str) -> AudioFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise UnsupportedFormatError(
            f"audio format {name!r} is not supported here (available: {', '.join(sorted(FORMATS))})"
        ) from None


def to_int16(pcm: np.ndarray) -> np.ndarray:
    """Clip to [-1, 1] and scale to int16, rounding to nearest."""
    return np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")


def encode(pcm: np.ndarray, fmt: str | AudioFormat, sample_rate: int) -> bytes:
    """A whole mono float32 signal as one file (or raw stream) of format `fmt`."""
    f = fmt if isinstance(fmt, AudioFormat) else get_format(fmt)
    if f.name == "pcm":
        return to_int16(pcm).tobytes()
    if f.name == "f32le":
        return np.asarray(pcm, dtype="<f4").tobytes()
    if f.av_codec is not None:
        encoder = _AvEncoder(f, sample_rate)
        return encoder.feed(pcm) + encoder.close()
    buf = io.BytesIO()
    # libsndfile gets our int16 samples, so every format carries exactly the samples of `pcm`.
    sf.write(buf, to_int16(pcm), sample_rate, **f.sf_kwargs)
    return buf.getvalue()


def streaming_wav_header(sample_rate: int, channels: int = 1, bits: int = 16) -> bytes:
    """A RIFF/WAVE header for a stream of unknown length (sizes set to 0xFFFFFFFF, as streaming tools do)."""
    block = channels * bits // 8
    return (
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, bits)
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


class _AppendOnlySink(io.RawIOBase):
    """A file object for libsndfile that hands out appended bytes and drops later in-place header patches.

    At close, FLAC and MP3 writers seek back to patch totals into headers they already wrote; in a stream
    those bytes are gone, and the unpatched headers (total samples 0 = unknown) are valid.
    """

    def __init__(self) -> None:
        self._out = bytearray()
        self._pos = 0
        self._end = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def write(self, b) -> int:  # type: ignore[override]
        data = bytes(b)
        if self._pos == self._end:
            self._out += data
            self._end += len(data)
        # else: a patch of bytes already sent; dropped.
        self._pos += len(data)
        self._end = max(self._end, self._pos)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._end}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def take(self) -> bytes:
        data = bytes(self._out)
        self._out.clear()
        return data


class _AvEncoder:
    """A PyAV (FFmpeg) encoder and muxer writing into an append-only sink; `feed` and `close` return the bytes
    the muxer has written since the last call (each packet is flushed as it is muxed)."""

    def __init__(self, fmt: AudioFormat, sample_rate: int):
        import av

        self._frame = av.AudioFrame
        self._sink = _AppendOnlySink()
        self._container = av.open(self._sink, "w", format=fmt.av_muxer, container_options={"flush_packets": "1"})
        self._stream = self._container.add_stream(fmt.av_codec, rate=sample_rate, layout="mono")
        if fmt.bit_rate:
            self._stream.bit_rate = fmt.bit_rate
        self._rate = sample_rate
        self._pts = 0

    def feed(self, pcm: np.ndarray) -> bytes:
        samples = to_int16(pcm)
        if samples.size:
            frame = self._frame.from_ndarray(samples[None, :], format="s16", layout="mono")
            frame.sample_rate = self._rate
            frame.pts = self._pts
            self._pts += samples.size
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        return self._sink.take()

    def close(self) -> bytes:
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._sink.take()


class StreamEncoder:
    """Encodes a signal chunk by chunk; `feed` and `close` return the bytes ready to send."""

    def __init__(self, fmt: str | AudioFormat, sample_rate: int):
        self.format = fmt if isinstance(fmt, AudioFormat) else get_format(fmt)
        self.sample_rate = sample_rate
        self._header_sent = False
        self._sink: _AppendOnlySink | None = None
        self._file: sf.SoundFile | None = None
        self._av: _AvEncoder | None = None
        if self.format.av_codec is not None:
            self._av = _AvEncoder(self.format, sample_rate)
        elif self.format.sf_format is not None and self.format.name != "wav":
            self._sink = _AppendOnlySink()
            self._file = sf.SoundFile(self._sink, "w", samplerate=sample_rate, channels=1, **self.format.sf_kwargs)

    def feed(self, pcm: np.ndarray) -> bytes:
        name = self.format.name
        if name == "f32le":
            return np.asarray(pcm, dtype="<f4").tobytes()
        if name in ("pcm", "wav"):
            head = b""
            if name == "wav" and not self._header_sent:
                head = streaming_wav_header(self.sample_rate)
                self._header_sent = True
            return head + to_int16(pcm).tobytes()
        if self._av is not None:
            return self._av.feed(pcm)
        assert self._file is not None and self._sink is not None
        self._file.write(to_int16(pcm))
        return self._sink.take()

    def close(self) -> bytes:
        if self._av is not None:
            encoder, self._av = self._av, None
            return encoder.close()
        if self._file is None:
            if self.format.name == "wav" and not self._header_sent:
                self._header_sent = True
                return streaming_wav_header(self.sample_rate)
            return b""
        assert self._sink is not None
        self._file.close()
        self._file = None
        return self._sink.take()
