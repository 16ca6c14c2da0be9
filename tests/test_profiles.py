"""The voice profile format shared by the extractor and the server's cache."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from qwen_tts.voices import (
    MAX_PROFILE_BYTES,
    PROFILE_FORMAT,
    ProfileError,
    VoiceProfile,
    is_valid_speaker_id,
    load_profile,
    save_profile,
)


def test_round_trip_keeps_vector_and_metadata(tmp_path):
    x = torch.linspace(-1, 1, 64)
    p = save_profile(tmp_path / "v.safetensors", VoiceProfile(x, model="m", source_sha256="ab", source_seconds=7.25))
    got = load_profile(p, expected_dim=64)
    assert torch.equal(got.x_vector, x)
    assert (got.model, got.source_sha256, got.source_seconds) == ("m", "ab", 7.25)
    assert got.created_at  # stamped at write time


def test_refuses_overwrite_unless_asked(tmp_path):
    p = save_profile(tmp_path / "v.safetensors", VoiceProfile(torch.ones(8)))
    with pytest.raises(FileExistsError, match="--force"):
        save_profile(p, VoiceProfile(torch.full((8,), 2.0)))
    save_profile(p, VoiceProfile(torch.full((8,), 2.0)), overwrite=True)
    assert load_profile(p).x_vector[0] == 2.0
    assert [f.name for f in tmp_path.iterdir()] == ["v.safetensors"]  # no temp files left


def test_written_profile_is_readable_by_others(tmp_path):
    old = os.umask(0o022)
    try:
        p = save_profile(tmp_path / "v.safetensors", VoiceProfile(torch.ones(8)))
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o644


@pytest.mark.parametrize(
    ("tensor", "reason"),
    [
        (torch.ones(2, 8), "1-D"),
        (torch.tensor([1.0, float("nan")]), "NaN"),
        (torch.tensor([1.0, float("inf")]), "NaN or Inf"),
        (torch.zeros(8), "all zeros"),
        (torch.ones(8, dtype=torch.int32), "floating point"),
    ],
)
def test_bad_vectors_are_refused_with_reason(tmp_path, tensor, reason):
    p = tmp_path / "bad.safetensors"
    save_file({"x_vector": tensor}, str(p), metadata={"format": PROFILE_FORMAT})
    with pytest.raises(ProfileError, match=reason):
        load_profile(p)


def test_wrong_width_is_refused(tmp_path):
    p = save_profile(tmp_path / "v.safetensors", VoiceProfile(torch.ones(2048)))
    with pytest.raises(ProfileError, match="width 2048, the loaded model needs 1024"):
        load_profile(p, expected_dim=1024)


def test_corrupt_and_oversized_files_are_refused(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ProfileError, match="not a readable safetensors"):
        load_profile(tmp_path / "junk.safetensors")
    big = tmp_path / "big.safetensors"
    big.write_bytes(b"\0" * (MAX_PROFILE_BYTES + 1))
    with pytest.raises(ProfileError, match="larger than a profile"):
        load_profile(big)
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.safetensors")


def test_unknown_format_and_ambiguous_tensors_are_refused(tmp_path):
    p = tmp_path / "f.safetensors"
    save_file({"x_vector": torch.ones(8)}, str(p), metadata={"format": "other/9"})
    with pytest.raises(ProfileError, match="unknown profile format"):
        load_profile(p)
    save_file({"a": torch.ones(8), "b": torch.ones(8)}, str(p))
    with pytest.raises(ProfileError, match="no 'x_vector' tensor"):
        load_profile(p)
    save_file({"embedding": torch.ones(8)}, str(p))  # a single tensor from another tool is accepted
    assert load_profile(p).dim == 8


@pytest.mark.parametrize("sid", ["demo", "alice_01", "Bob-2.v1", "a" * 64])
def test_valid_speaker_ids(sid):
    assert is_valid_speaker_id(sid)


@pytest.mark.parametrize(
    "sid", ["", ".", "..", "../x", "/etc/passwd", "a/b", "a\\b", "a\0b", "a" * 65, "-x", " x", "é"]
)
def test_invalid_speaker_ids(sid):
    assert not is_valid_speaker_id(sid)
