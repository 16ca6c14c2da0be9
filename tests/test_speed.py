"""`speed` (tts_server/speed.py): a pitch-preserving time-stretch, whole and streamed, on a synthetic tone and
through every synthesis route over the fake engine (whose audio is a pure tone of a known frequency)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from test_long_text import english_text

from qwen_tts.engines.fake import FakeEngine
from server_helpers import in_process, write_voice
from tts_server import speed as speed_module
from tts_server.long_text import split_text
from tts_server.speed import StreamStretcher, stretch

SR = 24000


def _tone(freq: float = 220.0, seconds: float = 4.0) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * freq * np.arange(int(seconds * SR)) / SR)).astype(np.float32)


def dominant_hz(x: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / SR)[np.argmax(spectrum)])


def off_tone_energy(x: np.ndarray, freq: float) -> float:
    """Share of the energy more than 20 Hz away from `freq`: clicks and smearing show up here."""
    power = np.abs(np.fft.rfft(x * np.hanning(len(x)))) ** 2
    return float(power[np.abs(np.fft.rfftfreq(len(x), 1 / SR) - freq) > 20].sum() / power.sum())


def _streamed(x: np.ndarray, rate: float) -> np.ndarray:
    """Fed as the engine streams: a 3-frame first chunk, then 12-frame chunks."""
    st, parts, pos = StreamStretcher(SR, rate), [], 0
    for size in [3 * 1920] + [12 * 1920] * (len(x) // (12 * 1920) + 1):
        parts.append(st.feed(x[pos : pos + size]))
        pos += size
    parts.append(st.close())
    return np.concatenate(parts)


@pytest.mark.parametrize("rate", [0.5, 2.0, 0.25, 4.0])
@pytest.mark.parametrize("mode", ["whole", "streamed"])
def test_stretch_changes_the_duration_and_keeps_the_pitch(rate: float, mode: str) -> None:
    x = _tone()
    y = stretch(x, SR, rate) if mode == "whole" else _streamed(x, rate)
    assert len(y) / len(x) == pytest.approx(1 / rate, rel=0.05)
    assert dominant_hz(y) == pytest.approx(220.0, abs=2.0)
    assert off_tone_energy(y, 220.0) < 0.005
    middle = y[len(y) // 10 : -len(y) // 10]  # the level is kept (Rubber Band overshoots ~15% in the last ms)
    assert np.abs(middle).max() == pytest.approx(0.3, rel=0.05)
    assert np.sqrt(np.mean(middle**2)) == pytest.approx(0.3 / np.sqrt(2), rel=0.05)


def test_speed_one_is_the_identity() -> None:
    x = _tone(seconds=0.5)
    assert stretch(x, SR, 1.0) is x


# --- through the routes ------------------------------------------------------------------------------------
def _decode(data: bytes, fmt: str) -> np.ndarray:
    if fmt in ("pcm",):
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768
    if fmt == "f32le":
        return np.frombuffer(data, "<f4")
    x, sr = sf.read(io.BytesIO(data), dtype="float32")
    assert sr == SR
    return x


ROUTES = [
    ("/v1/audio/speech", "pcm"),  # streamed
    ("/v1/audio/speech", "flac"),  # whole
    ("/synthesize", "wav"),  # whole
    ("/synthesize/stream", "f32le"),  # streamed
]


@pytest.mark.parametrize(("path", "fmt"), ROUTES)
@pytest.mark.parametrize("rate", [0.5, 2.0])
async def test_routes_take_speed_with_the_pitch_kept(path: str, fmt: str, rate: float, tmp_path: Path) -> None:
    engine = FakeEngine(frames_per_char=1.0)
    write_voice(tmp_path, "alice", 16)
    text = "x" * 40  # 40 frames: 3.2 s of the fake's tone
    if path == "/v1/audio/speech":
        body = {"model": "m", "voice": "alice", "input": text, "response_format": fmt, "seed": 3}
    else:
        body = {"speaker_id": "alice", "text": text, "response_format": fmt, "seed": 3}
    tone_hz = 110.0 + 10.0 * 3
    async with in_process(engine, profiles_dir=tmp_path) as s:
        plain = await s.client.post(path, json=body)
        fast = await s.client.post(path, json={**body, "speed": rate})
    assert plain.status_code == 200 and fast.status_code == 200, fast.text
    x, y = _decode(plain.content, fmt), _decode(fast.content, fmt)
    assert len(x) == 40 * 1920
    assert len(y) / len(x) == pytest.approx(1 / rate, rel=0.05)
    assert dominant_hz(y) == pytest.approx(tone_hz, abs=2.0)
    assert off_tone_energy(y, tone_hz) < 0.01


async def test_speed_out_of_range_or_without_the_library_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_voice(tmp_path, "alice", 16)
    async with in_process(FakeEngine(), profiles_dir=tmp_path) as s:
        r = await s.client.post("/synthesize", json={"speaker_id": "alice", "text": "hi", "speed": 4.5})
        assert r.status_code == 422 and r.json()["error"]["param"] == "speed"
        monkeypatch.setattr(speed_module, "pedalboard", None)
        r = await s.client.post("/synthesize/stream", json={"speaker_id": "alice", "text": "hi", "speed": 2.0})
        assert r.status_code == 422
        err = r.json()["error"]
        assert err["param"] == "speed" and "optional 'speed' extra" in err["message"]
        r = await s.client.post("/synthesize", json={"speaker_id": "alice", "text": "hi", "speed": 1.0})
        assert r.status_code == 200


async def test_speed_streams_across_the_pieces_of_a_long_text(tmp_path: Path) -> None:
    engine = FakeEngine(frames_per_char=0.05)
    write_voice(tmp_path, "alice", 16)
    body = {"speaker_id": "alice", "text": english_text(2000), "seed": 3}
    async with in_process(engine, profiles_dir=tmp_path) as s:
        plain = await s.client.post("/synthesize/stream", json=body)
        fast = await s.client.post("/synthesize/stream", json={**body, "speed": 2.0})
    x, y = _decode(plain.content, "f32le"), _decode(fast.content, "f32le")
    assert len(engine.submitted) == 2 * len(split_text(body["text"])) > 10
    assert len(y) / len(x) == pytest.approx(0.5, rel=0.05)
    assert dominant_hz(y) == pytest.approx(140.0, abs=2.0)
