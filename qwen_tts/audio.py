"""Reading reference audio and bringing it to 24 kHz mono float32.

Reimplements the audio input path of qwen-tts 0.1.1 `Qwen3TTSModel` (`inference/qwen3_tts_model.py`:
`_load_audio_to_np` = `librosa.load(sr=None, mono=True)`, then `librosa.resample` with its default `soxr_hq`
and `fix=True` length) with soundfile and soxr directly, so librosa is not a dependency.

Clips from outside (enrollment: the extractor and the server's upload) are read by `read_mono`. What a file is
comes from its first bytes, never its name: WAV, FLAC, Ogg and MP3 are read by libsndfile, only the formats of
ACCEPTED_SUBTYPES; what libsndfile cannot read but phones and browsers record (MP4/M4A with AAC or ALAC, raw AAC
in ADTS, WebM/Matroska, AMR) is decoded by FFmpeg through PyAV, each container by its own demuxer only and only the
codecs of FFMPEG_CODECS. Either way at most MAX_CHANNELS channels and MAX_SAMPLE_RATE, and a duration over the
limit, are refused from the header before any sample is decoded; then the clip is decoded in blocks mixed to mono
as they come (and, through FFmpeg, cut off as soon as it passes the duration limit or MAX_DECODE_SECONDS of
work), so a small file that decodes to gigabytes (a decompression bomb) never gets the memory of its decoded size.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import soundfile as sf
import soxr

# The model's audio rate: what the speaker encoder takes and what Code2Wav produces. The one definition.
SAMPLE_RATE = 24000

# What a reference clip may be, checked from the header (libsndfile's format and subtype names). The documented
# wav, flac, ogg and mp3, with the encodings recorders and converters write: a phone or field recorder's PCM or float
# WAV (WAVEX: WAVE_FORMAT_EXTENSIBLE, as written for more than 2 channels or 24 bits; RF64: a WAV past 4 GB, which
# broadcast recorders write), a telephone's mu-law or A-law WAV, a dictaphone's IMA or MS ADPCM WAV. libsndfile reads
# some twenty more containers (MAT5, PAF, XI, ...) and codecs (G.72x, GSM, DWVW, ...) that no one records a voice in:
# each is parser code an upload would reach for nothing.
_WAV_PCM = frozenset({"PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT", "DOUBLE", "ULAW", "ALAW"})
ACCEPTED_SUBTYPES: dict[str, frozenset[str]] = {
    "WAV": _WAV_PCM | {"IMA_ADPCM", "MS_ADPCM"},
    "WAVEX": _WAV_PCM,
    "RF64": _WAV_PCM,
    "FLAC": frozenset({"PCM_S8", "PCM_16", "PCM_24"}),
    "OGG": frozenset({"VORBIS", "OPUS"}),
    "MP3": frozenset({"MPEG_LAYER_III"}),
}
ACCEPTED_FORMATS = (
    "WAV (PCM, float, mu-law, A-law, IMA/MS ADPCM; WAVEX, RF64), FLAC, Ogg Vorbis, Ogg Opus, MP3, "
    "MP4/M4A (AAC, ALAC), AAC (ADTS), WebM/Matroska (Opus, Vorbis, AAC), AMR"
)
# A voice is recorded in mono or stereo; 8 covers 7.1 and an 8-track field recorder's polyphonic WAV.
MAX_CHANNELS = 8
# 192 kHz is the highest rate studio converters record at; a voice needs 16.
MAX_SAMPLE_RATE = 192_000
# Frames decoded at a time: 2 MiB of float32 at MAX_CHANNELS.
BLOCK_FRAMES = 1 << 16
# Containers libsndfile cannot read that people do record in, told apart by their first bytes, each read by FFmpeg
# through the one demuxer named here (no probing: an upload never reaches FFmpeg's other demuxers, some of which
# follow references to other files or URLs): an MP4/M4A's 'ftyp' box at byte 4 (phones' voice memos), an ADTS
# AAC stream's 12-bit syncword with layer 0 (MP3's frames have layer 1-3 there), the EBML magic of WebM/Matroska
# (browsers' MediaRecorder), AMR's magic line (older phones' voice recorders).
_HEAD_BYTES = 12


@dataclass(frozen=True)
class FFmpegContainer:
    name: str  # in messages and MonoAudio.format
    demuxer: str  # FFmpeg's name for the one demuxer allowed to read it
    matches: Callable[[bytes], bool]


FFMPEG_CONTAINERS = (
    FFmpegContainer("MP4/M4A", "mov", lambda head: head[4:8] == b"ftyp"),
    FFmpegContainer("AAC (ADTS)", "aac", lambda head: len(head) > 1 and head[0] == 0xFF and head[1] & 0xF6 == 0xF0),
    FFmpegContainer("WebM/Matroska", "matroska", lambda head: head[:4] == b"\x1a\x45\xdf\xa3"),
    FFmpegContainer("AMR", "amr", lambda head: head.startswith((b"#!AMR\n", b"#!AMR-WB\n"))),
)
# The audio codecs decoded in those containers: what phones, browsers and converters put there. A track of any
# other codec is refused by name before it is decoded.
FFMPEG_CODECS = frozenset({"aac", "alac", "mp3", "mp3float", "opus", "libopus", "vorbis", "libvorbis", "flac", "amrnb",
                           "amrwb"})  # fmt: skip
# Wall-clock seconds FFmpeg may spend decoding one clip (60 s of AAC takes well under one): a file built to be
# slow to decode is refused, not left to hold a worker.
MAX_DECODE_SECONDS = 30.0
# libsndfile's first bytes of the formats it reads for us, to say what a file is in messages.
_SNDFILE_MAGIC = ((b"RIFF", "WAV"), (b"RIFX", "WAV"), (b"RF64", "WAV"), (b"fLaC", "FLAC"), (b"OggS", "Ogg"),
                  (b"ID3", "MP3"))  # fmt: skip


def sniff_format(head: bytes) -> str | None:
    """The audio container a file's first bytes (at least 12) show, by name ('WAV', 'MP4/M4A', ...), or None when
    they match none `read_mono` knows. Used to tell audio from other files by content (the extractor's list files)."""
    for magic, name in _SNDFILE_MAGIC:
        if head.startswith(magic):
            return name
    for container in FFMPEG_CONTAINERS:
        if container.matches(head):
            return container.name
    if len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0 and head[1] & 0x06:  # an MPEG audio frame
        return "MP3"
    return None


# libsndfile's frame count for a stream whose header does not give its length (SF_COUNT_MAX).
_UNKNOWN_FRAMES = (1 << 63) - 1


class AudioError(ValueError):
    """Audio that cannot be read or used (unknown format, corrupt, empty, non-finite samples)."""


class AudioTooLong(AudioError):
    """The clip is longer than the limit it was read with (from its header, before any decoding)."""

    def __init__(self, seconds: float):
        super().__init__(f"{seconds:.1f} s")
        self.seconds = seconds


def _libsndfile_reason(e: Exception) -> str:
    """What went wrong, in libsndfile's words and never soundfile's message: that one starts with the repr of the
    file object (`Error opening <_io.BytesIO object at 0x7f...>: `), an address that means nothing to a client."""
    if isinstance(e, sf.LibsndfileError):
        reason = e.error_string.strip().removeprefix("Error : ").rstrip(".")
        return " ".join(reason.split()) or "unknown error"
    return type(e).__name__


def load_audio(path: str | Path | BinaryIO) -> tuple[np.ndarray, int]:
    """Read wav/flac/ogg/mp3 (anything libsndfile reads) -> (float32 (N, C) samples in [-1, 1], sample rate).
    Whole and unchecked: for files of our own (tests, tools); clips from outside go through `read_mono`."""
    # A path is named whole (the directory matters in batch runs); a file object by its name attribute.
    name = str(path) if isinstance(path, (str, os.PathLike)) else (getattr(path, "name", None) or "<stream>")
    try:
        data, sr = sf.read(path, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioError(f"{name}: not a readable audio file ({_libsndfile_reason(e)})") from e
    if data.size and not np.isfinite(data).all():
        raise AudioError(f"{name}: audio contains NaN or infinite samples")
    return data, int(sr)


def to_mono(x: np.ndarray) -> np.ndarray:
    """(N,) or (N, C) -> (N,) float32, averaging the channels."""
    if x.ndim == 1:
        return x.astype(np.float32, copy=False)
    if x.ndim != 2:
        raise ValueError(f"expected audio of shape (N,) or (N, C), got {x.shape}")
    return x.mean(axis=1, dtype=np.float32)


def resample(x: np.ndarray, sr_in: int, sr_out: int = SAMPLE_RATE) -> np.ndarray:
    """soxr high-quality resampling of (N,) or (N, C) float32; length ceil(N * sr_out / sr_in) like librosa."""
    if sr_in <= 0 or sr_out <= 0:
        raise ValueError(f"sample rates must be positive, got {sr_in} -> {sr_out}")
    x = np.asarray(x, dtype=np.float32)
    if sr_in == sr_out:
        return x
    # Same float expression as librosa.resample(fix=True), so lengths agree sample for sample.
    n_out = math.ceil(x.shape[0] * (float(sr_out) / sr_in))
    if x.shape[0] == 0:
        return np.zeros((0, *x.shape[1:]), dtype=np.float32)
    y = soxr.resample(x, sr_in, sr_out, quality="HQ")
    if y.shape[0] >= n_out:
        return y[:n_out]
    pad = [(0, n_out - y.shape[0])] + [(0, 0)] * (y.ndim - 1)
    return np.pad(y, pad)


def load_mono_24k(path: str | Path | BinaryIO) -> np.ndarray:
    """Read an audio file as (N,) float32 mono at 24 kHz, as the speaker encoder expects."""
    data, sr = load_audio(path)
    return resample(to_mono(data), sr, SAMPLE_RATE)


@dataclass(frozen=True)
class MonoAudio:
    """A clip as `read_mono` decodes it: the channel mean at the file's own rate, and what the file held."""

    samples: np.ndarray  # (frames,) float32: to_mono of the file's (frames, channels) samples, bit for bit
    sample_rate: int
    channels: int
    format: str  # libsndfile's names, e.g. "WAV", "PCM_16"
    subtype: str
    clipped: int  # samples of the file (any channel) with |x| >= the clip level read with

    @property
    def frames(self) -> int:
        return int(self.samples.shape[0])


class _SequentialSoundFile(sf.SoundFile):
    """A SoundFile read front to back in one pass of its decoder. soundfile's `read` asks the position before
    and seeks to it after every call when the file is seekable; in an MP3 that seek restarts mpg123 at a frame
    boundary and blocks read that way do not join (samples are lost at every block's end). Reported unseekable,
    `read(out=...)` neither asks nor seeks: each block follows the last exactly as one whole read would give it."""

    def seekable(self) -> bool:
        return False


def _cannot_decode(name: str | None, what: str = "audio") -> str:
    return f"cannot decode {name!r} as {what}" if name else f"cannot decode this file as {what}"


def _check_shape(channels: int, sample_rate: int) -> None:
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioError(f"{channels} channels; the limit is {MAX_CHANNELS} (mix it down to mono first)")
    if not 1 <= sample_rate <= MAX_SAMPLE_RATE:
        raise AudioError(
            f"sample rate {sample_rate} Hz; the limit is {MAX_SAMPLE_RATE} Hz (resample it first, e.g. to 48000 Hz)"
        )


def _open_checked(source: BinaryIO, max_seconds: float | None, name: str | None) -> sf.SoundFile:
    """Open `source` with libsndfile and check its header: the format, channels, rate and (with `max_seconds`)
    duration. The caller closes the returned file."""
    try:
        snd = _SequentialSoundFile(source)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise AudioError(
            f"{_cannot_decode(name)} (not one of {ACCEPTED_FORMATS}; libsndfile: {_libsndfile_reason(e)})"
        ) from None
    try:
        if snd.subtype not in ACCEPTED_SUBTYPES.get(snd.format, ()):
            raise AudioError(f"{snd.format} ({snd.subtype}) is not an accepted format; accepted: {ACCEPTED_FORMATS}")
        _check_shape(snd.channels, snd.samplerate)
        if snd.frames < 0 or snd.frames >= _UNKNOWN_FRAMES:
            raise AudioError(
                "its header does not give its length (a stream written without seeking back?); re-encode it, "
                "e.g. ffmpeg -i clip.flac clip.wav"
            )
        if max_seconds is not None and snd.frames / snd.samplerate > max_seconds:
            raise AudioTooLong(snd.frames / snd.samplerate)
    except BaseException:
        snd.close()
        raise
    return snd


def read_mono(
    source: str | Path | BinaryIO,
    *,
    max_seconds: float | None = None,
    clip_level: float = 1.0,
    block_frames: int = BLOCK_FRAMES,
    name: str | None = None,
) -> MonoAudio:
    """Read a clip from outside as mono float32 at its own rate, in memory bounded by its mono size.

    What the file is comes from its first bytes (`sniff_format`): a container of FFMPEG_CONTAINERS is decoded by
    FFmpeg (`_read_ffmpeg`), anything else by libsndfile. Refused from the header (AudioError, one line; `name`, the
    file's name as its sender gave it, is quoted where the file cannot be decoded): a format outside
    ACCEPTED_SUBTYPES or a codec outside FFMPEG_CODECS, more than MAX_CHANNELS channels, a rate above
    MAX_SAMPLE_RATE, an unknown length (libsndfile), or (AudioTooLong) more than `max_seconds`. Then decoded
    `block_frames` at a time, each block mixed to mono as `to_mono` mixes the whole file (the same samples, bit for
    bit) and its samples at |x| >= `clip_level` counted, so the (frames, channels) array never exists. An OSError
    opening a path passes through."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return read_mono(
                f,
                max_seconds=max_seconds,
                clip_level=clip_level,
                block_frames=block_frames,
                name=name if name is not None else Path(source).name,
            )
    head = source.read(_HEAD_BYTES)
    source.seek(0)
    for container in FFMPEG_CONTAINERS:
        if container.matches(head):
            return _read_ffmpeg(source, container, max_seconds=max_seconds, clip_level=clip_level, name=name)
    with _open_checked(source, max_seconds, name) as snd:
        # As sf.read does before its one read (and so `load_audio` did): a seek to the start. An MP3 decodes
        # differently without it (by up to 2e-7 in MPEG-2 files), and these must be the samples enrollment read.
        what = f"{snd.format} audio"
        try:
            snd.seek(0)
        except (sf.LibsndfileError, RuntimeError) as e:
            raise AudioError(f"{_cannot_decode(name, what)} ({_libsndfile_reason(e)})") from None
        # The header's frame count (checked above) and no more is read, as a whole read (sf.read) reads it.
        mono = np.empty(snd.frames, dtype=np.float32)
        block = np.empty((min(block_frames, max(snd.frames, 1)), snd.channels), dtype=np.float32)
        filled = clipped = 0
        while filled < mono.shape[0]:
            try:
                got = snd.read(dtype="float32", always_2d=True, out=block[: mono.shape[0] - filled])
            except (sf.LibsndfileError, RuntimeError, ValueError) as e:
                raise AudioError(f"{_cannot_decode(name, what)} ({_libsndfile_reason(e)})") from None
            if got.shape[0] == 0:  # the data ends before the header said: keep what there is
                break
            if not np.isfinite(got).all():
                raise AudioError("audio contains NaN or infinite samples")
            clipped += int(np.count_nonzero(np.abs(got) >= clip_level))
            mono[filled : filled + got.shape[0]] = got.mean(axis=1, dtype=np.float32)
            filled += got.shape[0]
        return MonoAudio(mono[:filled], int(snd.samplerate), int(snd.channels), snd.format, snd.subtype, clipped)


def _ffmpeg_reason(e: Exception) -> str:
    """FFmpeg's own words for a failure (`Invalid data found when processing input`), without the file name PyAV
    appends (for a file object, its repr)."""
    import av

    if isinstance(e, av.FFmpegError):
        return (e.strerror or type(e).__name__).rstrip(".")
    return type(e).__name__


def _read_ffmpeg(
    source: BinaryIO, container: FFmpegContainer, *, max_seconds: float | None, clip_level: float, name: str | None
) -> MonoAudio:
    """`read_mono` for the containers libsndfile cannot read: FFmpeg's one demuxer for `container` (never probing
    the others), the first audio track only (a video's picture is never decoded), its codec checked against
    FFMPEG_CODECS and its channels and rate as libsndfile's are; the duration the header states is checked before
    decoding, and the decoded length as it grows (a header may lie or say nothing), as is the time spent. Frames are
    converted to float32 planes at the track's own layout and rate and mixed to mono one at a time."""
    import av  # FFmpeg loads with the first clip that needs it, not with every process that imports this module

    what = f"{container.name} audio"
    try:
        # enable_drefs off (FFmpeg's default, stated): an MP4 never opens the other files its 'dref' box may name.
        options = {"enable_drefs": "0"} if container.demuxer == "mov" else {}
        reader = av.open(source, mode="r", format=container.demuxer, options=options)
    except (av.FFmpegError, ValueError, OSError) as e:
        raise AudioError(f"{_cannot_decode(name, what)} ({_ffmpeg_reason(e)})") from None
    with reader:
        if not reader.streams.audio:
            raise AudioError(f"{_cannot_decode(name, what)} (the file has no audio track)")
        stream = reader.streams.audio[0]
        codec = stream.codec_context.name
        if codec not in FFMPEG_CODECS and not codec.startswith("pcm_"):
            raise AudioError(
                f"{container.name} with {codec} audio is not an accepted format; accepted: {ACCEPTED_FORMATS}"
            )
        rate, channels = int(stream.codec_context.sample_rate or 0), int(stream.codec_context.channels or 0)
        if not rate or not channels:
            raise AudioError(f"{_cannot_decode(name, what)} (its header gives no sample rate or channel count)")
        _check_shape(channels, rate)
        stated = None
        if stream.duration is not None and stream.time_base is not None:
            stated = float(stream.duration * stream.time_base)
        elif reader.duration is not None:
            stated = reader.duration / 1_000_000  # AV_TIME_BASE
        if max_seconds is not None and stated is not None and stated > max_seconds:
            raise AudioTooLong(stated)
        limit = math.floor(max_seconds * rate) if max_seconds is not None else None
        # Float planes at the track's own layout and rate: a stream that changes either midway (HE-AAC's SBR, a
        # PCE) is brought back to what its header said, so the channel mean stays one signal.
        convert = av.AudioResampler(format="fltp", layout=stream.codec_context.layout, rate=rate)
        blocks: list[np.ndarray] = []
        filled = clipped = 0
        started = time.monotonic()

        def take(frames: list[av.AudioFrame]) -> None:
            nonlocal filled, clipped
            for frame in frames:
                planes = frame.to_ndarray()  # (channels, samples) float32
                if planes.size == 0:
                    continue
                if not np.isfinite(planes).all():
                    raise AudioError("audio contains NaN or infinite samples")
                clipped += int(np.count_nonzero(np.abs(planes) >= clip_level))
                blocks.append(planes.mean(axis=0, dtype=np.float32))
                filled += planes.shape[1]
                if limit is not None and filled > limit:
                    raise AudioTooLong(filled / rate)
            if time.monotonic() - started > MAX_DECODE_SECONDS:
                raise AudioError(f"{_cannot_decode(name, what)} (decoding took over {MAX_DECODE_SECONDS:g} s)")

        try:
            for packet in reader.demux(stream):
                for decoded in packet.decode():
                    take(convert.resample(decoded))
            take(convert.resample(None))
        except AudioError:
            raise
        except (av.FFmpegError, ValueError, EOFError) as e:
            raise AudioError(f"{_cannot_decode(name, what)} ({_ffmpeg_reason(e)})") from None
    mono = np.concatenate(blocks) if blocks else np.zeros(0, np.float32)
    return MonoAudio(mono, rate, channels, container.name, codec.upper(), clipped)
