"""Voice profile format: one speaker x-vector plus metadata in a small `.safetensors` file.

Shared by the voice extractor (writer) and the server's embedding cache (reader), so there is one definition.
Layout: tensor `x_vector` (D,) float32; string metadata `format`, `model`, `dim`, `created_at`,
`source_sha256`, `source_seconds`, `ref_text`. See docs/voice_profiles.md.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

PROFILE_FORMAT = "qwen3-tts-voice/1"
TENSOR_NAME = "x_vector"
# Ids become file names: keep them to a strict, portable alphabet.
SPEAKER_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_PROFILE_BYTES = 1 << 20  # a 2048-wide float32 vector plus metadata is ~8.5 KB


class ProfileError(ValueError):
    """A profile file is unreadable or does not hold a usable x-vector."""


@dataclass(frozen=True)
class VoiceProfile:
    x_vector: torch.Tensor  # (D,) float32
    model: str = ""
    created_at: str = ""
    source_sha256: str = ""
    source_seconds: float | None = None
    ref_text: str = ""

    @property
    def dim(self) -> int:
        return int(self.x_vector.shape[0])

    def metadata(self) -> dict[str, str]:
        md = {
            "format": PROFILE_FORMAT,
            "model": self.model,
            "dim": str(self.dim),
            "created_at": self.created_at or datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "source_sha256": self.source_sha256,
            "ref_text": self.ref_text,
        }
        if self.source_seconds is not None:
            md["source_seconds"] = f"{self.source_seconds:.3f}"
        return md


def is_valid_speaker_id(speaker_id: str) -> bool:
    """True for ids matching SPEAKER_ID_PATTERN that are not '.'-only names."""
    return bool(SPEAKER_ID_PATTERN.fullmatch(speaker_id)) and speaker_id.strip(".") != ""


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def validate_xvector(x: torch.Tensor, expected_dim: int | None = None) -> torch.Tensor:
    """Check shape, dtype and values; return a contiguous float32 (D,) tensor or raise ProfileError."""
    if not isinstance(x, torch.Tensor):
        raise ProfileError("x_vector is not a tensor")
    if x.dim() != 1:
        raise ProfileError(f"x_vector must be 1-D, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise ProfileError(f"x_vector must be floating point, got {x.dtype}")
    if expected_dim is not None and x.shape[0] != expected_dim:
        raise ProfileError(f"x_vector has width {x.shape[0]}, the loaded model needs {expected_dim}")
    x = x.to(torch.float32).contiguous()
    if not torch.isfinite(x).all():
        raise ProfileError("x_vector contains NaN or Inf")
    if float(x.abs().max()) == 0.0:
        raise ProfileError("x_vector is all zeros")
    return x


def save_profile(path: str | Path, profile: VoiceProfile, *, overwrite: bool = False) -> Path:
    """Write atomically (temp file in the same directory, then rename). Refuses to overwrite unless asked."""
    path = Path(path)
    x = validate_xvector(profile.x_vector)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists (use --force to overwrite)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({TENSOR_NAME: x}, tmp, metadata=profile.metadata())
        # mkstemp makes 0600 files; a profile must be readable by a server running as another user.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load_profile(path: str | Path, expected_dim: int | None = None) -> VoiceProfile:
    """Read and validate a profile. Raises ProfileError with the reason (never a raw library error)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ProfileError(f"cannot read: {e.strerror}") from None
    if size > MAX_PROFILE_BYTES:
        raise ProfileError(f"file is {size} bytes, larger than a profile can be ({MAX_PROFILE_BYTES})")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ProfileError(f"not a readable safetensors file ({type(e).__name__})") from None
    if TENSOR_NAME not in tensors:
        # Accept a single-tensor file from other tools, but never guess among several.
        if len(tensors) != 1:
            raise ProfileError(f"no {TENSOR_NAME!r} tensor (found {sorted(tensors)[:5]})")
        (x,) = tensors.values()
    else:
        x = tensors[TENSOR_NAME]
    if md.get("format") not in (None, PROFILE_FORMAT):
        raise ProfileError(f"unknown profile format {md.get('format')!r}")
    x = validate_xvector(x, expected_dim)
    secs = md.get("source_seconds")
    return VoiceProfile(
        x_vector=x,
        model=md.get("model", ""),
        created_at=md.get("created_at", ""),
        source_sha256=md.get("source_sha256", ""),
        source_seconds=float(secs) if secs else None,
        ref_text=md.get("ref_text", ""),
    )
