"""Reading reference audio and bringing it to 24 kHz mono float32.

Reimplements the audio input path of qwen-tts 0.1.1 `Qwen3TTSModel` (`inference/qwen3_tts_model.py`:
`_load_audio_to_np` = `librosa.load(sr=None, mono=True)`, then `librosa.resample` with its default `soxr_hq`
and `fix=True` length) with soundfile and soxr directly, so librosa is not a dependency.

Clips from outside (enrollment: the extractor and the server's upload) are read by `read_mono`: only the formats of
ACCEPTED_SUBTYPES, at most MAX_CHANNELS channels and MAX_SAMPLE_RATE, refused from the header before any sample is
decoded, then decoded in blocks of BLOCK_FRAMES mixed to mono as they come, so a small file that decodes to
gigabytes (a decompression bomb) never gets the memory of its decoded size.
"""

from __future__ import annotations

import math
import os
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
ACCEPTED_FORMATS = "WAV (PCM, float, mu-law, A-law, IMA/MS ADPCM; WAVEX, RF64), FLAC, Ogg Vorbis, Ogg Opus, MP3"
# A voice is recorded in mono or stereo; 8 covers 7.1 and an 8-track field recorder's polyphonic WAV.
MAX_CHANNELS = 8
# 192 kHz is the highest rate studio converters record at; a voice needs 16.
MAX_SAMPLE_RATE = 192_000
# Frames decoded at a time: 2 MiB of float32 at MAX_CHANNELS.
BLOCK_FRAMES = 1 << 16
# Containers libsndfile cannot read that people do record in, told apart by their first bytes: an MP4/M4A's
# 'ftyp' box at byte 4 (phones' voice memos, AAC) and the EBML magic of WebM/Matroska (browsers' MediaRecorder).
_HEAD_BYTES = 12
_UNSUPPORTED_CONTAINERS = (
    (lambda head: head[4:8] == b"ftyp", "AAC/m4a (MP4) audio is not supported; convert it first, e.g. "
     "ffmpeg -i clip.m4a clip.wav"),
    (lambda head: head[:4] == b"\x1a\x45\xdf\xa3", "WebM/Matroska audio is not supported; convert it first, e.g. "
     "ffmpeg -i clip.webm clip.wav"),
)  # fmt: skip
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


def _open_checked(source: BinaryIO, max_seconds: float | None) -> sf.SoundFile:
    """Open `source` and check its header: known-unsupported containers named, then the format, channels, rate and
    (with `max_seconds`) duration. The caller closes the returned file."""
    head = source.read(_HEAD_BYTES)
    source.seek(0)
    for matches, reason in _UNSUPPORTED_CONTAINERS:
        if matches(head):
            raise AudioError(reason)
    try:
        snd = _SequentialSoundFile(source)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise AudioError(f"not a readable audio file ({_libsndfile_reason(e)})") from None
    try:
        if snd.subtype not in ACCEPTED_SUBTYPES.get(snd.format, ()):
            raise AudioError(f"{snd.format} ({snd.subtype}) is not an accepted format; accepted: {ACCEPTED_FORMATS}")
        if not 1 <= snd.channels <= MAX_CHANNELS:
            raise AudioError(f"{snd.channels} channels; the limit is {MAX_CHANNELS} (mix it down to mono first)")
        if not 1 <= snd.samplerate <= MAX_SAMPLE_RATE:
            raise AudioError(
                f"sample rate {snd.samplerate} Hz; the limit is {MAX_SAMPLE_RATE} Hz (resample it first, e.g. to "
                "48000 Hz)"
            )
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
) -> MonoAudio:
    """Read a clip from outside as mono float32 at its own rate, in memory bounded by its mono size.

    Refused from the header (AudioError, one line without the file's name): a container named in
    _UNSUPPORTED_CONTAINERS, a format outside ACCEPTED_SUBTYPES, more than MAX_CHANNELS channels, a rate above
    MAX_SAMPLE_RATE, an unknown length, or (AudioTooLong) more than `max_seconds`. Then decoded `block_frames` at a
    time, each block mixed to mono as `to_mono` mixes the whole file (the same samples, bit for bit) and its samples
    at |x| >= `clip_level` counted, so the (frames, channels) array never exists. An OSError opening a path passes
    through."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return read_mono(f, max_seconds=max_seconds, clip_level=clip_level, block_frames=block_frames)
    with _open_checked(source, max_seconds) as snd:
        # As sf.read does before its one read (and so `load_audio` did): a seek to the start. An MP3 decodes
        # differently without it (by up to 2e-7 in MPEG-2 files), and these must be the samples enrollment read.
        try:
            snd.seek(0)
        except (sf.LibsndfileError, RuntimeError) as e:
            raise AudioError(f"not a readable audio file ({_libsndfile_reason(e)})") from None
        # The header's frame count (checked above) and no more is read, as a whole read (sf.read) reads it.
        mono = np.empty(snd.frames, dtype=np.float32)
        block = np.empty((min(block_frames, max(snd.frames, 1)), snd.channels), dtype=np.float32)
        filled = clipped = 0
        while filled < mono.shape[0]:
            try:
                got = snd.read(dtype="float32", always_2d=True, out=block[: mono.shape[0] - filled])
            except (sf.LibsndfileError, RuntimeError, ValueError) as e:
                raise AudioError(f"not a readable audio file ({_libsndfile_reason(e)})") from None
            if got.shape[0] == 0:  # the data ends before the header said: keep what there is
                break
            if not np.isfinite(got).all():
                raise AudioError("audio contains NaN or infinite samples")
            clipped += int(np.count_nonzero(np.abs(got) >= clip_level))
            mono[filled : filled + got.shape[0]] = got.mean(axis=1, dtype=np.float32)
            filled += got.shape[0]
        return MonoAudio(mono[:filled], int(snd.samplerate), int(snd.channels), snd.format, snd.subtype, clipped)
