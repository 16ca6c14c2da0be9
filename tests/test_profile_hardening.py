"""Profile files that must not take the server down (issue 46, item 4), against real `python inference_server.py`
processes on the demo checkpoint: a FIFO named `*.safetensors` (opening it for reading blocks until a writer comes,
which froze start-up, and while running froze the registry and then the event loop), and profiles whose metadata
is not what the format says (`source_seconds` not a number made start-up exit 1, and `nan` made the voice listing
answer 500). Each bad file is skipped with its reason in the log; the good voices are served; asking for a bad one
is a 404 in the error shape. The process tests are marked slow; the unit tests of `load_profile` and the registry
below are not.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from qwen_tts import voices
from qwen_tts.voices import (
    PROFILE_FORMAT,
    InvalidProfileError,
    ProfileError,
    VoiceProfile,
    VoiceRegistry,
    atomic_write,
    load_profile,
    profile_path,
    save_profile,
)
from server_helpers import ServerProcess, server_process

DEMO_DIM = 32  # the demo checkpoint's x-vector width
WATCH_S = 3.0  # watchfiles reports a change after ~1.6 s of quiet (its debounce)
STARTUP_S = 90.0  # the demo server is ready in ~10-20 s on two cores; a start-up blocked on a FIFO never is


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model") / "demo-tiny"


def _env(demo_dir: Path, voices: Path) -> dict[str, str]:
    return {"TTS_DEMO_DIR": str(demo_dir), "TTS_PROFILES_DIR": str(voices), "TTS_MAX_CONCURRENT": "2"}


def _good(voices: Path, speaker_id: str, seconds: float) -> None:
    x = torch.randn(DEMO_DIM, generator=torch.Generator().manual_seed(len(speaker_id)))
    save_profile(profile_path(voices, speaker_id), VoiceProfile(x_vector=x, model="test", source_seconds=seconds))


def _with_metadata(voices: Path, speaker_id: str, **metadata: str) -> Path:
    """A profile whose vector is fine and whose metadata says `metadata`, written atomically."""
    x = torch.randn(DEMO_DIM, generator=torch.Generator().manual_seed(7))
    md = {"format": PROFILE_FORMAT, "model": "test", "dim": str(DEMO_DIM), **metadata}
    return atomic_write(profile_path(voices, speaker_id), lambda tmp: save_file({"x_vector": x}, tmp, metadata=md))


def _assert_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    doc = r.json()
    assert set(doc) == {"error", "request_id"} and set(doc["error"]) == {"message", "type", "param", "code"}, doc
    assert doc["error"]["code"] == code and r.headers["x-request-id"] == doc["request_id"], doc


def _synthesize(c: httpx.Client, speaker_id: str, timeout: float = 60.0) -> httpx.Response:
    body = {"speaker_id": speaker_id, "text": "Hello there.", "seed": 1, "response_format": "pcm"}
    return c.post("/synthesize", json=body, timeout=timeout)


def _served_ids(c: httpx.Client) -> tuple[list[str], dict[str, dict]]:
    speakers = c.get("/speakers", timeout=5)
    assert speakers.status_code == 200, speakers.text
    voices = c.get("/v1/audio/voices", timeout=5)
    assert voices.status_code == 200, voices.text
    ids = [s["id"] for s in speakers.json()["speakers"]]
    assert ids == voices.json()["voices"]
    return ids, {v["id"]: v for v in voices.json()["data"]}


def _wait_for_log(server: ServerProcess, needle: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in server.log():
        assert time.monotonic() < deadline, f"{needle!r} not logged:\n{server.log()[-3000:]}"
        time.sleep(0.1)


BAD_METADATA = {  # id: (metadata, the reason logged)
    "words": ({"source_seconds": "abc"}, "metadata source_seconds 'abc' is not a number of seconds"),
    "notanumber": ({"source_seconds": "nan"}, "metadata source_seconds 'nan' is not a finite number of seconds >= 0"),
    "forever": ({"source_seconds": "1e999"}, "metadata source_seconds '1e999' is not a finite number of seconds >= 0"),
    "backwards": ({"source_seconds": "-3"}, "metadata source_seconds '-3' is not a finite number of seconds >= 0"),
    "wide": ({"dim": "2048"}, f"metadata dim '2048' is not the x_vector's width {DEMO_DIM}"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kinds", [("fifo",), ("metadata",), ("fifo", "metadata")])
def test_a_fifo_and_bad_metadata_beside_good_profiles_leave_the_server_starting_and_serving(
    kinds: tuple[str, ...], demo_dir: Path, tmp_path: Path
) -> None:
    voices = tmp_path / "voices"
    voices.mkdir()
    _good(voices, "alice", 4.5)
    _good(voices, "zed", 12.0)
    bad: dict[str, str] = {}
    if "fifo" in kinds:
        os.mkfifo(voices / "fifo.safetensors")
        bad["fifo"] = "not a regular file (a FIFO)"
    if "metadata" in kinds:
        for speaker_id, (metadata, reason) in BAD_METADATA.items():
            _with_metadata(voices, speaker_id, **metadata)
            bad[speaker_id] = reason
    with server_process(_env(demo_dir, voices), tmp_path / "server.log", startup_timeout=STARTUP_S) as srv:
        log = srv.log()
        for speaker_id, reason in bad.items():  # each bad file is named in the log with its reason
            assert f"skipping voice profile {speaker_id}.safetensors: {reason}" in log, log[-3000:]
        assert f"Loaded 3 voice profiles from {voices} ({len(bad)} skipped)" in log
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            health = c.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            ids, details = _served_ids(c)
            assert ids == ["alice", "demo", "zed"]
            assert details["alice"]["source_seconds"] == 4.5 and details["zed"]["source_seconds"] == 12.0
            r = _synthesize(c, "alice")
            assert r.status_code == 200, r.text
            assert len(r.content) > 0 and len(r.content) % 2 == 0 and r.headers["x-finish-reason"] in ("eos", "budget")
            for speaker_id in bad:  # a 404 in the error shape, never a 500 (and the FIFO is never opened)
                _assert_error(_synthesize(c, speaker_id, timeout=10), 404, "invalid_profile")
            if "metadata" in kinds:
                openai = c.post("/v1/audio/speech", json={"model": "m", "voice": "words", "input": "Hi."})
                _assert_error(openai, 404, "invalid_profile")
        assert srv.terminate(timeout=30) == 0


@pytest.mark.slow
def test_a_fifo_or_a_bad_profile_added_while_running_freezes_nothing(demo_dir: Path, tmp_path: Path) -> None:
    voices = tmp_path / "voices"
    voices.mkdir()
    _good(voices, "alice", 4.5)
    with server_process(_env(demo_dir, voices), tmp_path / "server.log", startup_timeout=STARTUP_S) as srv:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            assert _served_ids(c)[0] == ["alice", "demo"]
            os.mkfifo(voices / "late.safetensors")  # the watcher sees it and syncs the registry
            _with_metadata(voices, "latewords", source_seconds="abc")
            time.sleep(WATCH_S)  # the watcher's sync has run (it blocked on the FIFO, holding the registry's lock)
            t0 = time.monotonic()
            assert c.get("/health", timeout=5).status_code == 200
            assert _served_ids(c)[0] == ["alice", "demo"]
            _assert_error(_synthesize(c, "late", timeout=10), 404, "invalid_profile")
            _assert_error(_synthesize(c, "latewords", timeout=10), 404, "invalid_profile")
            assert c.get("/health", timeout=5).status_code == 200
            assert time.monotonic() - t0 < 5.0  # none of it waited on the FIFO
            r = _synthesize(c, "alice")
            assert r.status_code == 200 and len(r.content) > 0, r.text
            # A FIFO swapped in for a good profile: that voice becomes unusable, the others stay.
            os.unlink(voices / "alice.safetensors")
            os.mkfifo(voices / "alice.safetensors")
            _assert_error(_synthesize(c, "alice", timeout=10), 404, "invalid_profile")
            assert c.get("/health", timeout=5).status_code == 200
            assert _served_ids(c)[0] == ["demo"]
        _wait_for_log(srv, "skipping voice profile late.safetensors: not a regular file (a FIFO)")
        _wait_for_log(srv, "skipping voice profile latewords.safetensors: metadata source_seconds 'abc'")
        _wait_for_log(srv, "skipping voice profile alice.safetensors: not a regular file (a FIFO)")
        assert srv.terminate(timeout=30) == 0


# --- load_profile and the registry, in process --------------------------------------------------------------------
def _in_thread(fn, timeout: float = 5.0):
    """fn() on a daemon thread: its result or exception, or a failure if it blocks (a FIFO open would)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "blocked"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_fifo_is_refused_from_its_stat_without_being_opened(tmp_path: Path) -> None:
    fifo = tmp_path / "f.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ProfileError, match=r"^not a regular file \(a FIFO\)$"):
        _in_thread(lambda: load_profile(fifo))
    os.symlink("/dev/null", tmp_path / "n.safetensors")
    with pytest.raises(ProfileError, match=r"^not a regular file \(a character device\)$"):
        load_profile(tmp_path / "n.safetensors")
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(ProfileError, match=r"^not a regular file \(a directory\)$"):
        load_profile(tmp_path / "d.safetensors")


def test_a_fifo_swapped_in_after_the_stat_is_opened_without_blocking_and_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    regular = _with_metadata(tmp_path, "regular")
    fifo = tmp_path / "swapped.safetensors"
    os.mkfifo(fifo)
    real_stat = os.stat
    # The stat sees the regular file that was there; by the open a FIFO has taken its place.
    monkeypatch.setattr(voices.os, "stat", lambda p, **kw: real_stat(regular if p == str(fifo) else p, **kw))
    with pytest.raises(ProfileError, match=r"^not a regular file \(a FIFO\)$"):
        _in_thread(lambda: voices.read_profile_bytes(fifo))
    # A symlink is refused from its lstat where the caller reads a resolved path (the registry does)...
    link = tmp_path / "link.safetensors"
    os.symlink(regular, link)
    with pytest.raises(ProfileError, match=r"^not a regular file \(a symlink\)$"):
        voices.read_profile_bytes(link, follow_symlinks=False)
    # ... and by O_NOFOLLOW when it is swapped in after that lstat.
    monkeypatch.setattr(voices.os, "stat", lambda p, **kw: real_stat(regular if p == str(link) else p, **kw))
    with pytest.raises(ProfileError, match=r"^cannot read: Too many levels of symbolic links$"):
        voices.read_profile_bytes(link, follow_symlinks=False)
    monkeypatch.setattr(voices.os, "stat", real_stat)
    assert load_profile(link).dim == DEMO_DIM  # followed where the caller allows it


@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        ({"source_seconds": "abc"}, "metadata source_seconds 'abc' is not a number of seconds"),
        ({"source_seconds": "nan"}, "metadata source_seconds 'nan' is not a finite number of seconds >= 0"),
        ({"source_seconds": "-inf"}, "metadata source_seconds '-inf' is not a finite number of seconds >= 0"),
        ({"source_seconds": "1e999"}, "metadata source_seconds '1e999' is not a finite number of seconds >= 0"),
        ({"source_seconds": "-0.5"}, "metadata source_seconds '-0.5' is not a finite number of seconds >= 0"),
        ({"source_seconds": "x" * 100}, "metadata source_seconds '" + "x" * 37 + "...' is not a number of seconds"),
        ({"dim": "wide"}, "metadata dim 'wide' is not a whole number"),
        ({"dim": "31"}, f"metadata dim '31' is not the x_vector's width {DEMO_DIM}"),
        ({"dim": "9" * 5000}, "is not the x_vector's width"),  # int() of 5000 digits raises ValueError
        ({"format": "qwen3-tts-voice/2"}, "unknown profile format 'qwen3-tts-voice/2'"),
    ],
)
def test_metadata_that_breaks_the_format_is_refused_with_its_reason(
    tmp_path: Path, metadata: dict[str, str], reason: str
) -> None:
    path = _with_metadata(tmp_path, "v", **metadata)
    with pytest.raises(ProfileError) as e:
        load_profile(path, expected_dim=DEMO_DIM)
    assert reason in str(e.value)


@pytest.mark.parametrize(
    ("metadata", "seconds"),
    [({"source_seconds": ""}, None), ({"source_seconds": " 2.5 "}, 2.5), ({"source_seconds": "0"}, 0.0), ({}, None)],
)
def test_valid_or_absent_source_seconds_load(tmp_path: Path, metadata: dict[str, str], seconds: float | None) -> None:
    profile = load_profile(_with_metadata(tmp_path, "v", created_at="whenever", **metadata), expected_dim=DEMO_DIM)
    assert profile.source_seconds == seconds and profile.created_at == "whenever"


def test_an_empty_vector_is_refused_not_a_torch_error(tmp_path: Path) -> None:
    path = tmp_path / "e.safetensors"
    save_file({"x_vector": torch.zeros(0)}, str(path))
    with pytest.raises(ProfileError, match="x_vector is empty"):
        load_profile(path)


def test_random_and_truncated_bytes_only_ever_raise_profile_error(tmp_path: Path) -> None:
    good = _with_metadata(tmp_path, "g", source_seconds="3").read_bytes()
    rng = random.Random(46)
    path = tmp_path / "fuzz.safetensors"
    for i in range(300):
        data = bytearray(good)
        if i % 3 == 0:
            data = data[: rng.randrange(len(data))]
        else:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        path.write_bytes(bytes(data))
        with contextlib.suppress(ProfileError):
            load_profile(path)


def test_the_registry_skips_every_bad_file_and_serves_the_good_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _good(tmp_path, "alice", 4.5)
    os.mkfifo(tmp_path / "fifo.safetensors")
    _with_metadata(tmp_path, "words", source_seconds="abc")
    real = voices._profile_from_bytes

    def parse(data: bytes, dim: int | None) -> VoiceProfile:
        if b"odd" in data:  # an error no check foresaw (a library bug, say) is still only that file's problem
            raise KeyError("x")
        return real(data, dim)

    monkeypatch.setattr(voices, "_profile_from_bytes", parse)
    _with_metadata(tmp_path, "odd", model="odd")
    registry = VoiceRegistry(tmp_path, xvector_dim=DEMO_DIM)
    report = _in_thread(registry.load_all)
    assert report.loaded == ["alice"]
    assert dict(report.skipped) == {
        "fifo.safetensors": "not a regular file (a FIFO)",
        "odd.safetensors": "unreadable (KeyError)",
        "words.safetensors": "metadata source_seconds 'abc' is not a number of seconds",
    }
    assert [s.speaker_id for s in _in_thread(registry.list_speakers)] == ["alice"]
    assert _in_thread(registry.sync) == ([], [])
    for speaker_id in ("fifo", "odd", "words"):
        with pytest.raises(InvalidProfileError):
            registry.get(speaker_id)
    os.mkfifo(tmp_path / "late.safetensors")  # appears later: the watcher's sync reads it
    assert _in_thread(registry.sync) == ([], [])
    assert len(registry) == 1 and "late" not in registry
