"""qwen_tts.model.model_paths and qwen_tts.voices: model path resolution (demo, directory, hub cache) and the deterministic demo voice."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from qwen_tts.model.config import ModelConfig
from qwen_tts.model.model_paths import ModelPathError as DemoError
from qwen_tts.model.model_paths import ensure_demo_checkpoint, resolve_model_path
from qwen_tts.voices import VoiceProfile, ensure_demo_voice, load_profile, save_profile


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model_path("demo", demo_dir=tmp_path_factory.mktemp("cache") / "demo-tiny")


def test_demo_resolves_to_a_loadable_tiny_checkpoint(demo_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(demo_dir)
    assert cfg.xvector_dim > 0
    assert (demo_dir / "model.safetensors").is_file()
    assert (demo_dir / "speech_tokenizer" / "model.safetensors").is_file()


def test_demo_is_written_once_and_reused(demo_dir: Path) -> None:
    before = (demo_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("demo", demo_dir=demo_dir) == demo_dir
    assert (demo_dir / "model.safetensors").stat().st_mtime_ns == before


def test_demo_dir_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "from-env"
    monkeypatch.setenv("TTS_DEMO_DIR", str(target))
    assert resolve_model_path("demo") == target
    assert (target / "config.json").is_file()


def test_racing_writers_both_get_a_complete_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "race" / "demo-tiny"
    results: list[Path] = []
    errors: list[BaseException] = []

    def resolve() -> None:
        try:
            results.append(ensure_demo_checkpoint(target))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=resolve) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [target] * 3
    ModelConfig.from_pretrained(target)
    # No temporary directories are left behind.
    assert [p.name for p in target.parent.iterdir()] == ["demo-tiny"]


def test_stale_demo_from_another_writer_is_rebuilt(tmp_path: Path) -> None:
    target = ensure_demo_checkpoint(tmp_path / "demo-tiny")
    stamp = json.loads((target / "demo.json").read_text())
    (target / "demo.json").write_text(json.dumps({**stamp, "writer_sha256": "old"}))
    assert ensure_demo_checkpoint(target) == target
    assert json.loads((target / "demo.json").read_text()) == stamp


def test_directory_must_be_a_checkpoint(tmp_path: Path, demo_dir: Path) -> None:
    assert resolve_model_path(str(demo_dir)) == demo_dir
    with pytest.raises(DemoError, match=r"has no config\.json"):
        resolve_model_path(str(tmp_path))
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    with pytest.raises(DemoError, match="is a file"):
        resolve_model_path(str(f))
    with pytest.raises(DemoError, match="no such directory"):
        resolve_model_path(str(tmp_path / "missing" / "dir"))


def test_hub_id_is_found_in_the_local_cache_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    repo = tmp_path / "hf" / "hub" / "models--Qwen--Qwen3-TTS-12Hz-0.6B-Base"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert resolve_model_path("Qwen/Qwen3-TTS-12Hz-0.6B-Base") == snap
    with pytest.raises(
        DemoError,
        match=r"run: hf download Qwen/Qwen3-TTS-12Hz-1\.7B-Base --local-dir \./models/Qwen3-TTS-12Hz-1\.7B-Base ",
    ):
        resolve_model_path("Qwen/Qwen3-TTS-12Hz-1.7B-Base")


def test_demo_voice_is_deterministic_and_has_the_model_width(tmp_path: Path, demo_dir: Path) -> None:
    dim = ModelConfig.from_pretrained(demo_dir).xvector_dim
    path = ensure_demo_voice(tmp_path / "voices", demo_dir)
    assert path == tmp_path / "voices" / "demo.safetensors"
    first = load_profile(path, expected_dim=dim)
    assert first.model == "demo"
    mtime = path.stat().st_mtime_ns
    other = ensure_demo_voice(tmp_path / "other", demo_dir)
    torch.testing.assert_close(load_profile(other).x_vector, first.x_vector, rtol=0, atol=0)
    # Already current: not rewritten.
    ensure_demo_voice(tmp_path / "voices", demo_dir)
    assert path.stat().st_mtime_ns == mtime


def test_corrupt_demo_voice_is_repaired(tmp_path: Path, demo_dir: Path) -> None:
    voices = tmp_path / "voices"
    voices.mkdir()
    (voices / "demo.safetensors").write_bytes(b"garbage")
    path = ensure_demo_voice(voices, demo_dir)
    assert load_profile(path).model == "demo"


def test_users_own_voice_named_demo_is_kept(tmp_path: Path, demo_dir: Path) -> None:
    dim = ModelConfig.from_pretrained(demo_dir).xvector_dim
    mine = torch.ones(dim)
    path = save_profile(tmp_path / "demo.safetensors", VoiceProfile(x_vector=mine, model="my-model"))
    ensure_demo_voice(tmp_path, demo_dir)
    torch.testing.assert_close(load_profile(path).x_vector, mine)
