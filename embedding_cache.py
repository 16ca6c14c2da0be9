"""Voice id -> x-vector tensor on the engine's device, from validated profiles in one directory.

The seed's EmbeddingCacheManager, hardened: every `<id>.safetensors` in the profiles directory is loaded at
startup (a bad file is skipped with a warning naming it and the reason), a profile added later is loaded on
first use, a changed file is reloaded, and no id can name a path outside the directory (strict id pattern,
then resolve + commonpath, which also rejects symlinks that point out). The file format is
`qwen_tts.profiles` (docs/voice_profiles.md).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qwen_tts.profiles import ProfileError, VoiceProfile, is_valid_speaker_id, load_profile

logger = logging.getLogger("tts_server.voices")

PROFILE_SUFFIX = ".safetensors"
MAX_SPEAKER_ID_CHARS = 64


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

    def as_dict(self) -> dict[str, object]:
        return {
            "id": self.speaker_id,
            "dim": self.dim,
            "file": self.file,
            "model": self.model,
            "created_at": self.created_at,
            "source_sha256": self.source_sha256,
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


class EmbeddingCacheManager:
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

    def to(self, device: str | torch.device) -> EmbeddingCacheManager:
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
        """(file name, id or None when the name is not a valid id) for each profile-looking file."""
        try:
            names = sorted(os.listdir(self.profiles_dir))
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

    def _refresh(self, speaker_id: str) -> _Entry:
        path = self.path_for(speaker_id)
        try:
            st = path.stat()
        except OSError:
            with self._lock:
                self._entries.pop(speaker_id, None)
            raise UnknownSpeakerError(f"unknown speaker {speaker_id!r}") from None
        signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        with self._lock:
            entry = self._entries.get(speaker_id)
            if entry is not None and entry.signature == signature:
                return entry
            entry = self._load(speaker_id, path, signature)
            self._entries[speaker_id] = entry
            return entry

    def _load(self, speaker_id: str, path: Path, signature: tuple[int, int, int]) -> _Entry:
        name = speaker_id + PROFILE_SUFFIX
        try:
            profile: VoiceProfile = load_profile(path, expected_dim=self.xvector_dim)
        except ProfileError as e:
            logger.warning("skipping voice profile %s: %s", name, e)
            return _Entry(signature, error=str(e))
        info = SpeakerInfo(
            speaker_id=speaker_id,
            dim=profile.dim,
            file=name,
            model=profile.model,
            created_at=profile.created_at,
            source_sha256=profile.source_sha256,
        )
        logger.debug("loaded voice profile %s (dim %d)", name, profile.dim)
        return _Entry(signature, xvector=profile.x_vector.to(self.device), info=info)
