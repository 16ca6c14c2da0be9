"""EmbeddingCacheManager: startup loading with skips, lazy load, reload on change, and path containment."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from embedding_cache import (
    EmbeddingCacheManager,
    InvalidProfileError,
    InvalidSpeakerIdError,
    UnknownSpeakerError,
    validate_speaker_id,
)
from qwen_tts.voices import VoiceProfile, save_profile

DIM = 16


def _vec(seed: int, dim: int = DIM) -> torch.Tensor:
    return torch.randn(dim, generator=torch.Generator().manual_seed(seed))


def _write(root: Path, speaker_id: str, x: torch.Tensor, **meta) -> Path:
    return save_profile(root / f"{speaker_id}.safetensors", VoiceProfile(x_vector=x, **meta), overwrite=True)


@pytest.fixture
def profiles(tmp_path: Path) -> Path:
    root = tmp_path / "voices"
    root.mkdir()
    _write(root, "alice", _vec(1), model="tiny", source_sha256="ab" * 32)
    _write(root, "bob.v2", _vec(2))
    _write(root, "wide", _vec(3, DIM * 2))  # wrong width for the model
    nan = _vec(4)
    nan[3] = float("nan")
    save_file({"x_vector": nan}, str(root / "nan.safetensors"))
    save_file({"x_vector": torch.ones(2, DIM)}, str(root / "matrix.safetensors"))
    save_file({"x_vector": torch.arange(DIM, dtype=torch.int32)}, str(root / "ints.safetensors"))
    (root / "corrupt.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    (root / "-bad-name.safetensors").write_bytes(b"")
    (root / "notes.txt").write_text("ignored")
    return root


def test_load_all_loads_valid_profiles_and_skips_bad_ones_with_reasons(profiles: Path, caplog) -> None:
    cache = EmbeddingCacheManager(profiles, xvector_dim=DIM)
    with caplog.at_level(logging.WARNING, logger="tts_server.voices"):
        report = cache.load_all()
    assert sorted(report.loaded) == ["alice", "bob.v2"]
    skipped = dict(report.skipped)
    assert set(skipped) == {
        "wide.safetensors",
        "nan.safetensors",
        "matrix.safetensors",
        "ints.safetensors",
        "corrupt.safetensors",
        "-bad-name.safetensors",
    }
    assert "width 32" in skipped["wide.safetensors"] and "needs 16" in skipped["wide.safetensors"]
    assert "NaN" in skipped["nan.safetensors"]
    assert "1-D" in skipped["matrix.safetensors"]
    assert "floating point" in skipped["ints.safetensors"]
    assert "safetensors" in skipped["corrupt.safetensors"]
    # Every skip is logged naming the file.
    for name in skipped:
        assert any(name in r.getMessage() for r in caplog.records), name
    assert len(cache) == 2
    torch.testing.assert_close(cache.get("alice"), _vec(1))


def test_list_speakers_reports_dim_file_and_metadata(profiles: Path) -> None:
    cache = EmbeddingCacheManager(profiles, xvector_dim=DIM)
    cache.load_all()
    listed = [s.as_dict() for s in cache.list_speakers()]
    assert [s["id"] for s in listed] == ["alice", "bob.v2"]
    assert listed[0]["dim"] == DIM
    assert listed[0]["file"] == "alice.safetensors"
    assert listed[0]["model"] == "tiny"
    assert listed[0]["source_sha256"] == "ab" * 32


def test_profile_added_after_startup_is_loaded_on_first_use(profiles: Path) -> None:
    cache = EmbeddingCacheManager(profiles, xvector_dim=DIM)
    cache.load_all()
    with pytest.raises(UnknownSpeakerError):
        cache.get("carol")
    _write(profiles, "carol", _vec(5))
    torch.testing.assert_close(cache.get("carol"), _vec(5))
    assert "carol" in [s.speaker_id for s in cache.list_speakers()]


def test_changed_profile_file_is_reloaded(profiles: Path) -> None:
    cache = EmbeddingCacheManager(profiles, xvector_dim=DIM)
    cache.load_all()
    torch.testing.assert_close(cache.get("alice"), _vec(1))
    _write(profiles, "alice", _vec(7))
    # Make sure the signature changes even on file systems with coarse timestamps.
    future = time.time() + 5
    os.utime(profiles / "alice.safetensors", (future, future))
    torch.testing.assert_close(cache.get("alice"), _vec(7))


def test_removed_profile_becomes_unknown(profiles: Path) -> None:
    cache = EmbeddingCacheManager(profiles, xvector_dim=DIM)
    cache.load_all()
    (profiles / "bob.v2.safetensors").unlink()
    with pytest.raises(UnknownSpeakerError):
        cache.get("bob.v2")
    assert [s.speaker_id for s in cache.list_speakers()] == ["alice"]


def test_bad_profile_is_reported_as_invalid_not_unknown(profiles: Path) -> None:
    cache = EmbeddingCacheManager(profiles, xvector_dim=DIM)
    with pytest.raises(InvalidProfileError, match="width 32"):
        cache.get("wide")


def test_repaired_profile_is_picked_up(profiles: Path) -> None:
    cache = EmbeddingCacheManager(profiles, xvector_dim=DIM)
    cache.load_all()
    (profiles / "corrupt.safetensors").unlink()
    _write(profiles, "corrupt", _vec(9))
    torch.testing.assert_close(cache.get("corrupt"), _vec(9))


@pytest.mark.parametrize(
    "speaker_id",
    [
        "..",
        ".",
        "../alice",
        "../../etc/passwd",
        "/etc/passwd",
        "voices/alice",
        "alice\x00",
        "a\x00/../../x",
        "a" * 65,
        "",
        " alice",
        "alice/",
        "C:\\x",
        "%2e%2e",
        ".hidden",
    ],
)
def test_malformed_ids_never_reach_the_file_system(profiles: Path, speaker_id: str) -> None:
    cache = EmbeddingCacheManager(profiles, xvector_dim=DIM)
    with pytest.raises(InvalidSpeakerIdError):
        cache.get(speaker_id)
    with pytest.raises(InvalidSpeakerIdError):
        validate_speaker_id(speaker_id)


def test_non_string_id_is_refused() -> None:
    with pytest.raises(InvalidSpeakerIdError):
        validate_speaker_id(5)


def _linked_from(folder: Path, profiles: Path, name: str, target: str, seed: int) -> EmbeddingCacheManager:
    """A cache over `profiles`, in which `name` is a link to the profile `target` written in `folder`."""
    (profiles / f"{name}.safetensors").symlink_to(_write(folder, target, _vec(seed)))
    return EmbeddingCacheManager(profiles, xvector_dim=DIM)


def test_symlink_pointing_outside_the_directory_is_not_served(tmp_path: Path, profiles: Path) -> None:
    cache = _linked_from(tmp_path / "outside", profiles, "escape", "secret", 11)
    report = cache.load_all()
    assert "escape" not in report.loaded
    assert "escape.safetensors" in dict(report.skipped)
    with pytest.raises(UnknownSpeakerError):
        cache.get("escape")
    assert "escape" not in [s.speaker_id for s in cache.list_speakers()]


def test_symlinked_directory_of_profiles_is_contained_by_its_real_path(tmp_path: Path, profiles: Path) -> None:
    link = tmp_path / "voices-link"
    link.symlink_to(profiles, target_is_directory=True)
    cache = EmbeddingCacheManager(link, xvector_dim=DIM)
    torch.testing.assert_close(cache.get("alice"), _vec(1))


def test_sibling_directory_with_a_common_prefix_is_outside(tmp_path: Path, profiles: Path) -> None:
    # /x/voices-evil starts with /x/voices but is not inside it: commonpath, not startswith.
    cache = _linked_from(tmp_path / "voices-evil", profiles, "mallory", "mallory", 12)
    with pytest.raises(UnknownSpeakerError):
        cache.get("mallory")


def test_symlink_inside_the_directory_is_allowed(profiles: Path) -> None:
    (profiles / "alias.safetensors").symlink_to(profiles / "alice.safetensors")
    cache = EmbeddingCacheManager(profiles, xvector_dim=DIM)
    torch.testing.assert_close(cache.get("alias"), _vec(1))


def test_missing_directory_loads_nothing_and_does_not_raise(tmp_path: Path) -> None:
    cache = EmbeddingCacheManager(tmp_path / "nope", xvector_dim=DIM)
    report = cache.load_all()
    assert report.loaded == [] and report.skipped == []
    assert cache.list_speakers() == []


def test_width_is_not_checked_when_unknown(profiles: Path) -> None:
    cache = EmbeddingCacheManager(profiles, xvector_dim=None)
    assert cache.get("wide").shape == (DIM * 2,)


def test_to_moves_vectors_and_future_loads(profiles: Path) -> None:
    cache = EmbeddingCacheManager(profiles, xvector_dim=DIM)
    cache.load_all()
    cache.to("meta")
    assert cache.get("alice").device.type == "meta"
    _write(profiles, "dave", _vec(13))
    assert cache.get("dave").device.type == "meta"
