"""A synthesis body's own reference clip and transcript (TTS_INLINE_REFERENCE, tts_server/inline_reference.py):
enrolled on the fly as an ICL voice with the tiny checkpoint's speaker and codec encoders, cached by content hash
within its bound, refused naming the field; in process on the fake engine, which records what it was asked."""

from __future__ import annotations

import base64
import io
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from qwen_tts import icl_profile
from qwen_tts.engines.fake import FakeEngine
from qwen_tts.model.codec_encoder import load_codec_encoder
from qwen_tts.model.config import ModelConfig
from qwen_tts.voices import VoiceEncoder, load_clip
from server_helpers import clean_settings, in_process
from tts_server import inline_reference
from tts_server.inline_reference import body_limit_bytes
from tts_server.settings import upload_bytes_for
from ws_helpers import AsgiWebSocket

pytestmark = pytest.mark.asyncio

TEXT = "Words in a voice sent along."
REF_TEXT = "What this clip says."


class CheckpointFake(FakeEngine):
    """The fake engine, saying it serves `path` (whose encoders enrolment loads) at that checkpoint's width."""

    def __init__(self, path: Path):
        super().__init__(xvector_dim=ModelConfig.from_pretrained(path).xvector_dim)
        self.path = path

    @property
    def model_info(self) -> dict:
        return super().model_info | {"path": str(self.path)}


def clip(seconds: float = 6.0, f0: float = 150.0, sr: int = 16000) -> bytes:
    t = np.arange(int(seconds * sr)) / sr
    x = 0.3 * np.sin(2 * np.pi * f0 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t) ** 2)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), sr, format="WAV")
    return buf.getvalue()


def body(audio: bytes, text: str = REF_TEXT, **extra) -> dict:
    ref = {"audio": base64.b64encode(audio).decode(), "text": text}
    return {"speaker_id": "caller", "text": TEXT, "reference": ref, **extra}


def _server(tiny_checkpoint: Path, profiles: Path, **settings):
    return in_process(CheckpointFake(tiny_checkpoint), profiles_dir=profiles, **settings)


async def test_an_inline_reference_is_enrolled_once_and_served_as_an_icl_voice(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    enrolled: list[str] = []
    real_enroll = inline_reference.enroll_clip
    monkeypatch.setattr(
        inline_reference, "enroll_clip", lambda *a, **k: enrolled.append(k["ref_text"]) or real_enroll(*a, **k)
    )
    audio = clip()
    async with _server(tiny_checkpoint, tmp_path / "voices", inline_reference=True) as s:
        r = await s.client.post("/synthesize", json=body(audio))
        assert r.status_code == 200, r.text
        assert r.headers["x-voice-mode"] == "icl"
        request = s.runtime.engine.submitted[-1]
        mono = load_clip(io.BytesIO(audio)).mono
        torch.testing.assert_close(request.xvector.cpu(), VoiceEncoder(tiny_checkpoint).embed(mono), rtol=0, atol=0)
        assert torch.equal(request.icl.codes, load_codec_encoder(tiny_checkpoint).encode(mono, 24000))
        assert request.icl.text == REF_TEXT and request.icl.frames == 75
        # The same clip and text again, on another route: from the cache, no encoder runs.
        speech = {"model": "m", "voice": "caller", "input": TEXT, "reference": body(audio)["reference"]}
        r = await s.client.post("/v1/audio/speech", json=speech | {"response_format": "pcm"})
        assert r.status_code == 200 and r.headers["x-voice-mode"] == "icl"
        assert s.runtime.engine.submitted[-1].icl is request.icl and enrolled == [REF_TEXT]
        # voice_mode xvector: the clip's x-vector alone.
        r = await s.client.post("/synthesize/stream", json=body(audio, voice_mode="xvector"))
        assert r.status_code == 200 and r.headers["x-voice-mode"] == "xvector"
        last = s.runtime.engine.submitted[-1]
        assert last.icl is None and torch.equal(last.xvector, request.xvector)
        assert enrolled == [REF_TEXT] and len(s.runtime.inline_voices) == 1
        assert not (tmp_path / "voices").exists() or not list((tmp_path / "voices").iterdir())  # no profile written


async def test_the_cache_keeps_its_bound_dropping_the_least_recently_used(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    a, b, c = clip(f0=140.0), clip(f0=180.0), clip(f0=220.0)
    async with _server(tiny_checkpoint, tmp_path / "voices", inline_reference=True, inline_reference_cache=2) as s:
        for audio in (a, b, a, c):  # a used again before c arrives: b is the one dropped
            assert (await s.client.post("/synthesize", json=body(audio))).status_code == 200
        keys = [r.icl.key for r in s.runtime.engine.submitted]
        assert len(s.runtime.inline_voices) == 2 and keys[0] == keys[2] and len(set(keys)) == 3
        cached = {v[1].key for v in s.runtime.inline_voices._voices.values()}
        assert cached == {keys[0], keys[3]}
        # Another transcript for the same clip is another reference.
        assert (await s.client.post("/synthesize", json=body(a, text="Other words."))).status_code == 200
        assert s.runtime.engine.submitted[-1].icl.key not in keys


async def test_an_inline_reference_on_a_server_without_the_codec_encoder_names_reference(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing(model_path, device="cpu"):
        raise ModuleNotFoundError("No module named 'qwen_tts.model.codec_encoder'")

    monkeypatch.setattr(icl_profile, "load_reference_encoder", missing)
    async with _server(tiny_checkpoint, tmp_path / "voices", inline_reference=True) as s:
        r = await s.client.post("/synthesize", json=body(clip()))
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("reference", "icl_unavailable")
        assert error["message"] == (
            "reference: this server cannot compute ICL reference codes "
            "(ModuleNotFoundError: No module named 'qwen_tts.model.codec_encoder')"
        )
        assert s.runtime.engine.submitted == [] and len(s.runtime.inline_voices) == 0
        assert s.runtime.admission.active == 0


async def test_bad_inline_references_are_refused_naming_the_field(tiny_checkpoint: Path, tmp_path: Path) -> None:
    async with _server(tiny_checkpoint, tmp_path / "voices", inline_reference=True) as s:
        cases = [
            ({"speaker_id": "c", "text": TEXT, "reference": {"audio": "not base64!", "text": REF_TEXT}},
             "reference.audio", "reference.audio: not valid base64"),
            (body(clip(31.0)), "reference.audio", "reference.audio: too long (31.0 s; the limit is 30 s"),
            (body(clip(0.5)), "reference.audio", "reference.audio: too short"),
            (body(b"RIFF not really"), "reference.audio", "reference.audio: "),
            (body(clip(), text="?!"), "reference.text", "reference.text: the transcript has no letters or digits"),
            (body(clip(), text="   "), "reference.text", "reference.text: the transcript is empty"),
            ({"speaker_id": "c", "text": TEXT, "reference": {"audio": "AAAA"}}, "reference.text", ""),
        ]  # fmt: skip
        for payload, param, message in cases:
            r = await s.client.post("/synthesize", json=payload)
            assert r.status_code == 422, r.text
            error = r.json()["error"]
            assert error["param"] == param and error["message"].startswith(message), error
        assert s.runtime.engine.submitted == [] and len(s.runtime.inline_voices) == 0
        assert s.runtime.admission.active == 0
        # The WebSocket start message does not take one.
        ws = AsgiWebSocket(s.app)
        await ws.connect()
        assert (await ws.event())["type"] == "session"
        await ws.send_json({"type": "start", "voice": "caller", "reference": {"audio": "AAAA", "text": REF_TEXT}})
        event = await ws.event()
        assert event["type"] == "error" and event["error"]["param"] == "reference"
        await ws.disconnect()


async def test_inline_references_are_off_by_default(tiny_checkpoint: Path, tmp_path: Path) -> None:
    async with _server(tiny_checkpoint, tmp_path / "voices") as s:
        assert s.runtime.voice_encoder is None  # not even loaded
        r = await s.client.post("/synthesize", json=body(clip(1.2, sr=8000)))  # within the JSON body limit
        assert r.status_code == 422
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("reference", "inline_reference_disabled")
        assert "TTS_INLINE_REFERENCE=true" in error["message"]
        r = await s.client.post("/synthesize", json=body(clip()))  # a longer clip: past the JSON body limit first
        assert r.status_code == 413


async def test_the_body_limit_makes_room_for_the_base64_of_the_longest_clip_an_icl_reference_may_be() -> None:
    short = clean_settings(voice_upload_max_seconds=10.0)
    assert body_limit_bytes(short) == short.max_body_bytes + 4 * math.ceil(upload_bytes_for(10.0) / 3)
    for seconds in (30.0, 60.0, 600.0):  # an ICL reference is at most 30 s, whatever uploads may be
        assert (
            body_limit_bytes(clean_settings(voice_upload_max_seconds=seconds))
            == body_limit_bytes(clean_settings(voice_upload_max_seconds=30.0))
            > body_limit_bytes(short)
        )


async def test_with_inline_references_on_a_large_body_reaches_the_route_and_a_larger_one_is_a_413(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    async with _server(tiny_checkpoint, tmp_path / "voices", inline_reference=True, voice_upload_max_seconds=2.0) as s:
        limit = body_limit_bytes(s.runtime.settings)
        audio = clip(1.5, sr=48000)
        assert (await s.client.post("/synthesize", json=body(audio))).status_code == 200  # over TTS_MAX_BODY_BYTES
        assert len(base64.b64encode(audio)) > s.runtime.settings.max_body_bytes
        r = await s.client.post("/synthesize", content=b"{" + b" " * limit + b"}",
                                headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 413 and r.json()["error"]["param"] == "reference.audio"
