"""Reading reference audio and bringing it to 24 kHz mono float32.

Reimplements the audio input path of qwen-tts 0.1.1 `Qwen3TTSModel` (`inference/qwen3_tts_model.py`:
`_load_audio_to_np` = `librosa.load(sr=None, mono=True)`, then `librosa.resample` with its default `soxr_hq`
and `fix=True` length) with soundfile and soxr directly, so librosa is not a dependency.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np
import soundfile as sf
import soxr

# The model's audio rate: what the speaker encoder takes and what Code2Wav produces. The one definition.
SAMPLE_RATE = 24000


class AudioError(ValueError):
    """Audio that cannot be read or used (unknown format, corrupt, empty, non-finite samples)."""


def load_audio(path: str | Path | BinaryIO) -> tuple[np.ndarray, int]:
    """Read wav/flac/ogg/mp3 (anything libsndfile reads) -> (float32 (N, C) samples in [-1, 1], sample rate)."""
    # A path is named whole (the directory matters in batch runs); a file object by its name attribute.
    name = str(path) if isinstance(path, (str, os.PathLike)) else (getattr(path, "name", None) or "<stream>")
    try:
        data, sr = sf.read(path, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioError(f"{name}: not a readable audio file ({e})") from e
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
