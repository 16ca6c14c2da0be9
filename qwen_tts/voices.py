"""Voices: the profile file format, the profiles directory's rules, the registry the server caches, and the
demo voice. The extractor writes profiles, the server and the batch CLI read them, all through this module.

Format: one speaker x-vector plus metadata in a small `.safetensors` file: tensor `x_vector` (D,) float32; string
metadata `format`, `model`, `dim`, `created_at`, `source_sha256`, `source_seconds`, `ref_text` (docs/voice_profiles.md).
An ICL voice also holds its reference clip's codec codes, tensor `ref_codes` (T, 16) int16, and their transcript in
`ref_text` (qwen_tts/icl_profile.py); a reader that takes only `x_vector` serves it as an x-vector voice.

Directory: `<profiles_dir>/<speaker_id>.safetensors`, ids of a strict portable alphabet; a name never leaves the
directory (strict id pattern, then resolve + commonpath, which also rejects symlinks that point out). Every file is
written atomically (a temp file beside the target, then a rename) with the usual file mode.

Registry (`VoiceRegistry`, the seed's EmbeddingCacheManager): every profile in the directory is loaded at startup (a
bad file is skipped with a warning naming it and the reason), a profile added later is loaded on first use, a changed
file is reloaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import stat
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save_file

from . import icl_profile
from .audio import SAMPLE_RATE
from .icl import IclReference

logger = logging.getLogger("qwen_tts.voices")

PROFILE_FORMAT = "qwen3-tts-voice/1"
TENSOR_NAME = "x_vector"
PROFILE_SUFFIX = ".safetensors"
DEFAULT_PROFILES_DIR = Path("voice_profiles")
# Ids become file names: keep them to a strict, portable alphabet.
MAX_SPEAKER_ID_CHARS = 64
SPEAKER_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_PROFILE_BYTES = 1 << 20  # a 2048-wide float32 vector plus metadata is ~8.5 KB
DEMO_VOICE_ID = "demo"
DEMO_SEED = 0


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
    ref_codes: torch.Tensor | None = None  # (T, 16) integer codes of the reference clip: an ICL voice

    @property
    def dim(self) -> int:
        return int(self.x_vector.shape[0])

    @property
    def icl(self) -> IclReference | None:
        """The ICL reference (codes, transcript, content key), or None for an x-vector voice."""
        if self.ref_codes is None:
            return None
        return icl_profile.make_reference(self.ref_codes, self.ref_text)

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


# --- the profiles directory --------------------------------------------------------------------------------
def is_valid_speaker_id(speaker_id: str) -> bool:
    """True for ids matching SPEAKER_ID_PATTERN that are not '.'-only names."""
    return bool(SPEAKER_ID_PATTERN.fullmatch(speaker_id)) and speaker_id.strip(".") != ""


def profile_path(profiles_dir: str | Path, speaker_id: str) -> Path:
    """Where the profile of `speaker_id` lives (not resolved; see `VoiceRegistry.path_for` for untrusted ids)."""
    return Path(profiles_dir) / f"{speaker_id}{PROFILE_SUFFIX}"


def file_mode() -> int:
    """0o666 less the process umask: the mode our files get (mkstemp makes private 0600 files)."""
    try:  # Linux: read it without changing it (os.umask is process-wide, and writer threads may be running)
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """`write(temp_path)` into a temp file beside `path`, then rename it into place with `file_mode()`: a reader
    sees the old file or the whole new one, never a partial one. The temp file is removed on any failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


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
    if x.shape[0] == 0:
        raise ProfileError("x_vector is empty")
    if expected_dim is not None and x.shape[0] != expected_dim:
        raise ProfileError(f"x_vector has width {x.shape[0]}, the loaded model needs {expected_dim}")
    x = x.to(torch.float32).contiguous()
    if not torch.isfinite(x).all():
        raise ProfileError("x_vector contains NaN or Inf")
    if float(x.abs().max()) == 0.0:
        raise ProfileError("x_vector is all zeros")
    return x


# --- the file format ---------------------------------------------------------------------------------------
def save_profile(path: str | Path, profile: VoiceProfile, *, overwrite: bool = False) -> Path:
    """Write atomically, readable by a server running as another user. Refuses to overwrite unless asked."""
    path = Path(path)
    tensors = {TENSOR_NAME: validate_xvector(profile.x_vector)}
    metadata = profile.metadata()
    if profile.ref_codes is not None:  # an ICL voice: checked here, so no writer leaves a file the loader refuses
        try:
            tensors[icl_profile.REF_CODES_TENSOR] = icl_profile.stored_codes(profile.ref_codes)
            metadata["ref_text"] = icl_profile.check_ref_text(profile.ref_text)
        except icl_profile.IclDataError as e:
            raise ProfileError(str(e)) from None
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists (use --force to overwrite)")
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(mode: int) -> ProfileError:
    return ProfileError(f"not a regular file ({_kind(mode)})")


def read_profile_bytes(path: str | Path, *, follow_symlinks: bool = True) -> tuple[bytes, os.stat_result]:
    """The bytes of a profile file and the stat of what was read, without ever blocking on or reading from
    anything but a regular file of at most MAX_PROFILE_BYTES. ProfileError otherwise.

    A FIFO named `x.safetensors` would block `open()` until a writer appears, and a device could stream for ever,
    so: the path is stat'ed and refused unless it is a regular file; it is then opened with O_NONBLOCK (a FIFO
    swapped in after the stat does not block the open) and O_NOFOLLOW when `follow_symlinks` is off (the registry
    passes resolved paths, so a symlink there was swapped in); the descriptor itself is fstat'ed and refused unless
    regular, and at most MAX_PROFILE_BYTES + 1 bytes are read from it (the file may grow after the fstat).
    """
    path = os.fspath(path)
    try:
        st = os.stat(path, follow_symlinks=follow_symlinks)
    except OSError as e:
        raise ProfileError(f"cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(st.st_mode)
    if st.st_size > MAX_PROFILE_BYTES:
        raise ProfileError(f"file is {st.st_size} bytes, larger than a profile can be ({MAX_PROFILE_BYTES})")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ProfileError(f"cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(st.st_mode)
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_PROFILE_BYTES:
            block = os.read(fd, MAX_PROFILE_BYTES + 1 - size)
            if not block:
                break
            chunks.append(block)
            size += len(block)
    except OSError as e:
        raise ProfileError(f"cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if size > MAX_PROFILE_BYTES:
        raise ProfileError(f"file is over {MAX_PROFILE_BYTES} bytes, larger than a profile can be")
    return b"".join(chunks), st


def _parse(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and string metadata of safetensors bytes (ProfileError if they are not valid safetensors)."""
    try:
        tensors = load_safetensors_bytes(data)
        # The header was just validated by safetensors: 8 bytes of length, then JSON whose __metadata__ (if any)
        # maps strings to strings.
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
    except Exception as e:  # untrusted bytes: whatever the parser raises means "not a profile"
        raise ProfileError(f"not a readable safetensors file ({type(e).__name__})") from None
    md = header.get("__metadata__") if isinstance(header, dict) else None
    if md is None:
        md = {}
    if not isinstance(md, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in md.items()):
        raise ProfileError("metadata is not a map of strings")
    return tensors, md


def _metadata_error(key: str, value: str, expected: str) -> ProfileError:
    shown = value if len(value) <= 40 else value[:37] + "..."
    return ProfileError(f"metadata {key} {shown!r} is not {expected}")


def _source_seconds(value: str | None) -> float | None:
    if value is None or value.strip() == "":
        return None
    try:
        secs = float(value)
    except ValueError:
        raise _metadata_error("source_seconds", value, "a number of seconds") from None
    if not math.isfinite(secs) or secs < 0:
        raise _metadata_error("source_seconds", value, "a finite number of seconds >= 0")
    return secs


def _check_metadata(md: dict[str, str], width: int) -> None:
    """The fields we interpret must be what the format says, else the file is refused with the reason: our writers
    never produce such a file, so something else wrote or edited it, and a refused voice (logged, 404 naming the
    profile as unusable) is easier to find than one served with a field silently dropped. `format` and `dim` are
    checked here, `source_seconds` where it is read (`_source_seconds`). `model`, `created_at`, `source_sha256`
    and `ref_text` are only shown, as the strings they are (safetensors guarantees strings), so any string goes."""
    if md.get("format") not in (None, PROFILE_FORMAT):
        raise ProfileError(f"unknown profile format {md.get('format')!r}")
    dim = (md.get("dim") or "").strip()
    if dim:
        if not dim.isdecimal():
            raise _metadata_error("dim", dim, "a whole number")
        if len(dim) > 9 or int(dim) != width:  # (int() of thousands of digits raises)
            raise _metadata_error("dim", dim, f"the x_vector's width {width}")


def load_profile(path: str | Path, expected_dim: int | None = None, *, follow_symlinks: bool = True) -> VoiceProfile:
    """Read and validate a profile. Raises ProfileError with the reason (never a raw library error); never opens
    anything but a regular file (see `read_profile_bytes`)."""
    return _profile_from_bytes(read_profile_bytes(path, follow_symlinks=follow_symlinks)[0], expected_dim)


def _profile_from_bytes(data: bytes, expected_dim: int | None) -> VoiceProfile:
    tensors, md = _parse(data)
    if TENSOR_NAME not in tensors:
        # Accept a single-tensor file from other tools, but never guess among several.
        if len(tensors) != 1:
            raise ProfileError(f"no {TENSOR_NAME!r} tensor (found {sorted(tensors)[:5]})")
        (x,) = tensors.values()
    else:
        x = tensors[TENSOR_NAME]
    x = validate_xvector(x, expected_dim).clone()  # its own memory, not a view of the file's bytes
    _check_metadata(md, x.shape[0])
    ref_text, ref_codes = md.get("ref_text", ""), None
    if icl_profile.REF_CODES_TENSOR in tensors:
        # An ICL voice: its codes and transcript are checked as the writer checks them (a refused file says why).
        try:
            ref_codes = icl_profile.check_ref_codes(tensors[icl_profile.REF_CODES_TENSOR])
            ref_text = icl_profile.check_ref_text(ref_text)
        except icl_profile.IclDataError as e:
            raise ProfileError(f"{icl_profile.REF_CODES_TENSOR}/ref_text: {e}") from None
    return VoiceProfile(
        x_vector=x,
        model=md.get("model", ""),
        created_at=md.get("created_at", ""),
        source_sha256=md.get("source_sha256", ""),
        source_seconds=_source_seconds(md.get("source_seconds")),
        ref_text=ref_text,
        ref_codes=ref_codes,
    )


# --- the registry ------------------------------------------------------------------------------------------
class SpeakerError(LookupError):
    """Base class: the speaker id cannot be served."""


class InvalidSpeakerIdError(SpeakerError):
    """The id does not match the id pattern (it never reaches the file system)."""


class UnknownSpeakerError(SpeakerError):
    """No usable profile has this id (missing, or its file resolves outside the directory)."""


class InvalidProfileError(SpeakerError):
    """A profile file exists for this id but cannot be used (wrong width, NaN, corrupt...)."""

    def __init__(self, speaker_id: str, reason: str):
        super().__init__(f"voice profile {speaker_id!r} is unusable: {reason}")
        self.speaker_id = speaker_id
        self.reason = reason


@dataclass(frozen=True)
class SpeakerInfo:
    """What /speakers reports about a loaded voice (no tensors, no absolute paths)."""

    speaker_id: str
    dim: int
    file: str
    model: str = ""
    created_at: str = ""
    source_sha256: str = ""
    source_seconds: float | None = None
    ref_text: str = ""
    ref_frames: int = 0  # reference codec frames of an ICL voice; 0: an x-vector voice

    @property
    def icl(self) -> bool:
        return self.ref_frames > 0

    @property
    def ref_seconds(self) -> float | None:
        return round(icl_profile.reference_seconds(self.ref_frames), 3) if self.icl else None

    def as_dict(self) -> dict[str, object]:
        return {
            "id": self.speaker_id,
            "dim": self.dim,
            "file": self.file,
            "model": self.model,
            "created_at": self.created_at,
            "source_sha256": self.source_sha256,
            "icl": self.icl,
            "ref_seconds": self.ref_seconds,
        }


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file name, reason)


@dataclass
class _Entry:
    signature: tuple[int, int, int]  # (mtime_ns, size, inode): any change means reload
    xvector: torch.Tensor | None = None
    info: SpeakerInfo | None = None
    icl: IclReference | None = None  # codes on the CPU: the engine moves what it needs
    error: str | None = None  # remembered so a bad file is parsed (and logged) once per version


def validate_speaker_id(speaker_id: object) -> str:
    """Return the id if it is a well-formed speaker id, else raise InvalidSpeakerIdError."""
    if not isinstance(speaker_id, str):
        raise InvalidSpeakerIdError("speaker id must be a string")
    if len(speaker_id) > MAX_SPEAKER_ID_CHARS or "\x00" in speaker_id or not is_valid_speaker_id(speaker_id):
        raise InvalidSpeakerIdError(
            f"speaker id must be 1-{MAX_SPEAKER_ID_CHARS} characters of letters, digits, '_', '-', '.', "
            "starting with a letter or digit"
        )
    return speaker_id


def list_profile_files(profiles_dir: str | Path) -> list[tuple[str, str | None]]:
    """(file name, id or None when the name is not a valid id) for each profile-looking file, sorted by name."""
    try:
        names = sorted(os.listdir(profiles_dir))
    except OSError:
        return []
    out: list[tuple[str, str | None]] = []
    for name in names:
        # Hidden files include the temp files of an atomic save in progress.
        if not name.endswith(PROFILE_SUFFIX) or name.startswith("."):
            continue
        stem = name[: -len(PROFILE_SUFFIX)]
        try:
            out.append((name, validate_speaker_id(stem)))
        except InvalidSpeakerIdError:
            out.append((name, None))
    return out


class VoiceRegistry:
    """Loads, validates, caches and refreshes voice profiles; safe to call from several threads."""

    def __init__(
        self,
        profiles_dir: str | Path,
        xvector_dim: int | None = None,
        device: str | torch.device = "cpu",
    ):
        self.profiles_dir = Path(profiles_dir)
        self.xvector_dim = xvector_dim
        self.device = torch.device(device)
        self._root = os.path.realpath(self.profiles_dir)
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.RLock()

    # --- paths ------------------------------------------------------------------------------------
    def path_for(self, speaker_id: str) -> Path:
        """The profile path of a valid id, resolved; raises if the id is malformed or escapes the directory."""
        validate_speaker_id(speaker_id)
        resolved = os.path.realpath(os.path.join(self._root, speaker_id + PROFILE_SUFFIX))
        # commonpath, not startswith: /profiles-evil is not inside /profiles.
        if os.path.commonpath([self._root, resolved]) != self._root:
            raise UnknownSpeakerError(f"unknown speaker {speaker_id!r}")
        return Path(resolved)

    # --- loading ----------------------------------------------------------------------------------
    def load_all(self) -> LoadReport:
        """Load every profile in the directory; skip (and report) the unusable ones."""
        report = LoadReport()
        if not self.profiles_dir.is_dir():
            logger.warning("voice profiles directory %s does not exist; no voices loaded", self.profiles_dir)
            return report
        for name, speaker_id in self._scan():
            if speaker_id is None:
                reason = "file name is not a valid speaker id"
                logger.warning("skipping voice profile %s: %s", name, reason)
                report.skipped.append((name, reason))
                continue
            try:
                self.get(speaker_id)
                report.loaded.append(speaker_id)
            except InvalidProfileError as e:
                report.skipped.append((name, e.reason))
            except SpeakerError as e:
                logger.warning("skipping voice profile %s: %s", name, e)
                report.skipped.append((name, str(e)))
        return report

    def get(self, speaker_id: str) -> torch.Tensor:
        """The (D,) float32 x-vector on the cache's device; loads or reloads the file when needed."""
        entry = self._refresh(speaker_id)
        if entry.xvector is None:
            raise InvalidProfileError(speaker_id, entry.error or "unusable")
        return entry.xvector

    def voice(self, speaker_id: str) -> tuple[torch.Tensor, IclReference | None]:
        """The x-vector and, for an ICL voice, its reference, both of one version of the file."""
        entry = self._refresh(speaker_id)
        if entry.xvector is None:
            raise InvalidProfileError(speaker_id, entry.error or "unusable")
        return entry.xvector, entry.icl

    def reference(self, speaker_id: str) -> IclReference | None:
        """The ICL reference of a voice (None for an x-vector voice)."""
        return self.voice(speaker_id)[1]

    def info(self, speaker_id: str) -> SpeakerInfo:
        entry = self._refresh(speaker_id)
        if entry.info is None:
            raise InvalidProfileError(speaker_id, entry.error or "unusable")
        return entry.info

    def list_speakers(self) -> list[SpeakerInfo]:
        """All usable voices now in the directory (rescanned, so added and removed files show up)."""
        found: list[SpeakerInfo] = []
        seen: set[str] = set()
        for _, speaker_id in self._scan():
            if speaker_id is None:
                continue
            seen.add(speaker_id)
            try:
                found.append(self.info(speaker_id))
            except SpeakerError:
                continue
        with self._lock:
            for gone in set(self._entries) - seen:
                del self._entries[gone]
        return sorted(found, key=lambda s: s.speaker_id)

    def sync(self) -> tuple[list[str], list[str]]:
        """Bring the cache in line with the directory now (the server calls it when the directory changes): load
        new and changed profiles, drop removed ones. Returns (ids loaded or reloaded, ids dropped)."""
        present = {sid for _, sid in self._scan() if sid is not None}
        with self._lock:
            before = {sid: e.signature for sid, e in self._entries.items()}
            dropped = sorted(set(before) - present)
            for gone in dropped:
                del self._entries[gone]
        loaded = []
        for speaker_id in sorted(present):
            try:
                entry = self._refresh(speaker_id)
            except SpeakerError:  # gone again meanwhile, or a link that leaves the directory
                continue
            if entry.xvector is not None and before.get(speaker_id) != entry.signature:
                loaded.append(speaker_id)
        return loaded, dropped

    def add(self, speaker_id: str, profile: VoiceProfile) -> SpeakerInfo:
        """Write a new profile (atomically) and load it: usable at once. FileExistsError when the id, or one that
        differs only in case (one file on a case-insensitive filesystem), is taken."""
        self.path_for(speaker_id)  # a well-formed id whose file stays inside the directory
        path = profile_path(self.profiles_dir, speaker_id)
        with self._lock:
            taken = [sid for _, sid in self._scan() if sid is not None and sid.casefold() == speaker_id.casefold()]
            if taken or os.path.lexists(path):
                raise FileExistsError(f"voice {(taken or [speaker_id])[0]!r} exists; delete it first")
            save_profile(path, profile)
            return self.info(speaker_id)

    def delete(self, speaker_id: str) -> None:
        """Remove a profile file (a link is removed, never what it points to) and forget it."""
        self.path_for(speaker_id)  # malformed ids and links that leave the directory never reach unlink
        path = profile_path(self.profiles_dir, speaker_id)
        with self._lock:
            try:
                os.unlink(path)
            except FileNotFoundError:
                raise UnknownSpeakerError(f"unknown speaker {speaker_id!r}") from None
            except OSError as e:  # a directory by that name, a read-only filesystem...
                raise InvalidProfileError(speaker_id, f"cannot delete it ({e.strerror or e})") from None
            finally:
                self._entries.pop(speaker_id, None)

    def to(self, device: str | torch.device) -> VoiceRegistry:
        """Move every cached vector (and future loads) to `device`."""
        with self._lock:
            self.device = torch.device(device)
            for entry in self._entries.values():
                if entry.xvector is not None:
                    entry.xvector = entry.xvector.to(self.device)
        return self

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.xvector is not None)

    def __contains__(self, speaker_id: object) -> bool:
        try:
            self.get(speaker_id)  # type: ignore[arg-type]
        except SpeakerError:
            return False
        return True

    # --- internals --------------------------------------------------------------------------------
    def _scan(self) -> list[tuple[str, str | None]]:
        return list_profile_files(self.profiles_dir)

    def _refresh(self, speaker_id: str) -> _Entry:
        path = self.path_for(speaker_id)
        try:
            st = os.stat(path)
        except OSError:
            with self._lock:
                self._entries.pop(speaker_id, None)
            raise UnknownSpeakerError(f"unknown speaker {speaker_id!r}") from None
        with self._lock:
            entry = self._entries.get(speaker_id)
            if entry is not None and entry.signature == _signature(st):
                return entry
        # Read outside the lock: a slow file holds up no other voice (nor a request thread waiting on the lock).
        entry = self._load(speaker_id, path, _signature(st))
        with self._lock:
            self._entries[speaker_id] = entry
        return entry

    def _load(self, speaker_id: str, path: Path, signature: tuple[int, int, int]) -> _Entry:
        """Never raises: whatever is wrong with the file becomes an entry with the reason, logged once per
        version of the file, so one bad file never stops a start-up, a listing or a sync."""
        name = speaker_id + PROFILE_SUFFIX
        try:
            # The path is resolved (path_for): a link at its last component was swapped in since, so refuse it.
            data, st = read_profile_bytes(path, follow_symlinks=False)
            signature = _signature(st)  # what was read, should the file have changed since the stat
            profile = _profile_from_bytes(data, self.xvector_dim)
        except ProfileError as e:
            logger.warning("skipping voice profile %s: %s", name, e)
            return _Entry(signature, error=str(e))
        except Exception as e:  # a bug or an odd library error: still one bad file, not a dead server
            logger.warning("skipping voice profile %s: unreadable (%s)", name, type(e).__name__, exc_info=True)
            return _Entry(signature, error=f"unreadable ({type(e).__name__})")
        info = SpeakerInfo(
            speaker_id=speaker_id,
            dim=profile.dim,
            file=name,
            model=profile.model,
            created_at=profile.created_at,
            source_sha256=profile.source_sha256,
            source_seconds=profile.source_seconds,
            ref_text=profile.ref_text,
            ref_frames=0 if profile.ref_codes is None else int(profile.ref_codes.shape[0]),
        )
        logger.debug("loaded voice profile %s (dim %d)", name, profile.dim)
        return _Entry(signature, xvector=profile.x_vector.to(self.device), info=info, icl=profile.icl)


def _signature(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_mtime_ns, st.st_size, st.st_ino)


# --- x-vectors from audio -------------------------------------------------------------------------------------
class VoiceEncoder:
    """A checkpoint's speaker encoder loaded alone: mono `SAMPLE_RATE` audio -> x-vector. Enrollment and the demo
    voice both use it."""

    def __init__(self, model_path: str | Path, device: str | torch.device = "cpu"):
        from .model.loading import load_speaker_encoder

        self.device = torch.device(device)
        self.encoder, self.config = load_speaker_encoder(Path(model_path), device=self.device)
        self.encoder.eval()

    @property
    def xvector_dim(self) -> int:
        return self.config.xvector_dim

    @torch.inference_mode()
    def embed(self, mono: np.ndarray) -> torch.Tensor:
        """The clip's x-vector as a float32 (D,) CPU tensor."""
        x = self.encoder.embed(torch.from_numpy(mono).to(self.device))
        return x.detach().to("cpu", torch.float32).reshape(-1)


# --- reference clips: the checks every enrollment applies ------------------------------------------------------
# The extractor (tts_tools/extract.py) and the server's upload route (tts_server/voice_routes.py) both enroll
# through `embed_clip`, so a clip one refuses the other refuses too, with the same message. What a file may be
# (format, channels, rate) and how it is decoded (in blocks, never whole) is `qwen_tts.audio.read_mono`'s.
MIN_CLIP_SECONDS, MAX_CLIP_SECONDS = 1.0, 60.0  # refused outside
RECOMMENDED_SECONDS = (5.0, 30.0)  # warned outside: too little speech gives an unstable voice, more adds nothing
SILENCE_RMS_DBFS = -50.0  # quieter than this is room noise, not speech
SILENCE_PEAK = 1e-3  # -60 dBFS peak: nothing audible anywhere in the clip
CLIP_LEVEL = 0.999  # |x| at or above this counts as clipped (int16 full scale is 0.99997)
MAX_CLIPPED_FRACTION = 0.01  # speech peaks touch full scale briefly; 1% of all samples on the rail is distortion


class ClipRefused(ValueError):
    """A reference clip is unusable; the message is one line naming the clip and the measured value."""


@dataclass(frozen=True)
class ClipAudio:
    """A reference clip as enrollment reads it: what the checks measure of the file, and the mono 24 kHz signal
    the speaker encoder takes. The file's own (frames, channels) samples are not kept (see `load_clip`)."""

    frames: int  # samples per channel in the file
    sample_rate: int  # the file's
    channels: int
    clipped: int  # the file's samples, over all channels, at |x| >= CLIP_LEVEL
    mono: np.ndarray  # (M,) float32 at SAMPLE_RATE: the channel mean, resampled

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate

    @property
    def clipped_fraction(self) -> float:
        return self.clipped / (self.frames * self.channels) if self.frames else 0.0

    @classmethod
    def from_samples(cls, samples: np.ndarray, sample_rate: int) -> ClipAudio:
        """A clip already in memory, (N,) or (N, C) float samples at `sample_rate`, measured as `load_clip`
        measures a file."""
        from . import audio

        samples = samples[:, None] if samples.ndim == 1 else samples
        frames, channels = samples.shape
        clipped = int(np.count_nonzero(np.abs(samples) >= CLIP_LEVEL))
        mono = audio.resample(audio.to_mono(samples), sample_rate, SAMPLE_RATE) if frames else np.zeros(0, np.float32)
        return cls(frames, int(sample_rate), channels, clipped, np.ascontiguousarray(mono, dtype=np.float32))


@dataclass
class ClipLevels:
    seconds: float
    rms_dbfs: float
    peak: float
    clipped_fraction: float
    warnings: list[str] = field(default_factory=list)


def _dbfs(x: float) -> float:
    return 20.0 * float(np.log10(max(x, 1e-12)))


def _too_long(label: str, seconds: float, max_seconds: float) -> ClipRefused:
    return ClipRefused(f"{label}: too long ({seconds:.1f} s; the limit is {max_seconds:g} s, trim it to 5-30 s)")


def check_clip(clip: ClipAudio, label: str, *, max_seconds: float = MAX_CLIP_SECONDS) -> ClipLevels:
    """Duration and level checks: duration and clipping of the file's own samples (resampling smears flat tops
    and hides them), RMS and peak of `clip.mono`, what the encoder will see."""
    seconds = clip.seconds
    if seconds < MIN_CLIP_SECONDS:
        raise ClipRefused(
            f"{label}: too short ({seconds:.2f} s; a reference clip needs at least {MIN_CLIP_SECONDS:g} s)"
        )
    if seconds > max_seconds:
        raise _too_long(label, seconds, max_seconds)
    clipped = clip.clipped_fraction
    mono = clip.mono
    rms = float(np.sqrt(np.mean(np.square(mono, dtype=np.float64)))) if mono.size else 0.0
    peak = float(np.max(np.abs(mono))) if mono.size else 0.0
    levels = ClipLevels(seconds=seconds, rms_dbfs=_dbfs(rms), peak=peak, clipped_fraction=clipped)
    if levels.rms_dbfs < SILENCE_RMS_DBFS or peak < SILENCE_PEAK:
        raise ClipRefused(
            f"{label}: silent or nearly (RMS {levels.rms_dbfs:.1f} dBFS, peak {_dbfs(peak):.1f} dBFS; "
            f"need RMS above {SILENCE_RMS_DBFS:g} dBFS)"
        )
    if clipped > MAX_CLIPPED_FRACTION:
        raise ClipRefused(
            f"{label}: heavily clipped ({clipped:.1%} of samples at full scale; the limit is "
            f"{MAX_CLIPPED_FRACTION:.0%}) - record again at a lower level"
        )
    lo, hi = RECOMMENDED_SECONDS
    if not lo <= seconds <= hi:
        levels.warnings.append(f"{label}: {seconds:.1f} s is outside the recommended {lo:g}-{hi:g} s")
    return levels


def _clip_name(source: str | Path | BinaryIO) -> str:
    """A clip's name in messages when the caller gives none: a path whole (the directory matters in batch runs), a
    file object by its name attribute, never its repr (an address means nothing to whoever reads the message)."""
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    name = getattr(source, "name", None)
    return name if isinstance(name, str) and name else "<stream>"


def load_clip(
    source: str | Path | BinaryIO,
    label: str | None = None,
    *,
    max_seconds: float = MAX_CLIP_SECONDS,
    filename: str | None = None,
) -> ClipAudio:
    """A file path or an open binary file (an upload's bytes) read for enrollment. `label` names the clip in
    messages (default: the path); `filename` (an upload's own file name; a path's name by default) is quoted where
    the file cannot be decoded. What the file is comes from its content (WAV, FLAC, Ogg, MP3 through libsndfile;
    MP4/M4A, AAC, WebM, AMR through FFmpeg). Refused (ClipRefused, one line) from the header before any sample is
    decoded: a format outside the accepted list, too many channels, too high a rate, longer than `max_seconds`;
    then decoded in blocks mixed to mono, so memory stays within the mono signal's size whatever the file's
    channels (`qwen_tts.audio.read_mono`). The mono signal is then resampled whole, as the model's own input path
    does."""
    from . import audio

    label = label if label is not None else _clip_name(source)
    try:
        read = audio.read_mono(source, max_seconds=max_seconds, clip_level=CLIP_LEVEL, name=filename)
    except audio.AudioTooLong as e:
        raise _too_long(label, e.seconds, max_seconds) from None
    except audio.AudioError as e:  # one line saying what is wrong, without the file's name: ours goes first
        raise ClipRefused(f"{label}: {e}") from None
    except OSError as e:
        raise ClipRefused(f"{label}: cannot read ({e.strerror or e})") from None
    mono = audio.resample(read.samples, read.sample_rate, SAMPLE_RATE) if read.frames else np.zeros(0, np.float32)
    return ClipAudio(
        read.frames, read.sample_rate, read.channels, read.clipped, np.ascontiguousarray(mono, dtype=np.float32)
    )


def embed_clip(
    encoder: VoiceEncoder,
    source: str | Path | BinaryIO,
    label: str | None = None,
    *,
    max_seconds: float = MAX_CLIP_SECONDS,
    filename: str | None = None,
) -> tuple[torch.Tensor, ClipLevels]:
    """Read, check and embed one reference clip: (x-vector, its levels with any warnings), or ClipRefused."""
    label = label if label is not None else _clip_name(source)
    clip = load_clip(source, label, max_seconds=max_seconds, filename=filename)
    levels = check_clip(clip, label, max_seconds=max_seconds)
    return _embed(encoder, clip, label), levels


def _embed(encoder: VoiceEncoder, clip: ClipAudio, label: str) -> torch.Tensor:
    x = encoder.embed(clip.mono)
    if x.shape[0] != encoder.xvector_dim:
        raise ClipRefused(f"{label}: encoder gave width {x.shape[0]}, the model needs {encoder.xvector_dim}")
    return x


@dataclass
class Enrolment:
    """What enrolling one clip gives: its x-vector and levels, and for an ICL voice its codes and transcript."""

    x_vector: torch.Tensor
    levels: ClipLevels
    ref_text: str = ""
    ref_codes: torch.Tensor | None = None


def enroll_clip(
    encoder: VoiceEncoder,
    source: str | Path | BinaryIO,
    label: str | None = None,
    *,
    ref_text: str = "",
    reference_encoder: Callable[[], icl_profile.ReferenceEncoder] | None = None,
    max_seconds: float = MAX_CLIP_SECONDS,
    filename: str | None = None,
) -> Enrolment:
    """`embed_clip`, and with a transcript also the clip's codec codes (an ICL voice), computed once here so no
    request runs the codec encoder. `reference_encoder` gives the encoder when first needed. ClipRefused for the
    clip (an ICL reference is at most MAX_REF_SECONDS long), IclDataError for the transcript or the codes."""
    label = label if label is not None else _clip_name(source)
    text = icl_profile.check_ref_text(ref_text) if ref_text.strip() else ""
    clip = load_clip(source, label, max_seconds=max_seconds, filename=filename)
    levels = check_clip(clip, label, max_seconds=max_seconds)
    if text and levels.seconds > icl_profile.MAX_REF_SECONDS:
        raise ClipRefused(
            f"{label}: {levels.seconds:.1f} s is longer than an ICL reference may be ({icl_profile.MAX_REF_SECONDS:g}"
            " s): trim it, or enrol it without a transcript as an x-vector voice"
        )
    x = _embed(encoder, clip, label)
    if not text:
        return Enrolment(x, levels)
    if reference_encoder is None:
        raise icl_profile.IclDataError("the transcript needs the codec encoder, which was not given")
    codes = icl_profile.encode_reference(reference_encoder(), clip.mono, SAMPLE_RATE)
    return Enrolment(x, levels, ref_text=text, ref_codes=codes)


# --- the demo voice --------------------------------------------------------------------------------------------
def synthetic_clip(seconds: float = 3.0, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A deterministic voice-like signal (a gliding harmonic tone with a little noise) for the demo voice."""
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    f0 = 140.0 + 25.0 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    wav = sum(0.4 / k * np.sin(k * phase) for k in range(1, 8))
    wav = wav * (0.6 + 0.4 * np.sin(2 * np.pi * 3.0 * t) ** 2)
    noise = np.random.default_rng(DEMO_SEED).standard_normal(t.shape[0])
    return (0.5 * wav + 0.01 * noise).astype(np.float32)


def ensure_demo_voice(profiles_dir: str | Path, model_path: str | Path | None, dim: int | None = None) -> Path:
    """`<profiles_dir>/demo.safetensors`, the one writer of the demo voice.

    With `model_path` (the demo checkpoint): that checkpoint's speaker encoder on `synthetic_clip()`, (re)written
    unless the file already holds exactly this vector. A valid profile whose metadata names another model is
    someone's own voice called 'demo': kept as is. Without (an engine that has no checkpoint, like the fake): a
    seeded random vector of width `dim`, written only when no usable profile of that width is there.
    """
    path = profile_path(profiles_dir, DEMO_VOICE_ID)
    if model_path is None:
        if dim is None:
            raise ValueError("the demo voice needs a checkpoint or a width")
        try:
            load_profile(path, expected_dim=dim)
            return path
        except ProfileError:
            pass
        x = torch.randn(dim, generator=torch.Generator().manual_seed(DEMO_SEED))
        return save_profile(path, VoiceProfile(x_vector=x, model="fake"), overwrite=True)

    from .model.model_paths import DEMO

    clip = synthetic_clip()
    encoder = VoiceEncoder(model_path)
    x = encoder.embed(clip)
    try:
        existing = load_profile(path, expected_dim=encoder.xvector_dim)
        if existing.model != DEMO or torch.equal(existing.x_vector, x):
            return path
    except ProfileError:
        pass
    clip_sha = hashlib.sha256(clip.tobytes()).hexdigest()
    profile = VoiceProfile(x_vector=x, model=DEMO, source_sha256=clip_sha, source_seconds=3.0)
    return save_profile(path, profile, overwrite=True)
