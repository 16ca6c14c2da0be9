"""Voice management over HTTP (tts_server/voice_routes.py) on the real NativeEngine with the tiny demo checkpoint:
upload -> synthesize with the new voice -> delete; every refusal of a bad clip or form; off by default; keys; the
profiles directory watched (a profile copied in is served without a restart); GET /v1/models/{id}."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import soundfile as sf
import torch
from media_helpers import ffmpeg_clip

from qwen_tts import icl_profile
from qwen_tts.engine_api import EngineSettings
from qwen_tts.engines.fake import FakeEngine
from qwen_tts.engines.native import NativeEngine
from qwen_tts.model.codec_encoder import load_codec_encoder
from qwen_tts.model.model_paths import resolve_model_path
from qwen_tts.voices import VoiceEncoder, embed_clip, ensure_demo_voice, file_mode, load_clip, load_profile
from server_helpers import InProcess, clean_settings, in_process, write_voice
from tts_server.runtime import Runtime, StartupError

pytestmark = pytest.mark.asyncio(loop_scope="module")

SR = 24000
CAP = 16  # frames per synthesis here: short audio keeps the module fast
KEY = "test-key-123456"


def speechlike(seconds: float, sr: int, f0: float = 140.0, amp: float = 0.3) -> np.ndarray:
    """Harmonics of a wobbling f0 gated at a syllable rate, plus a little noise: speech-like levels."""
    rng = np.random.default_rng(int(f0))
    t = np.arange(int(seconds * sr)) / sr
    phase = 2 * np.pi * np.cumsum(f0 * (1 + 0.08 * np.sin(2 * np.pi * 0.7 * t))) / sr
    x = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t) ** 2)
    x = x + 0.02 * rng.standard_normal(t.size)
    return (amp * x / np.max(np.abs(x))).astype(np.float32)


def clip_bytes(x: np.ndarray, sr: int, fmt: str = "WAV", channels: int = 1) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.stack([x] * channels, axis=1) if channels > 1 else x, sr, format=fmt)
    return buf.getvalue()


GOOD_CLIP = clip_bytes(speechlike(6.0, 44100), 44100, channels=2)


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model_path("demo", demo_dir=tmp_path_factory.mktemp("model") / "demo-tiny")


def native(demo_model: Path) -> NativeEngine:
    return NativeEngine(EngineSettings(model_path=str(demo_model), max_slots=2, max_queue=4, max_frames=64))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(demo_model: Path, tmp_path_factory: pytest.TempPathFactory):
    voices = tmp_path_factory.mktemp("voices")
    ensure_demo_voice(voices, demo_model)
    async with in_process(
        native(demo_model),
        profiles_dir=voices,
        voice_upload=True,
        voice_upload_max_seconds=20.0,
        voice_upload_max_bytes=4 * 1024 * 1024,
        max_new_tokens=64,
    ) as s:
        yield s


async def upload(server: InProcess, name: str = "newvoice", clip: bytes = GOOD_CLIP, **extra: str):
    data = {"name": name, **extra}
    return await server.client.post("/v1/audio/voices", data=data, files={"audio_sample": ("me.wav", clip)})


def _synth(voice: str) -> dict:
    return {"speaker_id": voice, "text": "Hello in a new voice.", "max_new_tokens": CAP, "seed": 3}


def _profiles(server: InProcess) -> list[str]:
    return sorted(os.listdir(server.runtime.voices.profiles_dir))


# --- the whole life of an uploaded voice ----------------------------------------------------------------------
async def test_upload_then_synthesize_with_it_then_delete(server: InProcess, demo_model: Path) -> None:
    r = await upload(server, ref_text="  The words of the clip.  ")
    assert r.status_code == 201, r.text
    body = r.json()
    voice = body["voice"]
    assert body["success"] is True and body["warnings"] == []
    assert voice["id"] == "newvoice" and voice["dim"] == server.runtime.engine.xvector_dim
    assert voice["ref_text"] == "The words of the clip." and voice["source_seconds"] == pytest.approx(6.0)
    assert voice["icl"] is True and voice["ref_seconds"] == 6.0  # a transcript given: an ICL voice, 75 frames

    # Persisted as a profile with the atomic write's file mode, holding what the extractor's path computes.
    path = server.runtime.voices.profiles_dir / "newvoice.safetensors"
    assert (path.stat().st_mode & 0o777) == file_mode()
    profile = load_profile(path)
    expected, _ = embed_clip(VoiceEncoder(demo_model), io.BytesIO(GOOD_CLIP))
    torch.testing.assert_close(profile.x_vector, expected, rtol=0, atol=0)
    assert profile.ref_text == "The words of the clip." and len(profile.source_sha256) == 64
    # Its reference codes: the codec encoder's on the clip's mono 24 kHz signal, computed once at upload.
    codes = load_codec_encoder(demo_model).encode(load_clip(io.BytesIO(GOOD_CLIP)).mono, SR)
    assert profile.ref_codes.shape == (75, 16) and torch.equal(profile.ref_codes, codes)
    assert server.runtime.voices.reference("newvoice").key == icl_profile.reference_key(codes, profile.ref_text)

    listed = (await server.client.get("/v1/audio/voices")).json()
    assert listed["voices"] == ["demo", "newvoice"] and listed["upload_enabled"] is True
    assert [v["id"] for v in listed["data"]] == ["demo", "newvoice"]
    assert "newvoice" in [s["id"] for s in (await server.client.get("/speakers")).json()["speakers"]]

    # Usable by the very next request, on every route, with the enrolled vector (already loaded by the upload).
    torch.testing.assert_close(server.runtime.voices.get("newvoice").cpu(), expected, rtol=0, atol=0)
    mine = await server.client.post("/synthesize", json=_synth("newvoice"))
    assert mine.status_code == 200, mine.text
    assert mine.headers["x-voice-mode"] == "icl"
    audio, rate = sf.read(io.BytesIO(mine.content), dtype="float32")
    assert rate == SR and audio.size > 0 and np.abs(audio).max() > 0
    speech = await server.client.post(
        "/v1/audio/speech",
        json={"model": "qwen3-tts", "voice": "newvoice", "input": "Hi.", "response_format": "wav", "max_new_tokens": 8},
    )
    assert speech.status_code == 200, speech.text

    r = await server.client.delete("/v1/audio/voices/newvoice")
    assert r.status_code == 200 and r.json() == {
        "success": True,
        "id": "newvoice",
        "message": "voice 'newvoice' deleted",
    }
    assert not path.exists()
    gone = await server.client.post("/synthesize", json=_synth("newvoice"))
    assert gone.status_code == 404
    assert (await server.client.get("/v1/audio/voices")).json()["voices"] == ["demo"]
    again = await server.client.delete("/v1/audio/voices/newvoice")
    assert again.status_code == 404 and again.json()["error"]["code"] == "voice_not_found"


@pytest.mark.parametrize("kind", ["m4a", "webm"])
async def test_a_phone_or_browser_recording_enrols(server: InProcess, demo_model: Path, kind: str) -> None:
    clip = ffmpeg_clip(np.stack([speechlike(6.0, 44100)] * 2, axis=1), 44100, kind)
    name = f"memo-{kind}"
    files = {"audio_sample": (f"memo.{kind}", clip, "audio/mp4")}
    r = await server.client.post("/v1/audio/voices", data={"name": name}, files=files)
    assert r.status_code == 201, r.text
    assert r.json()["voice"]["source_seconds"] == pytest.approx(6.0, abs=0.05)
    expected, _ = embed_clip(VoiceEncoder(demo_model), io.BytesIO(clip))
    torch.testing.assert_close(load_profile(server.runtime.voices.path_for(name)).x_vector, expected, rtol=0, atol=0)
    assert (await server.client.post("/synthesize", json=_synth(name))).status_code == 200
    assert (await server.client.delete(f"/v1/audio/voices/{name}")).status_code == 200


async def test_a_broken_m4a_is_422_naming_the_file_and_format(server: InProcess) -> None:
    clip = ffmpeg_clip(speechlike(3.0, 16000), 16000, "m4a")[:-200]  # the end (its index, 'moov') cut off
    before = _profiles(server)
    files = {"audio_sample": ("memo.m4a", clip)}
    r = await server.client.post("/v1/audio/voices", data={"name": "broken"}, files=files)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == "audio_sample" and error["code"] == "invalid_audio"
    assert error["message"].startswith("audio_sample: cannot decode 'memo.m4a' as MP4/M4A audio ("), error
    assert _profiles(server) == before


async def test_a_taken_name_is_a_conflict_and_the_first_voice_stays(server: InProcess) -> None:
    assert (await upload(server, "twice")).status_code == 201
    before = (server.runtime.voices.profiles_dir / "twice.safetensors").read_bytes()
    other = clip_bytes(speechlike(6.0, 16000, f0=220.0), 16000)
    for name in ("twice", "TWICE"):  # one file on a case-insensitive filesystem: refused too
        r = await upload(server, name, other)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["param"] == "name" and "'twice' exists" in r.json()["error"]["message"]
    assert (server.runtime.voices.profiles_dir / "twice.safetensors").read_bytes() == before
    assert (await server.client.delete("/v1/audio/voices/twice")).status_code == 200


# --- refusals: the extractor's checks, the form, the limits ---------------------------------------------------
@pytest.mark.parametrize(
    ("clip", "message"),
    [
        (
            clip_bytes(speechlike(0.5, 24000), 24000),
            "audio_sample: too short (0.50 s; a reference clip needs at least 1 s)",
        ),
        (clip_bytes(speechlike(25.0, 8000), 8000), "audio_sample: too long (25.0 s; the limit is 20 s"),
        (clip_bytes(np.zeros(24000 * 3, np.float32), 24000), "audio_sample: silent or nearly"),
        (clip_bytes(np.clip(speechlike(4.0, 24000, amp=1.0) * 8, -1, 1), 24000), "audio_sample: heavily clipped"),
        (
            b"RIFF\x00\x00not really a wave file at all" * 10,
            "audio_sample: cannot decode 'me.wav' as audio (not one of",
        ),
    ],
    ids=["short", "long", "silent", "clipped", "not-audio"],
)
async def test_bad_clips_are_refused_with_the_extractors_reason(server: InProcess, clip: bytes, message: str) -> None:
    before = _profiles(server)
    r = await upload(server, "badclip", clip)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == "audio_sample" and error["code"] == "invalid_audio"
    assert error["message"].startswith(message), error["message"]
    assert _profiles(server) == before


async def test_bad_forms_are_refused_naming_the_field(server: InProcess) -> None:
    before = _profiles(server)
    cases = [
        ({"data": {"name": "../evil"}, "files": {"audio_sample": ("a.wav", GOOD_CLIP)}}, 422, "name"),
        ({"data": {"name": "x" * 65}, "files": {"audio_sample": ("a.wav", GOOD_CLIP)}}, 422, "name"),
        ({"data": {"name": "nofile"}}, 400, None),  # httpx sends a urlencoded form: not multipart
        ({"data": {"name": "nofile"}, "files": {"other": ("a.wav", GOOD_CLIP)}}, 422, "other"),
        ({"data": {"name": "nofile", "audio_sample": "text"}, "files": {"x": ("a", b"")}}, 422, "x"),
        ({"data": {"name": ""}, "files": {"audio_sample": ("a.wav", GOOD_CLIP)}}, 422, "name"),
        ({"data": {"name": "empty"}, "files": {"audio_sample": ("a.wav", b"")}}, 422, "audio_sample"),
        (
            {"data": {"name": "t", "ref_text": "x" * 5000}, "files": {"audio_sample": ("a.wav", GOOD_CLIP)}},
            422,
            "ref_text",
        ),
    ]
    for kwargs, status, param in cases:
        r = await server.client.post("/v1/audio/voices", **kwargs)
        assert r.status_code == status, (kwargs.get("data"), r.text)
        assert r.json()["error"]["param"] == param, r.json()
    r = await server.client.post("/v1/audio/voices", json={"name": "x"})
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]
    r = await server.client.post(
        "/v1/audio/voices", content=b"--zz\r\nbroken", headers={"content-type": "multipart/form-data; boundary=zz"}
    )
    assert r.status_code in (400, 422), r.text
    assert _profiles(server) == before


async def test_an_upload_without_a_transcript_is_an_x_vector_voice(server: InProcess) -> None:
    r = await upload(server, "plainvoice", ref_text="   ")
    assert r.status_code == 201, r.text
    assert (r.json()["voice"]["icl"], r.json()["voice"]["ref_seconds"], r.json()["voice"]["ref_text"]) == (
        False,
        None,
        "",
    )
    assert load_profile(server.runtime.voices.profiles_dir / "plainvoice.safetensors").ref_codes is None
    r = await server.client.post("/synthesize", json=_synth("plainvoice"))
    assert r.status_code == 200 and r.headers["x-voice-mode"] == "xvector"
    r = await server.client.post("/synthesize", json=_synth("plainvoice") | {"voice_mode": "icl"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "voice_mode"
    assert (await server.client.delete("/v1/audio/voices/plainvoice")).status_code == 200


async def test_an_icl_upload_with_a_transcript_of_no_words_is_refused_naming_ref_text(server: InProcess) -> None:
    before = _profiles(server)
    r = await upload(server, "dots", ref_text="... ?!")
    assert r.status_code == 422 and r.json()["error"]["param"] == "ref_text"
    assert r.json()["error"]["message"] == "ref_text: the transcript has no letters or digits"
    assert _profiles(server) == before


async def test_an_icl_upload_on_a_server_without_the_codec_encoder_names_ref_text(
    server: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing(model_path, device="cpu"):
        raise ModuleNotFoundError("No module named 'qwen_tts.model.codec_encoder'")

    monkeypatch.setattr(icl_profile, "load_reference_encoder", missing)
    monkeypatch.setattr(server.runtime, "_reference_encoder", None)
    r = await upload(server, "noenc", ref_text="The words.")
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("ref_text", "icl_unavailable")
    assert error["message"].startswith("ref_text: this server cannot compute ICL reference codes (ModuleNotFoundError")
    assert "noenc.safetensors" not in _profiles(server)


async def test_an_upload_over_the_size_limit_is_413_before_parsing(server: InProcess) -> None:
    big = clip_bytes(speechlike(19.0, 96000), 96000, channels=2)  # ~7 MB: over the 4 MiB set for this server
    r = await upload(server, "big", big)
    assert r.status_code == 413
    assert r.json()["error"]["message"] == (
        "request body is larger than the limit of 4194304 bytes (TTS_VOICE_UPLOAD_MAX_BYTES; clips are also limited "
        "to TTS_VOICE_UPLOAD_MAX_SECONDS=20 s)"
    )
    assert r.json()["error"]["param"] == "audio_sample"
    # JSON routes keep their own, small limit.
    r = await server.client.post("/synthesize", json={"speaker_id": "demo", "text": "x" * 70000})
    assert r.status_code == 413 and "65536 bytes" in r.json()["error"]["message"]


async def test_delete_refuses_malformed_names_and_links_out(server: InProcess, tmp_path: Path) -> None:
    r = await server.client.delete("/v1/audio/voices/..%2Fetc")
    assert r.status_code in (404, 422)
    outside = write_voice(tmp_path, "outside", server.runtime.engine.xvector_dim)
    link = server.runtime.voices.profiles_dir / "sneaky.safetensors"
    link.symlink_to(outside)
    try:
        r = await server.client.delete("/v1/audio/voices/sneaky")
        assert r.status_code == 404
        assert outside.exists() and link.is_symlink()
    finally:
        link.unlink()


async def test_the_upload_byte_limit_follows_the_duration_limit(demo_model: Path, tmp_path: Path) -> None:
    """Unset, TTS_VOICE_UPLOAD_MAX_BYTES fits the longest clip accepted in any format a recorder writes: 60 s of CD
    stereo WAV (10.6 MB, over the former fixed 10 MiB) enrols, and a 413 names both limits."""
    cd_wav = clip_bytes(speechlike(60.0, 44100), 44100, channels=2)
    assert len(cd_wav) > 10 * 1024 * 1024
    ensure_demo_voice(tmp_path, demo_model)
    async with in_process(native(demo_model), profiles_dir=tmp_path, voice_upload=True) as s:
        assert s.runtime.settings.voice_upload_max_bytes == 60 * 48_000 * 2 * 4 + 1024 * 1024
        r = await upload(s, "long-cd", cd_wav)
        assert r.status_code == 201, r.text
        assert r.json()["voice"]["source_seconds"] == pytest.approx(60.0)
    shorter = tmp_path / "shorter"
    shorter.mkdir()
    ensure_demo_voice(shorter, demo_model)
    async with in_process(
        native(demo_model), profiles_dir=shorter, voice_upload=True, voice_upload_max_seconds=20
    ) as s:
        limit = 20 * 48_000 * 2 * 4 + 1024 * 1024
        assert s.runtime.settings.voice_upload_max_bytes == limit
        r = await upload(s, "long-cd", cd_wav)
        assert r.status_code == 413
        assert r.json()["error"]["message"] == (
            f"request body is larger than the limit of {limit} bytes (TTS_VOICE_UPLOAD_MAX_BYTES unset: derived "
            "from TTS_VOICE_UPLOAD_MAX_SECONDS=20, that many seconds of 48 kHz stereo 32-bit audio plus 1024 KiB)"
        )


# --- off by default, keys, no encoder unless enabled ----------------------------------------------------------
async def test_upload_and_delete_are_off_by_default(tmp_path: Path) -> None:
    assert clean_settings().voice_upload is False
    write_voice(tmp_path, "keep", 16)
    async with in_process(FakeEngine(xvector_dim=16), profiles_dir=tmp_path, backend="fake") as s:
        assert s.runtime.voice_encoder is None  # no speaker encoder loaded
        small = clip_bytes(speechlike(1.5, 8000), 8000)
        r = await s.client.post("/v1/audio/voices", data={"name": "x"}, files={"audio_sample": ("a.wav", small)})
        assert r.status_code == 403 and r.json()["error"]["code"] == "voice_management_disabled"
        assert "TTS_VOICE_UPLOAD" in r.json()["error"]["message"]
        r = await s.client.delete("/v1/audio/voices/keep")
        assert r.status_code == 403
        assert (tmp_path / "keep.safetensors").exists()
        listed = (await s.client.get("/v1/audio/voices")).json()
        assert "keep" in listed["voices"] and listed["upload_enabled"] is False
        # A disabled upload route refuses before reading any of the body: a real-sized clip gets the same 403, not a
        # 413 about the size of a body nobody would read.
        r = await s.client.post("/v1/audio/voices", data={"name": "x"}, files={"audio_sample": ("a.wav", b"0" * 70000)})
        assert r.status_code == 403 and r.json()["error"]["code"] == "voice_management_disabled"


async def test_upload_needs_a_checkpoint_with_a_speaker_encoder(tmp_path: Path) -> None:
    settings = clean_settings(profiles_dir=tmp_path, backend="fake", voice_upload=True)
    with pytest.raises(StartupError, match="TTS_VOICE_UPLOAD=true needs a checkpoint with a speaker encoder"):
        await Runtime.start(settings, engine=FakeEngine(xvector_dim=16))


async def test_keys_are_required_for_every_voice_route_when_configured(demo_model: Path, tmp_path: Path) -> None:
    ensure_demo_voice(tmp_path, demo_model)
    async with in_process(native(demo_model), profiles_dir=tmp_path, voice_upload=True, api_keys=[KEY]) as s:
        files = {"audio_sample": ("a.wav", GOOD_CLIP)}
        r = await s.client.post("/v1/audio/voices", data={"name": "keyed"}, files=files)
        assert r.status_code == 401
        assert not (tmp_path / "keyed.safetensors").exists()
        assert (await s.client.get("/v1/audio/voices")).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        r = await s.client.post("/v1/audio/voices", data={"name": "keyed"}, files=files, headers=auth)
        assert r.status_code == 201, r.text
        assert (await s.client.delete("/v1/audio/voices/keyed")).status_code == 401
        assert (tmp_path / "keyed.safetensors").exists()
        assert (await s.client.delete("/v1/audio/voices/keyed", headers=auth)).status_code == 200
        assert not (tmp_path / "keyed.safetensors").exists()


# --- the watched directory ------------------------------------------------------------------------------------
async def _speakers_count(s: InProcess) -> int:
    # /health counts the registry's loaded voices: only the watcher changes it while no request names a voice.
    return (await s.client.get("/health")).json()["speakers"]


async def _until(predicate, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "the watcher did not pick up the change"
        await asyncio.sleep(0.05)


async def test_a_profile_copied_into_the_directory_is_served_without_restart(server: InProcess, tmp_path: Path) -> None:
    dim = server.runtime.engine.xvector_dim
    made = write_voice(tmp_path, "copied", dim, seed=5)
    start = await _speakers_count(server)
    shutil.copy(made, server.runtime.voices.profiles_dir / "copied.safetensors")
    await _until(lambda: _count_is(server, start + 1))
    assert server.runtime.profile_watcher is not None and server.runtime.profile_watcher.syncs >= 1
    r = await server.client.post("/synthesize", json=_synth("copied"))
    assert r.status_code == 200, r.text

    (server.runtime.voices.profiles_dir / "copied.safetensors").unlink()
    await _until(lambda: _count_is(server, start))
    assert (await server.client.post("/synthesize", json=_synth("copied"))).status_code == 404


async def _count_is(s: InProcess, n: int) -> bool:
    return await _speakers_count(s) == n


# --- GET /v1/models/{id} --------------------------------------------------------------------------------------
async def test_models_retrieve_answers_for_the_served_model_only(server: InProcess) -> None:
    listed = (await server.client.get("/v1/models")).json()["data"][0]
    r = await server.client.get("/v1/models/qwen3-tts")
    assert r.status_code == 200 and r.json() == listed
    r = await server.client.get("/v1/models/Qwen/Qwen3-TTS-12Hz-1.7B-Base")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and "'qwen3-tts'" in r.json()["error"]["message"]


async def test_a_wrong_method_names_every_method_of_the_path(server: InProcess) -> None:
    # GET and POST /v1/audio/voices are two routes: the 405's Allow lists both (Starlette's names the first only).
    r = await server.client.put("/v1/audio/voices")
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD, POST"
    assert r.json()["error"]["code"] == "method_not_allowed"
    assert (await server.client.get("/v1/audio/voices/x")).headers["allow"] == "DELETE"
    assert (await server.client.get("/synthesize")).headers["allow"] == "POST"


# --- a real server process ------------------------------------------------------------------------------------
@pytest.mark.slow
async def test_voices_over_a_real_socket(demo_model: Path, tmp_path: Path) -> None:
    """`python inference_server.py` with uploads on and a key: the multipart body through uvicorn and the body
    limit, the voice usable at once, a profile copied in by hand served, delete; one log line per change."""
    await asyncio.to_thread(_real_socket_scenario, demo_model, tmp_path)


def _real_socket_scenario(demo_model: Path, tmp_path: Path) -> None:
    import httpx

    from server_helpers import server_process

    profiles = tmp_path / "voices"
    env = {
        "TTS_DEMO_DIR": str(demo_model),
        "TTS_PROFILES_DIR": str(profiles),
        "TTS_VOICE_UPLOAD": "true",
        "TTS_API_KEYS": KEY,
        "TTS_MAX_NEW_TOKENS": "32",
    }
    with (
        server_process(env, tmp_path / "server.log") as srv,
        httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client,
    ):
        r = client.post("/v1/audio/voices", data={"name": "sock"}, files={"audio_sample": ("me.flac", GOOD_CLIP)})
        assert r.status_code == 201, r.text
        r = client.post("/synthesize", json=_synth("sock"))
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"

        speakers = client.get("/health").json()["speakers"]
        shutil.copy(write_voice(tmp_path, "byhand", r_dim(client), seed=9), profiles / "byhand.safetensors")
        deadline = time.monotonic() + 15
        while client.get("/health").json()["speakers"] != speakers + 1:
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.05)
        assert client.post("/synthesize", json=_synth("byhand")).status_code == 200

        assert client.delete("/v1/audio/voices/sock").status_code == 200
        assert client.delete("/v1/audio/voices/byhand").status_code == 200
        assert client.get("/v1/audio/voices").json()["voices"] == ["demo"]
        log = srv.log()
    assert "Voice upload enabled: speaker encoder loaded" in log
    assert "voice 'byhand' loaded from" in log and "Traceback" not in log


def r_dim(client) -> int:  # the served x-vector width, from /health
    return client.get("/health").json()["model"]["xvector_dim"]


async def test_uploads_without_keys_are_warned_about_at_startup(caplog: pytest.LogCaptureFixture) -> None:
    from tts_server.serve import warn_if_open

    warn_if_open(clean_settings(host="127.0.0.1", voice_upload=True))
    assert "TTS_VOICE_UPLOAD is on with no API keys" in caplog.text
    caplog.clear()
    warn_if_open(clean_settings(host="127.0.0.1", voice_upload=True, api_keys=[KEY]))
    warn_if_open(clean_settings(host="127.0.0.1"))
    assert "TTS_VOICE_UPLOAD" not in caplog.text
