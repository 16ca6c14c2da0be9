"""ICL voices over HTTP and the WebSocket, in process on the fake engine: which mode a request is served in (auto:
ICL when the voice has ICL data; `voice_mode` 'icl' or 'xvector'), the X-Voice-Mode header and the stats that report
it, the reference reaching every piece of a long text, the 4xx cases, and the voice lists' `icl` field."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
import torch
from icl_helpers import ref_codes, write_icl_voice

from qwen_tts import icl_profile
from qwen_tts.engines.fake import FakeEngine
from server_helpers import InProcess, in_process, metric, write_voice
from ws_helpers import AsgiWebSocket

pytestmark = pytest.mark.asyncio(loop_scope="module")

DIM = 16
TEXT = "Words of the ICL voice."
REF_TEXT = "What the clip says."


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory):
    voices = tmp_path_factory.mktemp("voices")
    write_icl_voice(voices, "anna", DIM, frames=50, text=REF_TEXT, seed=2)
    write_voice(voices, "bob", DIM, seed=3)
    engine = FakeEngine(xvector_dim=DIM, max_slots=4, max_queue=8, frames_per_char=0.2)
    async with in_process(engine, profiles_dir=voices, max_concurrent=4, max_queue=8) as s:
        yield s


def submitted(server: InProcess):
    return server.runtime.engine.submitted


ANNA_KEY = icl_profile.reference_key(ref_codes(50, seed=2), REF_TEXT)


@pytest.mark.parametrize(
    ("voice", "mode", "expected"),
    [("anna", None, "icl"), ("anna", "auto", "icl"), ("anna", "icl", "icl"), ("anna", "xvector", "xvector"),
     ("bob", None, "xvector"), ("bob", "xvector", "xvector")],
)  # fmt: skip
async def test_synthesize_serves_the_mode_asked_for_and_says_which(server: InProcess, voice, mode, expected) -> None:
    body = {"speaker_id": voice, "text": TEXT, **({"voice_mode": mode} if mode else {})}
    r = await server.client.post("/synthesize", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-voice-mode"] == expected
    request = submitted(server)[-1]
    assert torch.equal(request.xvector, server.runtime.voices.get(voice))
    if expected == "icl":
        assert request.icl.key == ANNA_KEY and request.icl.text == REF_TEXT
        assert torch.equal(request.icl.codes, ref_codes(50, seed=2))
    else:
        assert request.icl is None


async def test_icl_for_a_voice_without_icl_data_is_a_422_naming_voice_mode(server: InProcess) -> None:
    before = len(submitted(server))
    for path, body in [
        ("/synthesize", {"speaker_id": "bob", "text": TEXT, "voice_mode": "icl"}),
        ("/synthesize/stream", {"speaker_id": "bob", "text": TEXT, "voice_mode": "icl"}),
        ("/v1/audio/speech", {"model": "m", "voice": "bob", "input": TEXT, "voice_mode": "icl"}),
    ]:
        r = await server.client.post(path, json=body)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["param"] == "voice_mode" and error["code"] == "voice_without_icl"
        field = "voice" if path == "/v1/audio/speech" else "speaker_id"
        assert error["message"].startswith(f"voice_mode: 'icl' needs a voice with ICL data, and {field} 'bob' has none")
    assert len(submitted(server)) == before
    assert server.runtime.admission.active == 0


async def test_an_unknown_voice_mode_is_a_422_naming_the_field(server: InProcess) -> None:
    r = await server.client.post("/synthesize", json={"speaker_id": "anna", "text": TEXT, "voice_mode": "both"})
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "voice_mode"


async def test_streams_and_speech_report_the_mode(server: InProcess) -> None:
    r = await server.client.post("/synthesize/stream", json={"speaker_id": "anna", "text": TEXT})
    assert r.status_code == 200 and r.headers["x-voice-mode"] == "icl" and len(r.content) > 0
    assert submitted(server)[-1].icl.key == ANNA_KEY
    r = await server.client.post("/synthesize", json={"speaker_id": "anna", "text": TEXT, "stream": True,
                                                      "voice_mode": "xvector"})  # fmt: skip
    assert r.status_code == 200 and r.headers["x-voice-mode"] == "xvector"
    assert submitted(server)[-1].icl is None
    for fmt, stream in [("mp3", "audio"), ("wav", "audio"), ("pcm", "audio")]:
        r = await server.client.post("/v1/audio/speech", json={"model": "m", "voice": "anna", "input": TEXT,
                                                               "response_format": fmt, "stream_format": stream})  # fmt: skip
        assert r.status_code == 200 and r.headers["x-voice-mode"] == "icl", (fmt, r.text)
    r = await server.client.post("/v1/audio/speech", json={"model": "m", "voice": {"id": "anna"}, "input": TEXT,
                                                           "response_format": "pcm", "stream_format": "sse"})  # fmt: skip
    assert r.status_code == 200 and r.headers["x-voice-mode"] == "icl"
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["voice_mode"] == "icl"
    assert submitted(server)[-1].icl.key == ANNA_KEY


async def test_every_piece_of_a_long_text_carries_the_reference(server: InProcess) -> None:
    long_text = " ".join(f"Sentence number {i} is here to make the text long." for i in range(20))
    before = len(submitted(server))
    r = await server.client.post("/synthesize", json={"speaker_id": "anna", "text": long_text})
    assert r.status_code == 200 and r.headers["x-voice-mode"] == "icl"
    pieces = submitted(server)[before:]
    assert len(pieces) > 1
    assert all(p.icl is not None and p.icl.key == ANNA_KEY for p in pieces)
    assert "".join(p.text.replace(" ", "") for p in pieces) == long_text.replace(" ", "")


async def test_the_metrics_count_requests_by_voice_mode(server: InProcess) -> None:
    text = (await server.client.get("/metrics")).text
    icl, xvector = (
        metric(text, 'tts_voice_mode_total{mode="icl"}'),
        metric(text, 'tts_voice_mode_total{mode="xvector"}'),
    )
    await server.client.post("/synthesize", json={"speaker_id": "anna", "text": TEXT})
    await server.client.post("/synthesize", json={"speaker_id": "anna", "text": TEXT, "voice_mode": "xvector"})
    await server.client.post("/synthesize", json={"speaker_id": "bob", "text": TEXT})
    text = (await server.client.get("/metrics")).text
    assert metric(text, 'tts_voice_mode_total{mode="icl"}') == icl + 1
    assert metric(text, 'tts_voice_mode_total{mode="xvector"}') == xvector + 2


async def test_the_voice_lists_say_which_voices_have_icl_data(server: InProcess) -> None:
    speakers = {s["id"]: s for s in (await server.client.get("/speakers")).json()["speakers"]}
    assert (speakers["anna"]["icl"], speakers["anna"]["ref_seconds"]) == (True, 4.0)
    assert (speakers["bob"]["icl"], speakers["bob"]["ref_seconds"]) == (False, None)
    data = {v["id"]: v for v in (await server.client.get("/v1/audio/voices")).json()["data"]}
    assert (data["anna"]["icl"], data["anna"]["ref_seconds"], data["anna"]["ref_text"]) == (True, 4.0, REF_TEXT)
    assert (data["bob"]["icl"], data["bob"]["ref_seconds"]) == (False, None)


async def test_the_websocket_start_message_takes_voice_mode_and_the_events_report_it(server: InProcess) -> None:
    ws = AsgiWebSocket(server.app)
    await ws.connect()
    assert (await ws.event())["type"] == "session"
    for voice, mode, expected in [("anna", None, "icl"), ("anna", "xvector", "xvector"), ("bob", "auto", "xvector")]:
        await ws.send_json(
            {"type": "start", "voice": voice, "text": "Hello there.", **({"voice_mode": mode} if mode else {})}
        )
        started = await ws.event()
        assert started["type"] == "started" and started["voice_mode"] == expected, started
        await ws.send_json({"type": "end"})
        done, _ = await ws.until("done")
        assert done["voice_mode"] == expected
        request = submitted(server)[-1]
        assert (request.icl.key if request.icl else None) == (ANNA_KEY if expected == "icl" else None)
        assert request.text_stream is not None
    await ws.send_json({"type": "start", "voice": "bob", "voice_mode": "icl"})
    error = await ws.event()
    assert error["type"] == "error" and error["error"]["param"] == "voice_mode"
    await ws.disconnect()
