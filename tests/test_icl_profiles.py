"""ICL voice profiles (qwen_tts/icl_profile.py, qwen_tts/voices.py): the reference codes and transcript in the file,
what a reader that knows only the x-vector sees, the checks on the new fields, and the registry's `IclReference`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from icl_helpers import ref_codes, write_icl_voice
from safetensors.torch import load_file, save, save_file

from qwen_tts import icl_profile
from qwen_tts.icl import IclReference
from qwen_tts.voices import (
    MAX_PROFILE_BYTES,
    PROFILE_FORMAT,
    ProfileError,
    VoiceProfile,
    VoiceRegistry,
    load_profile,
    profile_path,
    save_profile,
)

DIM = 32


def _header(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])


def test_an_icl_profile_round_trips_its_codes_as_int16_and_its_transcript(tmp_path: Path) -> None:
    codes = ref_codes(60, seed=3)
    x = torch.randn(DIM)
    path = save_profile(
        tmp_path / "v.safetensors", VoiceProfile(x_vector=x, ref_text="  Hello there.  ", ref_codes=codes)
    )
    header = _header(path)
    assert header["ref_codes"]["dtype"] == "I16" and header["ref_codes"]["shape"] == [60, 16]
    assert header["__metadata__"]["ref_text"] == "Hello there." and header["__metadata__"]["format"] == PROFILE_FORMAT
    profile = load_profile(path, expected_dim=DIM)
    assert profile.ref_codes.dtype == torch.int64 and torch.equal(profile.ref_codes, codes)
    assert torch.equal(profile.x_vector, x) and profile.ref_text == "Hello there."
    ref = profile.icl
    assert isinstance(ref, IclReference) and torch.equal(ref.codes, codes) and ref.text == "Hello there."
    assert ref.key == icl_profile.reference_key(codes, "Hello there.") and ref.key.startswith("sha256:")


def test_a_profile_written_before_icl_loads_unchanged(tmp_path: Path) -> None:
    """The bytes the earlier writer produced: x_vector alone, ref_text as a plain note. Still an x-vector voice."""
    x = torch.randn(DIM)
    path = tmp_path / "old.safetensors"
    metadata = {"format": PROFILE_FORMAT, "model": "m [0b6]", "dim": str(DIM), "created_at": "2026-01-01T00:00:00+00:00",
                "source_sha256": "ab" * 32, "ref_text": "a note", "source_seconds": "6.000"}  # fmt: skip
    save_file({"x_vector": x}, str(path), metadata=metadata)
    profile = load_profile(path, expected_dim=DIM)
    assert torch.equal(profile.x_vector, x) and profile.ref_text == "a note" and profile.source_seconds == 6.0
    assert profile.ref_codes is None and profile.icl is None
    registry = VoiceRegistry(tmp_path, xvector_dim=DIM)
    assert registry.voice("old")[1] is None and registry.reference("old") is None
    info = registry.info("old")
    assert (info.icl, info.ref_seconds, info.as_dict()["icl"], info.as_dict()["ref_seconds"]) == (
        False,
        None,
        False,
        None,
    )


def test_an_icl_profile_is_the_same_x_vector_voice_to_a_reader_that_knows_only_x_vectors(tmp_path: Path) -> None:
    """What the x-vector-only loader relied on holds for an ICL profile: the one tensor named x_vector, the format
    it accepts, the dim it checks; the other tensor is there beside it, not instead of it."""
    x = torch.randn(DIM)
    path = write_icl_voice(tmp_path, "v", DIM, frames=40)
    tensors = load_file(str(path))
    assert set(tensors) == {"x_vector", "ref_codes"} and tensors["x_vector"].dtype == torch.float32
    md = _header(path)["__metadata__"]
    assert md["format"] == "qwen3-tts-voice/1" and md["dim"] == str(DIM)
    x = torch.randn(DIM, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tensors["x_vector"], x)
    assert torch.equal(VoiceRegistry(tmp_path, xvector_dim=DIM).get("v"), x)


def test_the_largest_reference_fits_a_profile_of_the_widest_model(tmp_path: Path) -> None:
    path = save_profile(
        tmp_path / "big.safetensors",
        VoiceProfile(x_vector=torch.randn(2048), ref_text="x" * icl_profile.MAX_REF_TEXT_CHARS,
                     ref_codes=ref_codes(icl_profile.MAX_REF_FRAMES)),
    )  # fmt: skip
    assert os.path.getsize(path) < MAX_PROFILE_BYTES // 8
    assert load_profile(path).ref_codes.shape == (icl_profile.MAX_REF_FRAMES, 16) == (375, 16)


BAD_CODES = [
    (torch.zeros(10, 16), "must be integers, got torch.float32"),
    (torch.zeros(10, 16, dtype=torch.bool), "must be integers, got torch.bool"),
    (torch.zeros(10, 8, dtype=torch.int64), r"shape \(frames, 16\), got \(10, 8\)"),
    (torch.zeros(160, dtype=torch.int64), r"shape \(frames, 16\), got \(160,\)"),
    (torch.zeros(0, 16, dtype=torch.int64), r"got \(0, 16\)"),
    (torch.zeros(376, 16, dtype=torch.int64), r"376 frames \(30.1 s\), the limit is 375 \(30 s\)"),
    (torch.full((4, 16), -1, dtype=torch.int64), r"code -1 is outside the codebook \(0 ... 2047\)"),
    (torch.full((4, 16), 2048, dtype=torch.int64), r"code 2048 is outside the codebook \(0 ... 2047\)"),
]
BAD_TEXT = [
    ("", "transcript is empty"),
    ("   \n", "transcript is empty"),
    ("x" * 4097, "transcript is 4097 characters, the limit is 4096"),
    ("ok \ud800", "lone surrogate"),
    ("... !?", "no letters or digits"),
]


@pytest.mark.parametrize(("codes", "message"), BAD_CODES)
def test_bad_reference_codes_are_refused_by_the_writer_and_the_reader(tmp_path: Path, codes, message) -> None:
    with pytest.raises(ProfileError, match=message):
        save_profile(
            tmp_path / "w.safetensors", VoiceProfile(x_vector=torch.randn(DIM), ref_text="Hi.", ref_codes=codes)
        )
    assert not (tmp_path / "w.safetensors").exists()
    path = tmp_path / "r.safetensors"
    save_file({"x_vector": torch.randn(DIM), "ref_codes": codes}, str(path), metadata={"ref_text": "Hi."})
    with pytest.raises(ProfileError, match="ref_codes/ref_text: .*" + message):
        load_profile(path)


@pytest.mark.parametrize(("text", "message"), BAD_TEXT)
def test_a_bad_transcript_is_refused_by_the_writer_and_the_reader(tmp_path: Path, text, message) -> None:
    codes = ref_codes(8)
    with pytest.raises(ProfileError, match=message):
        save_profile(
            tmp_path / "w.safetensors", VoiceProfile(x_vector=torch.randn(DIM), ref_text=text, ref_codes=codes)
        )
    data = save({"x_vector": torch.randn(DIM), "ref_codes": codes.to(torch.int16)})
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n]) | {"__metadata__": {"ref_text": text}}
    raw = json.dumps(header).encode("ascii")  # ASCII JSON: a lone surrogate travels as its escape, as it could
    path = tmp_path / "r.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
    # (safetensors' own parser already refuses a lone surrogate in the header, before our check)
    expected = "not a readable safetensors file" if "surrogate" in message else "ref_codes/ref_text: .*" + message
    with pytest.raises(ProfileError, match=expected):
        load_profile(path)


def test_the_registry_skips_a_bad_icl_profile_with_the_reason(tmp_path: Path, caplog) -> None:
    save_file({"x_vector": torch.randn(DIM), "ref_codes": torch.full((4, 16), 4000, dtype=torch.int16)},
              str(profile_path(tmp_path, "bad")), metadata={"ref_text": "Hi."})  # fmt: skip
    write_icl_voice(tmp_path, "good", DIM)
    report = VoiceRegistry(tmp_path, xvector_dim=DIM).load_all()
    assert report.loaded == ["good"]
    assert report.skipped == [("bad.safetensors", "ref_codes/ref_text: reference code 4000 is outside the codebook "
                                                   "(0 ... 2047)")]  # fmt: skip


def test_the_registry_gives_the_reference_beside_the_x_vector_keyed_by_content(tmp_path: Path) -> None:
    write_icl_voice(tmp_path, "anna", DIM, frames=75, text="Words of Anna.", seed=4)
    registry = VoiceRegistry(tmp_path, xvector_dim=DIM)
    x, ref = registry.voice("anna")
    assert torch.equal(x, registry.get("anna"))
    assert (
        ref.codes.dtype == torch.int64
        and torch.equal(ref.codes, ref_codes(75, seed=4))
        and ref.text == "Words of Anna."
    )
    assert ref.key == icl_profile.reference_key(ref_codes(75, seed=4), "Words of Anna.")
    assert registry.reference("anna") is ref  # cached with the entry: no re-hash per request
    info = registry.info("anna")
    assert (info.icl, info.ref_seconds, info.ref_text) == (True, 6.0, "Words of Anna.")
    assert info.as_dict()["icl"] is True and info.as_dict()["ref_seconds"] == 6.0

    # The key is the content's: a copy under another name, written at another time, has the same key ...
    write_icl_voice(tmp_path, "anna-copy", DIM, frames=75, text="Words of Anna.", seed=4)
    assert registry.reference("anna-copy").key == ref.key
    # ... and a rewrite with other codes or another transcript changes it (the file's change is picked up).
    write_icl_voice(tmp_path, "anna", DIM, frames=75, text="Other words.", seed=4)
    os.utime(profile_path(tmp_path, "anna"), ns=(1, 1))
    assert registry.reference("anna").key not in (ref.key, None)
    codes = ref_codes(75, seed=4)
    codes[0, 0] = (codes[0, 0] + 1) % 2048
    assert icl_profile.reference_key(codes, "Words of Anna.") != ref.key


def test_reference_keys_do_not_depend_on_the_codes_dtype_or_layout() -> None:
    codes = ref_codes(20, seed=9)
    key = icl_profile.reference_key(codes, "Hi.")
    assert icl_profile.reference_key(codes.to(torch.int16), "Hi.") == key
    assert icl_profile.reference_key(codes.t().contiguous().t(), "Hi.") == key
    assert icl_profile.reference_key(codes[:19], "Hi.") != key
