"""An ICL voice in a profile file: the reference clip's codec codes and its transcript, their checks, the cache key,
and enrolment's one call into the checkpoint's codec encoder (`qwen_tts.model.codec_encoder`), made once per voice.

In the file the codes are a tensor `ref_codes` (T, 16) int16 (every code of the 12 Hz codec fits: its codebooks have
CODEBOOK_SIZE entries) beside the `x_vector`; the transcript is the metadata `ref_text` the format already had. A
profile without `ref_codes` is an x-vector voice, as every profile written before was; a reader that knows only
`x_vector` reads an ICL profile as the x-vector voice it also is.
"""

from __future__ import annotations

import hashlib
import math
import unicodedata
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from .icl import NUM_CODEBOOKS, IclReference

__all__ = [
    "CODEBOOK_SIZE",
    "FRAME_RATE",
    "MAX_REF_FRAMES",
    "MAX_REF_SECONDS",
    "MAX_REF_TEXT_CHARS",
    "REF_CODES_TENSOR",
    "IclDataError",
    "ReferenceEncoder",
    "check_ref_codes",
    "check_ref_text",
    "encode_reference",
    "load_reference_encoder",
    "make_reference",
    "reference_key",
    "reference_seconds",
    "stored_codes",
]

REF_CODES_TENSOR = "ref_codes"
CODEBOOK_SIZE = 2048  # entries per codebook of the 12 Hz codec (speech_tokenizer decoder_config.codebook_size)
FRAME_RATE = 12.5  # codec frames per second
# The longest reference: the upper end of the clip length enrolment recommends. Every reference frame is a prompt
# position of every request of the voice, so a longer clip costs each request and adds nothing to the voice.
MAX_REF_SECONDS = 30.0
MAX_REF_FRAMES = math.ceil(MAX_REF_SECONDS * FRAME_RATE)
MAX_REF_TEXT_CHARS = 4096
_KEY_DOMAIN = b"qwen3-tts-icl-reference/1\0"


class IclDataError(ValueError):
    """ICL reference data (codes or transcript) that a profile cannot hold; the message says what and the limit."""


class ReferenceEncoder(Protocol):
    """What enrolment needs of the codec encoder: mono (N,) float32 audio at `sample_rate` -> (T, 16) int64."""

    def encode(self, wav: torch.Tensor | np.ndarray, sample_rate: int) -> torch.Tensor: ...


def reference_seconds(frames: int) -> float:
    return frames / FRAME_RATE


def check_ref_text(text: object) -> str:
    """The transcript, stripped, or IclDataError: a string with something to say, at most MAX_REF_TEXT_CHARS
    characters, encodable as UTF-8 (a JSON string may hold a lone surrogate, which no tokenizer takes)."""
    if not isinstance(text, str):
        raise IclDataError(f"the transcript must be text, not {type(text).__name__}")
    text = text.strip()
    if not text:
        raise IclDataError("the transcript is empty (an ICL voice needs what its reference clip says)")
    if len(text) > MAX_REF_TEXT_CHARS:
        raise IclDataError(f"the transcript is {len(text)} characters, the limit is {MAX_REF_TEXT_CHARS}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise IclDataError("the transcript is not valid Unicode text (it holds a lone surrogate)") from None
    if not any(unicodedata.category(c)[0] in "LN" for c in text):
        raise IclDataError("the transcript has no letters or digits")
    return text


def check_ref_codes(codes: object) -> torch.Tensor:
    """The reference codes as a contiguous (T, 16) int64 CPU tensor, or IclDataError: integer codes of the 16
    codebooks, 1 to MAX_REF_FRAMES frames, each in 0 ... CODEBOOK_SIZE - 1."""
    if not isinstance(codes, torch.Tensor):
        raise IclDataError(f"reference codes must be a tensor, not {type(codes).__name__}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise IclDataError(f"reference codes must be integers, got {codes.dtype}")
    if codes.dim() != 2 or codes.shape[1] != NUM_CODEBOOKS or codes.shape[0] < 1:
        raise IclDataError(f"reference codes must have shape (frames, {NUM_CODEBOOKS}), got {tuple(codes.shape)}")
    frames = int(codes.shape[0])
    if frames > MAX_REF_FRAMES:
        raise IclDataError(
            f"reference codes hold {frames} frames ({reference_seconds(frames):.1f} s), the limit is "
            f"{MAX_REF_FRAMES} ({MAX_REF_SECONDS:g} s)"
        )
    codes = codes.detach().to("cpu", torch.int64).contiguous()
    low, high = int(codes.min()), int(codes.max())
    if low < 0 or high >= CODEBOOK_SIZE:
        bad = low if low < 0 else high
        raise IclDataError(f"reference code {bad} is outside the codebook (0 ... {CODEBOOK_SIZE - 1})")
    return codes


def stored_codes(codes: torch.Tensor) -> torch.Tensor:
    """Checked codes as the file keeps them: int16, a quarter of int64's bytes."""
    return check_ref_codes(codes).to(torch.int16)


def reference_key(codes: torch.Tensor, text: str) -> str:
    """The content hash that names a reference in the engine's per-voice cache: the same codes and transcript give
    the same key, whatever the file, its name or its other metadata; any other codes or text give another."""
    codes = check_ref_codes(codes)
    h = hashlib.sha256(_KEY_DOMAIN)
    h.update(f"{codes.shape[0]}x{codes.shape[1]}\0".encode("ascii"))
    h.update(codes.to(torch.int16).numpy().astype("<i2").tobytes())
    h.update(text.encode("utf-8"))
    return "sha256:" + h.hexdigest()


def make_reference(codes: torch.Tensor, text: str) -> IclReference:
    """The engine's view of checked codes and transcript, keyed by their content."""
    codes = check_ref_codes(codes)
    text = check_ref_text(text)
    return IclReference(codes=codes, text=text, key=reference_key(codes, text))


def load_reference_encoder(model_path: str | Path, device: str | torch.device = "cpu") -> ReferenceEncoder:
    """The checkpoint's codec encoder, loaded alone (imported here, on first use: only enrolment runs it)."""
    from .model.codec_encoder import load_codec_encoder

    return load_codec_encoder(Path(model_path), device=str(device))


def encode_reference(encoder: ReferenceEncoder, mono: np.ndarray, sample_rate: int) -> torch.Tensor:
    """A clip's reference codes, checked: (T, 16) int64 on the CPU."""
    codes = encoder.encode(np.ascontiguousarray(mono, dtype=np.float32), int(sample_rate))
    return check_ref_codes(torch.as_tensor(codes))
