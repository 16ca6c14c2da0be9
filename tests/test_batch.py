"""batch_inference.py: whole-manifest validation, concurrent runs, atomic outputs, resume, failure isolation.

Failure paths use a small deterministic fake engine (sine chunks, an injectable failure); the end-to-end tests at
the bottom run the real native engine on the tiny random checkpoint.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from icl_helpers import ref_codes, write_icl_voice

from qwen_tts import icl_profile
from qwen_tts.engine_api import (
    FRAME_SAMPLES,
    SAMPLE_RATE,
    Engine,
    FinishReason,
    RequestHandle,
    SynthesisRequest,
)
from qwen_tts.voices import VoiceProfile, file_mode, load_profile, save_profile
from tts_tools import batch
from tts_tools.manifest import derive_seed

REPO = Path(__file__).resolve().parent.parent
DIM = 16
FAIL_MARK = "FAIL"


def fake_frames(text: str) -> int:
    return 3 + len(text) // 5


class FakeEngine(Engine):
    """Deterministic stand-in: `fake_frames(text)` frames of a seed-dependent sine; FAIL in the text fails it."""

    def __init__(self, dim: int = DIM):
        self.dim = dim
        self.started = False
        self.stopped = False
        self.submitted: list[SynthesisRequest] = []
        self.max_live = 0
        self._live = 0

    async def start(self) -> None:
        self.started = True

    async def stop(self, drain_timeout: float = 0.0) -> None:
        self.stopped = True

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        assert self.started and not self.stopped
        assert request.xvector.shape == (self.dim,)
        self.submitted.append(request)
        handle = RequestHandle(request)
        if request.seed is None:
            request.seed = 4242
        asyncio.get_running_loop().create_task(self._produce(handle))
        return handle

    async def _produce(self, handle: RequestHandle) -> None:
        self._live += 1
        self.max_live = max(self.max_live, self._live)
        req = handle.request
        frames = fake_frames(req.text)
        handle.stats.frame_budget = 100
        t = np.arange(FRAME_SAMPLES, dtype=np.float32) / SAMPLE_RATE
        freq = 200.0 + (req.seed or 0) % 300
        for i in range(frames):
            await asyncio.sleep(0)
            if FAIL_MARK in req.text and i == 1:
                self._live -= 1
                handle.finish_threadsafe(FinishReason.ERROR, "injected failure")
                return
            chunk = 0.3 * np.sin(2 * math.pi * freq * (t + i * FRAME_SAMPLES / SAMPLE_RATE)).astype(np.float32)
            handle.stats.frames += 1
            handle.stats.samples += chunk.size
            handle.put_threadsafe(chunk)
        self._live -= 1
        handle.finish_threadsafe(FinishReason.EOS)

    def cancel(self, handle: RequestHandle) -> None:
        pass

    @property
    def ready(self) -> bool:
        return self.started and not self.stopped

    @property
    def xvector_dim(self) -> int:
        return self.dim

    @property
    def languages(self) -> list[str]:
        return ["auto", "english", "german"]


def make_voice(profiles: Path, name: str, dim: int = DIM, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    return save_profile(profiles / f"{name}.safetensors", VoiceProfile(torch.randn(dim, generator=g), model="test"))


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    make_voice(tmp_path / "voices", "alice", seed=1)
    make_voice(tmp_path / "voices", "bob", seed=2)
    return tmp_path


def write_manifest(path: Path, data) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def run_fake(workdir: Path, manifest, *extra: str, engine: FakeEngine | None = None) -> tuple[int, FakeEngine]:
    engine = engine or FakeEngine()
    m = write_manifest(workdir / "manifest.json", manifest)
    argv = ["--manifest", str(m), "--profiles-dir", str(workdir / "voices"), "--output-dir", str(workdir / "out")]
    return batch.main([*argv, "--no-progress", *extra], engine=engine), engine


MIXED = {
    "defaults": {"language": "english"},
    "items": [
        {"id": "a1", "speaker_id": "alice", "text": "Hello there, this is Alice."},
        {"id": "b1", "speaker_id": "bob", "text": "Bob speaks here.", "format": "flac", "seed": 7},
        {"id": "b2", "speaker_id": "bob", "text": "This one will FAIL halfway."},
        {"id": "a2", "speaker_id": "alice", "text": "Short.", "output": "nested/dir/a2.ogg", "format": "ogg"},
        {"id": "a3", "speaker_id": "alice", "text": "An mp3 item.", "format": "mp3", "language": "German"},
    ],
}


def read_summary(workdir: Path) -> dict:
    return json.loads((workdir / "out" / "summary.json").read_text())


def test_failed_item_is_reported_and_the_others_are_written(workdir: Path, capsys):
    rc, engine = run_fake(workdir, MIXED, "--seed", "11")
    assert rc == 1
    assert engine.started and engine.stopped
    out = workdir / "out"
    for name, fmt, text in [
        ("a1.wav", "WAV", MIXED["items"][0]["text"]),
        ("b1.flac", "FLAC", MIXED["items"][1]["text"]),
        ("nested/dir/a2.ogg", "OGG", MIXED["items"][3]["text"]),
        ("a3.mp3", "MP3", MIXED["items"][4]["text"]),
    ]:
        info = sf.info(str(out / name))
        assert info.format == fmt
        assert info.samplerate == SAMPLE_RATE
        want = fake_frames(text) * FRAME_SAMPLES / SAMPLE_RATE
        # mp3 pads with encoder delay; the lossless formats are exact.
        assert info.duration == pytest.approx(want, abs=0.06 if fmt == "MP3" else 1e-9)
    assert not (out / "b2.wav").exists()
    assert not list(out.rglob("*.tmp")), "temp files must not be left behind"
    assert (out / "a1.wav").stat().st_mode & 0o777 == file_mode()  # not mkstemp's private 0600

    summary = read_summary(workdir)
    assert summary["totals"] == {
        **summary["totals"],
        "items": 5,
        "ok": 4,
        "failed": 1,
        "skipped": 0,
    }
    items = {r["id"]: r for r in summary["items"]}
    assert [r["id"] for r in summary["items"]] == ["a1", "b1", "b2", "a2", "a3"]
    assert items["b2"]["status"] == "failed"
    assert "injected failure" in items["b2"]["error"]
    assert items["a1"]["frames"] == fake_frames(MIXED["items"][0]["text"])
    assert items["a1"]["duration"] == pytest.approx(items["a1"]["frames"] * FRAME_SAMPLES / SAMPLE_RATE)
    assert items["a1"]["finish_reason"] == "eos"
    assert items["a1"]["wall_time"] is not None and items["a1"]["wall_time"] >= 0
    assert items["b1"]["seed"] == 7
    assert items["a1"]["seed"] == derive_seed(11, "a1")
    assert {r.language for r in engine.submitted} == {"english", "german"}
    err = capsys.readouterr().err
    assert "error: item 'b2': RequestFailedError: injected failure" in err
    assert "4 ok, 1 failed, 0 skipped" in err
    assert "items:" not in err  # --no-progress: no bar at all


def test_resume_skips_finished_items_and_runs_the_rest(workdir: Path):
    rc, _ = run_fake(workdir, MIXED)
    assert rc == 1
    first = {r["id"]: r for r in read_summary(workdir)["items"]}
    a1_bytes = (workdir / "out" / "a1.wav").read_bytes()
    fixed = json.loads(json.dumps(MIXED))
    fixed["items"][2]["text"] = "This one now succeeds."
    rc, engine = run_fake(workdir, fixed, "--resume")
    assert rc == 0
    assert [r.text for r in engine.submitted] == ["This one now succeeds."]
    summary = read_summary(workdir)
    items = {r["id"]: r for r in summary["items"]}
    assert summary["totals"]["ok"] == 1 and summary["totals"]["skipped"] == 4 and summary["totals"]["failed"] == 0
    assert items["b2"]["status"] == "ok"
    assert items["a1"]["status"] == "skipped"
    # Stats of skipped items are carried over from the earlier summary.
    assert items["a1"]["frames"] == first["a1"]["frames"]
    assert items["a1"]["seed"] == first["a1"]["seed"] == 4242  # the seed the engine drew in the first run
    assert items["a1"]["duration"] == pytest.approx(first["a1"]["duration"], abs=1e-4)
    assert (workdir / "out" / "a1.wav").read_bytes() == a1_bytes


def test_resume_with_everything_done_does_not_start_the_engine(workdir: Path):
    items = [{"id": "x", "speaker_id": "alice", "text": "Hi there."}]
    assert run_fake(workdir, items)[0] == 0
    rc, engine = run_fake(workdir, items, "--resume")
    assert rc == 0
    assert not engine.started
    assert read_summary(workdir)["totals"]["skipped"] == 1


def test_without_resume_finished_items_are_redone(workdir: Path):
    items = [{"id": "x", "speaker_id": "alice", "text": "Hi there."}]
    run_fake(workdir, items)
    rc, engine = run_fake(workdir, items)
    assert rc == 0 and len(engine.submitted) == 1


def test_resume_redoes_an_output_that_is_not_a_readable_audio_file(workdir: Path):
    items = [{"id": "x", "speaker_id": "alice", "text": "Hi there."}]
    (workdir / "out").mkdir()
    (workdir / "out" / "x.wav").write_bytes(b"garbage")
    rc, engine = run_fake(workdir, items, "--resume")
    assert rc == 0 and len(engine.submitted) == 1
    assert sf.info(str(workdir / "out" / "x.wav")).frames > 0


def test_concurrency_limits_items_in_flight(workdir: Path):
    items = [{"id": f"i{k}", "speaker_id": "alice", "text": "Some words to say " * 3} for k in range(10)]
    rc, engine = run_fake(workdir, items, "--concurrency", "3")
    assert rc == 0
    assert engine.max_live == 3
    assert len(list((workdir / "out").glob("*.wav"))) == 10


def test_item_options_reach_the_engine_request(workdir: Path):
    items = [
        {"id": "x", "speaker_id": "alice", "text": "Hi.", "options": {"temperature": 0.5, "top_k": 3, "greedy": True}}
    ]
    rc, engine = run_fake(workdir, items)
    assert rc == 0
    (req,) = engine.submitted
    assert (req.temperature, req.top_k, req.greedy) == (0.5, 3, True)
    assert torch.equal(req.xvector, load_profile(workdir / "voices" / "alice.safetensors").x_vector)


def test_items_serve_icl_voices_in_the_mode_asked_for_and_the_summary_says_which(workdir: Path):
    write_icl_voice(workdir / "voices", "carol", DIM, frames=30, text="Carol's clip.", seed=5)
    carol = icl_profile.reference_key(ref_codes(30, seed=5), "Carol's clip.")
    items = {
        "defaults": {"voice_mode": "auto"},
        "items": [
            {"id": "c1", "speaker_id": "carol", "text": "In context."},
            {"id": "c2", "speaker_id": "carol", "text": "X-vector alone.", "voice_mode": "xvector"},
            {"id": "c3", "speaker_id": "carol", "text": "Asked for ICL.", "voice_mode": "icl"},
            {"id": "a1", "speaker_id": "alice", "text": "An x-vector voice."},
        ],
    }
    rc, engine = run_fake(workdir, items)
    assert rc == 0
    by_id = {r.request_id: r for r in engine.submitted}
    assert by_id["batch-c1"].icl.key == carol and by_id["batch-c3"].icl.key == carol
    assert by_id["batch-c2"].icl is None and by_id["batch-a1"].icl is None
    assert torch.equal(by_id["batch-c1"].xvector, by_id["batch-c2"].xvector)
    summary = json.loads((workdir / "out" / "summary.json").read_text())
    assert {r["id"]: r["voice_mode"] for r in summary["items"]} == {"c1": "icl", "c2": "xvector", "c3": "icl",
                                                                    "a1": "xvector"}  # fmt: skip
    assert summary["totals"]["voice_modes"] == {"icl": 2, "xvector": 2}


def test_icl_for_a_voice_without_icl_data_and_unknown_modes_are_manifest_problems(workdir: Path, capsys):
    items = [
        {"id": "a1", "speaker_id": "alice", "text": "Hi.", "voice_mode": "icl"},
        {"id": "a2", "speaker_id": "alice", "text": "Hi.", "voice_mode": "both"},
    ]
    rc, engine = run_fake(workdir, items)
    assert rc == 1 and not engine.started
    err = capsys.readouterr().err
    assert "item 0 ('a1'): voice_mode 'icl' needs a voice with ICL data, and speaker_id 'alice' has none" in err
    assert "item 1 ('a2'): 'voice_mode' must be one of auto, icl, xvector, got 'both'" in err


def test_invalid_manifest_reports_every_problem_and_runs_nothing(workdir: Path, capsys):
    bad = [
        {"id": "ok", "speaker_id": "alice", "text": "fine"},
        {"id": "u1", "speaker_id": "carol", "text": "unknown speaker"},
        {"id": "u2", "speaker_id": "../alice", "text": "sneaky speaker id"},
        {"id": "e1", "speaker_id": "alice", "text": ""},
        {"id": "ok", "speaker_id": "alice", "text": "duplicate id"},
        {"id": "d1", "speaker_id": "alice", "text": "t", "output": "ok.wav"},
        {"id": "s1", "speaker_id": "alice", "text": "t", "output": "../../etc/x.wav"},
        {"id": "l1", "speaker_id": "alice", "text": "t", "language": "klingon"},
    ]
    rc, engine = run_fake(workdir, bad)
    assert rc == 1
    assert not engine.started
    assert not (workdir / "out").exists()
    err = capsys.readouterr().err
    assert "unknown speaker_id 'carol'" in err
    assert "unknown speaker_id '../alice'" in err
    assert "'text' is empty" in err
    assert "duplicate id" in err
    assert "output 'ok.wav' is also the output of item 'ok'" in err
    assert "unsafe output name '../../etc/x.wav'" in err
    assert "unknown language 'klingon'" in err
    assert "error: 7 problem(s) in the manifest or voices; nothing was run" in err
    assert "Traceback" not in err


def test_an_items_voice_and_language_are_reported_with_its_other_problems(workdir: Path, capsys):
    """One run lists everything: the unknown voice and language of an item whose text is also empty (they came in
    a second run, once the text was fixed), a wrong-width profile, an out-of-range seed."""
    make_voice(workdir / "voices", "wide", dim=2 * DIM)
    bad = [
        {"id": "a", "speaker_id": "carol", "text": "", "language": "klingon"},
        {"id": "b", "speaker_id": "wide", "text": "t", "seed": 2**40},
    ]
    rc, engine = run_fake(workdir, bad)
    assert rc == 1 and not engine.started
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: item 0 ('a'): unknown speaker_id 'carol'",
        "error: item 0 ('a'): 'text' is empty",
        "error: item 0 ('a'): unknown language 'klingon' (known: Auto, English (en), German (de); a name in any case "
        "or its ISO 639-1 code)",
        f"error: item 1 ('b'): 'seed' must be an integer from 0 to 4294967295 (the HTTP API's range), got {2**40}",
        f"error: voice 'wide' ({workdir / 'voices' / 'wide.safetensors'}): x_vector has width {2 * DIM}, the loaded "
        f"model needs {DIM}",
        "error: 5 problem(s) in the manifest or voices; nothing was run",
    ]


def test_iso_codes_name_languages_in_a_manifest(workdir: Path):
    items = [{"id": "e", "speaker_id": "alice", "text": "Hello.", "language": "en"},
             {"id": "g", "speaker_id": "alice", "text": "Hallo.", "language": "de-AT"}]  # fmt: skip
    rc, engine = run_fake(workdir, items)
    assert rc == 0
    assert sorted(r.language for r in engine.submitted) == ["english", "german"]


def test_output_dir_escape_through_symlink_is_refused(workdir: Path, capsys):
    (workdir / "out").mkdir()
    (workdir / "elsewhere").mkdir()
    (workdir / "out" / "link").symlink_to(workdir / "elsewhere", target_is_directory=True)
    rc, engine = run_fake(workdir, [{"id": "x", "speaker_id": "alice", "text": "t", "output": "link/x.wav"}])
    assert rc == 1 and not engine.started
    assert "resolves outside the output directory" in capsys.readouterr().err


def test_profile_of_another_width_is_refused_before_running(workdir: Path, capsys):
    make_voice(workdir / "voices", "wide", dim=2 * DIM)
    rc, engine = run_fake(workdir, [{"id": "x", "speaker_id": "wide", "text": "t"}])
    assert rc == 1 and not engine.started
    assert f"x_vector has width {2 * DIM}, the loaded model needs {DIM}" in capsys.readouterr().err


def test_corrupt_profile_is_refused_with_its_name(workdir: Path, capsys):
    (workdir / "voices" / "broken.safetensors").write_bytes(b"\x00" * 64)
    rc, _ = run_fake(workdir, [{"id": "x", "speaker_id": "broken", "text": "t"}])
    assert rc == 1
    assert "voice 'broken'" in capsys.readouterr().err


def test_malformed_json_is_one_clear_line(workdir: Path, capsys):
    m = workdir / "manifest.json"
    m.write_text("{not json")
    rc = batch.main(["--manifest", str(m), "--no-progress"], engine=FakeEngine())
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert "invalid JSON at line 1" in err[0]


def test_engine_without_audio_fails_that_item_only(workdir: Path):
    class Silent(FakeEngine):
        async def _produce(self, handle):
            if "mute" in handle.request.text:
                handle.finish_threadsafe(FinishReason.EOS)
            else:
                await super()._produce(handle)

    items = [
        {"id": "m", "speaker_id": "alice", "text": "mute me"},
        {"id": "n", "speaker_id": "alice", "text": "normal text"},
    ]
    rc, _ = run_fake(workdir, items, engine=Silent())
    assert rc == 1
    res = {r["id"]: r for r in read_summary(workdir)["items"]}
    assert res["m"]["status"] == "failed" and "no audio" in res["m"]["error"]
    assert res["n"]["status"] == "ok"


def test_engine_that_fails_to_start_is_one_line_and_writes_nothing(workdir: Path, capsys):
    class Broken(FakeEngine):
        async def start(self):
            raise RuntimeError("weights are corrupt")

    rc, engine = run_fake(workdir, [{"id": "x", "speaker_id": "alice", "text": "t"}], engine=Broken())
    assert rc == 1 and engine.stopped
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: the engine did not start (RuntimeError: weights are corrupt); nothing was run"]
    assert not (workdir / "out" / "x.wav").exists()


def test_failed_write_leaves_no_partial_file(tmp_path: Path, monkeypatch):
    def boom(path, *a, **k):
        Path(path).write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(batch.sf, "write", boom)
    with pytest.raises(RuntimeError):
        batch.write_audio_atomic(tmp_path / "x.wav", np.zeros(100, np.float32), "wav")
    assert list(tmp_path.iterdir()) == []


def test_bad_flags_are_one_line_errors(workdir: Path, capsys):
    rc, _ = run_fake(workdir, [{"id": "x", "speaker_id": "alice", "text": "t"}], "--concurrency", "0")
    assert rc == 1
    assert capsys.readouterr().err.strip() == "error: --concurrency must be >= 1, got 0"
    rc, _ = run_fake(workdir, [{"id": "x", "speaker_id": "alice", "text": "t"}], "--stage-configs-path", "nope.yaml")
    assert rc == 1
    assert "--stage-configs-path nope.yaml: no such file" in capsys.readouterr().err
    item = [{"id": "x", "speaker_id": "alice", "text": "t"}]
    rc, _ = run_fake(workdir, item, "--concurrency", "0", "--seed", str(2**32))
    assert rc == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --concurrency must be >= 1, got 0",
        "error: --seed must be from 0 to 4294967295 (the HTTP API's seed range), got 4294967296",
    ]


def test_help_runs_as_a_script():
    r = subprocess.run(
        [sys.executable, "batch_inference.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0
    for flag in ("--manifest", "--profiles-dir", "--output-dir", "--model", "--stage-configs-path", "--resume"):
        assert flag in r.stdout
    assert "vllm-omni-myfi" in r.stdout


# ---------------------------------------------------------------------------------------------- real engine


def voice_clip(seconds: float, sr: int, f0: float) -> np.ndarray:
    """A voiced, syllable-gated harmonic signal at a speech-like level."""
    t = np.arange(int(seconds * sr)) / sr
    phase = 2 * np.pi * np.cumsum(f0 * (1 + 0.08 * np.sin(2 * np.pi * 0.7 * t))) / sr
    x = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t) ** 2)
    return (0.3 * x / np.max(np.abs(x))).astype(np.float32)


@pytest.fixture(scope="module")
def tiny_setup(tiny_checkpoint: Path, tmp_path_factory) -> dict[str, Path]:
    """The tiny random checkpoint and two voices enrolled by the extractor from generated clips."""
    from tts_tools import extract

    root = tmp_path_factory.mktemp("e2e")
    model = tiny_checkpoint
    clips = root / "clips"
    clips.mkdir()
    sf.write(str(clips / "alice.wav"), np.stack([voice_clip(6.0, 44100, 210.0)] * 2, axis=1), 44100)
    sf.write(str(clips / "bob.flac"), voice_clip(7.0, 16000, 105.0), 16000)
    rc = extract.main(["--model", str(model), "--ref-audio", str(clips), "--output-dir", str(root / "voices")])
    assert rc == 0
    return {"root": root, "model": model, "voices": root / "voices"}


E2E_MANIFEST = {
    "defaults": {"language": "english", "options": {"max_frames": 40}},
    "items": [
        {"id": "a1", "speaker_id": "alice", "text": "Hello, this is the first line."},
        {"id": "b1", "speaker_id": "bob", "text": "Guten Tag.", "language": "german", "format": "flac"},
        {"id": "a2", "speaker_id": "alice", "text": "Greedy decoding here.", "options": {"greedy": True}},
        {"id": "b2", "speaker_id": "bob", "text": "A nested mp3.", "output": "sub/b2.mp3", "format": "mp3", "seed": 9},
        {"id": "a3", "speaker_id": "alice", "text": "Auto language.", "language": "auto"},
    ],
}


def run_real(setup: dict[str, Path], out: Path, manifest, *extra: str) -> int:
    m = write_manifest(setup["root"] / f"{out.name}.json", manifest)
    args = ["--manifest", str(m), "--profiles-dir", str(setup["voices"]), "--output-dir", str(out)]
    return batch.main([*args, "--model", str(setup["model"]), "--device", "cpu", *extra])


def test_end_to_end_manifest_on_the_tiny_checkpoint_then_resume(tiny_setup, tmp_path):
    out = tmp_path / "out"
    assert run_real(tiny_setup, out, E2E_MANIFEST, "--seed", "3", "--concurrency", "3") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["totals"]["ok"] == 5 and summary["totals"]["failed"] == 0
    assert summary["totals"]["audio_seconds"] > 0
    items = {r["id"]: r for r in summary["items"]}
    for it in E2E_MANIFEST["items"]:
        r = items[it["id"]]
        path = out / r["output"]
        info = sf.info(str(path))
        assert info.samplerate == SAMPLE_RATE and info.channels == 1
        assert 1 <= r["frames"] <= 40
        assert r["finish_reason"] in ("eos", "budget")
        assert r["wall_time"] > 0
        assert r["duration"] == pytest.approx(r["frames"] * FRAME_SAMPLES / SAMPLE_RATE)
        if info.format != "MP3":
            assert info.frames == r["frames"] * FRAME_SAMPLES
    assert items["b2"]["seed"] == 9 and items["a1"]["seed"] == derive_seed(3, "a1")

    first_a1 = sf.read(str(out / "a1.wav"))[0]
    (out / "a1.wav").unlink()
    (out / "b1.flac").unlink()
    assert run_real(tiny_setup, out, E2E_MANIFEST, "--seed", "3", "--resume") == 0
    summary = json.loads((out / "summary.json").read_text())
    status = {r["id"]: r["status"] for r in summary["items"]}
    assert status == {"a1": "ok", "b1": "ok", "a2": "skipped", "b2": "skipped", "a3": "skipped"}
    # Same derived seed, counter-based sampling: the redone item is the same audio. Decoding it in a batch of a
    # different size may round differently in float32, hence a tolerance of a few 16-bit steps.
    again = sf.read(str(out / "a1.wav"))[0]
    assert again.shape == first_a1.shape
    np.testing.assert_allclose(again, first_a1, atol=4 / 32768, rtol=0)


def test_the_seed_manifest_runs_as_written(tiny_setup, tmp_path):
    """The seed README's manifest, unchanged: no ids, capitalised languages, outputs named per item."""
    seed_example = [
        {"speaker_id": "alice", "text": "First.", "language": "English", "output": "a.wav"},
        {"speaker_id": "bob", "text": "Second.", "language": "English", "output": "b.wav"},
    ]
    out = tmp_path / "out"
    assert run_real(tiny_setup, out, seed_example, "--seed", "5") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["totals"]["ok"] == 2
    got = {r["id"]: (r["output"], r["speaker_id"], r["seed"]) for r in summary["items"]}
    assert got == {"a": ("a.wav", "alice", derive_seed(5, "a")), "b": ("b.wav", "bob", derive_seed(5, "b"))}
    for name in ("a.wav", "b.wav"):
        audio, rate = sf.read(str(out / name))
        assert rate == SAMPLE_RATE and audio.ndim == 1
        assert audio.shape[0] > 0 and audio.shape[0] % FRAME_SAMPLES == 0
        assert np.isfinite(audio).all() and np.abs(audio).max() > 0


def test_a_batch_item_replays_over_http_with_its_recorded_seed(tiny_setup, tmp_path):
    """summary.json's seed (drawn by the engine here: no --seed, none in the item) is within the HTTP API's range,
    and /synthesize with it, the item's voice, text and language gives the item's audio."""
    from qwen_tts.engine_api import MAX_SEED, EngineSettings
    from qwen_tts.engines.native import NativeEngine
    from server_helpers import in_process

    text = "Replay this line over HTTP."
    out = tmp_path / "out"
    manifest = [{"id": "r1", "speaker_id": "alice", "text": text, "language": "en", "options": {"max_frames": 60}}]
    assert run_real(tiny_setup, out, manifest) == 0
    (item,) = json.loads((out / "summary.json").read_text())["items"]
    assert item["status"] == "ok" and 0 <= item["seed"] <= MAX_SEED
    written, rate = sf.read(str(out / "r1.wav"), dtype="int16")
    assert rate == SAMPLE_RATE and written.size > 0

    async def over_http() -> tuple[int, bytes]:
        engine = NativeEngine(EngineSettings(model_path=str(tiny_setup["model"]), device="cpu"))
        async with in_process(engine, profiles_dir=tiny_setup["voices"]) as server:
            body = {
                "speaker_id": "alice",
                "text": text,
                "language": "en",
                "seed": item["seed"],
                "max_new_tokens": 60,
                "response_format": "pcm",
            }
            r = await server.client.post("/synthesize", json=body)
            return r.status_code, r.content

    status, pcm = asyncio.run(over_http())
    assert status == 200
    replayed = np.frombuffer(pcm, "<i2")
    assert replayed.shape == written.shape
    # The same codes (so the same length); the decode may differ by one 16-bit step between engines of different
    # batch sizes (docs/api.md, `seed`), and libsndfile's float-to-int16 rounding (the batch's wav) from ours by one.
    diff = np.abs(replayed.astype(np.int32) - written.astype(np.int32))
    assert diff.max() <= 2, (diff.max(), np.count_nonzero(diff))


@pytest.mark.skipif(importlib.util.find_spec("vllm_omni") is not None, reason="vllm-omni is installed here")
def test_vllm_omni_backend_without_vllm_is_a_clear_error(tiny_setup, tmp_path, capsys):
    stage = tmp_path / "stage.yaml"
    stage.write_text("stages: []\n")
    rc = run_real(tiny_setup, tmp_path / "out", E2E_MANIFEST, "--stage-configs-path", str(stage))
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--backend 'vllm-omni': vllm and vllm-omni are not installed" in err[0]
