"""The server with TTS_BACKEND=vllm-omni, end to end: a real `inference_server.py` in the vLLM-Omni environment
(.venv-vllm-omni, made by scripts/setup_vllm_omni.sh) serving the tiny float32 checkpoint through vLLM-Omni's
two-stage pipeline on the CPU (stage_config_cpu.yaml), once per speaker transport (the vllm-omni-myfi raw-tensor
fast path, and the float list stock vLLM-Omni takes). Also: greedy codes equal to the native engine's.

The tests skip when that environment is absent, except in CI (CI=true), where its absence is a failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from qwen_tts.model.random_checkpoint import write_random_checkpoint
from qwen_tts.voices import TENSOR_NAME
from server_helpers import REPO_ROOT, VO_PYTHON, ServerProcess, needs_vllm_omni, pcm16, write_voice

pytestmark = [pytest.mark.slow, needs_vllm_omni()]

SR, FRAME = 24000, 1920
FRAMES = 24
TEXT = "Hello from the vLLM-Omni backend."
DIM = 32  # the tiny checkpoint's x-vector width


def _body(frames: int = FRAMES, **extra) -> dict:
    return {
        "speaker_id": "alice",
        "text": extra.pop("text", TEXT),
        "min_new_tokens": frames,
        "max_new_tokens": frames,
        "temperature": 0.0,
        **extra,
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(
        tmp_path_factory.mktemp("vo_ckpt") / "tiny", size="tiny", seed=0, dtype=torch.float32
    )


@pytest.fixture(scope="module", params=["tensor", "list"])
def server(request: pytest.FixtureRequest, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(f"vo_server_{request.param}")
    voices = root / "voices"
    write_voice(voices, "alice", DIM, seed=1)
    env = {
        "TTS_BACKEND": "vllm-omni",
        "TTS_MODEL_PATH": str(checkpoint),
        "TTS_STAGE_CONFIG": str(REPO_ROOT / "stage_config_cpu.yaml"),
        "TTS_STAGE_INIT_TIMEOUT": "300",
        "TTS_VLLM_SPEAKER_TRANSPORT": request.param,
        "TTS_PROFILES_DIR": str(voices),
        "TTS_MAX_CONCURRENT": "4",
        "TTS_MAX_QUEUE": "4",
        "TTS_MAX_NEW_TOKENS": "512",
        "TTS_REQUEST_TIMEOUT": "120",
    }
    srv = ServerProcess(env, root / "server.log", startup_timeout=420, python=str(VO_PYTHON))
    srv.transport = request.param
    srv.voices = voices
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture
def client(server: ServerProcess):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_started_with_the_asked_transport(server: ServerProcess, client: httpx.Client) -> None:
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["ready"] is True
    assert "backend=vllm-omni device=cpu dtype=float32" in server.log()
    # The engine's whole description is /health's `engine` (the log has only the one-line summary at INFO).
    assert health["engine"]["speaker_transport"] == server.transport


def test_whole_file_and_stream_carry_the_same_audio(client: httpx.Client) -> None:
    whole = client.post("/synthesize", json=_body(response_format="pcm"))
    assert whole.status_code == 200, whole.text
    audio = pcm16(whole.content)
    assert audio.size == FRAMES * FRAME
    assert int(np.abs(audio.astype(np.int32)).max()) > 300  # not silence
    chunks = []
    with client.stream("POST", "/synthesize/stream", json=_body(response_format="pcm")) as r:
        assert r.status_code == 200
        chunks = [c for c in r.iter_raw() if c]
    assert len(chunks) >= 2  # a small first chunk, then more
    np.testing.assert_array_equal(pcm16(b"".join(chunks)), audio)  # greedy: same codes, same waveform


def test_concurrent_requests_all_complete(server: ServerProcess, client: httpx.Client) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            bodies = [_body(frames=16 + 4 * i, text=f"Concurrent request number {i}.") for i in range(4)]
            return await asyncio.gather(*(c.post("/synthesize", json={**b, "response_format": "pcm"}) for b in bodies))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 4
    assert [pcm16(r.content).size for r in responses] == [(16 + 4 * i) * FRAME for i in range(4)]
    server.wait_idle()


def test_cancelled_stream_is_aborted_in_the_pipeline(server: ServerProcess, client: httpx.Client) -> None:
    rid = f"cancel{server.transport}0123"
    long = _body(frames=512, text="A long story that nobody will hear to the end. " * 4)
    with (
        httpx.Client(base_url=server.url, timeout=60) as c,
        c.stream("POST", "/synthesize/stream", json=long, headers={"x-request-id": rid}) as r,
    ):
        assert r.status_code == 200
        next(r.iter_raw())  # audio is flowing; hang up
    health = server.wait_idle(30)
    assert health["ready"] is True
    deadline = time.monotonic() + 10
    while f"Aborted request(s) ['{rid}" not in server.log():  # vLLM-Omni's orchestrator dropped it
        assert time.monotonic() < deadline, "the pipeline never aborted the cancelled request"
        time.sleep(0.1)
    assert client.post("/synthesize", json=_body(frames=8)).status_code == 200


def test_bad_embeddings_are_refused_and_the_engine_lives(server: ServerProcess, client: httpx.Client) -> None:
    write_voice(server.voices, "narrow", DIM // 2, seed=2)  # the wrong width for this model
    save_file({TENSOR_NAME: torch.full((DIM,), float("nan"))}, str(server.voices / "nan.safetensors"))
    for speaker, word in (("narrow", "has width 16"), ("nan", "contains nan")):
        for path in ("/synthesize", "/synthesize/stream"):
            r = client.post(path, json={**_body(frames=8), "speaker_id": speaker})
            assert 400 <= r.status_code < 500, (speaker, path, r.status_code, r.text)
            assert f"speaker '{speaker}'" in r.json()["error"]["message"]
        assert word in server.log().lower()  # the log says why
    assert client.get("/health").json()["status"] == "ok"
    assert client.post("/synthesize", json=_body(frames=8)).status_code == 200


def test_greedy_codes_equal_the_native_engines(server: ServerProcess, client: httpx.Client, checkpoint: Path) -> None:
    """Same checkpoint, voice, text and greedy float32 decoding: every frame of vLLM-Omni's waveform equals the
    native engine's to float rounding. Each frame's audio is a function of its codes and a single differing code
    moves it by orders of magnitude more, so the codes are equal. (In one process with the same thread count the
    two waveforms are bit-identical; across processes the decoder's float sums may round differently.)"""
    if server.transport != "tensor":
        pytest.skip("checked once, on the fast-path server")
    from qwen_tts.engine_api import EngineSettings, SynthesisRequest
    from qwen_tts.engines import create_engine
    from qwen_tts.voices import load_profile

    frames = 60
    x = load_profile(server.voices / "alice.safetensors").x_vector

    async def native() -> np.ndarray:
        engine = create_engine(EngineSettings(model_path=str(checkpoint), device="cpu", dtype="float32", max_slots=1))
        await engine.start()
        try:
            req = SynthesisRequest(text=TEXT, xvector=x, greedy=True, min_frames=frames, max_frames=frames)
            return await engine.submit(req).collect()
        finally:
            await engine.stop()

    with client.stream("POST", "/synthesize/stream", json=_body(frames=frames, response_format="f32le")) as r:
        assert r.status_code == 200
        theirs = np.frombuffer(b"".join(r.iter_raw()), "<f4")
    ours = asyncio.run(native())
    assert theirs.size == ours.size == frames * FRAME
    per_frame = np.abs(theirs - ours).reshape(frames, FRAME).max(axis=1)
    agree = int((per_frame < 1e-4).sum())
    assert agree == frames, (
        f"{agree}/{frames} frames agree; first difference at frame {int(np.argmax(per_frame >= 1e-4))}"
    )
    assert float(np.abs(ours).max()) > 0.1  # real audio, not two silences


def _ws_utterance(server: ServerProcess, start: dict, fragments: list[str]) -> tuple[bytes, list[dict]]:
    """One utterance over the WebSocket: start, the text fragments, end; the audio and the events."""
    from websockets.sync.client import connect

    audio, events = b"", []
    with connect(server.url.replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=30) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session"
        ws.send(json.dumps({"type": "start", "voice": "alice", "response_format": "pcm", **start}))
        for fragment in fragments:
            ws.send(json.dumps({"type": "text", "text": fragment}))
        ws.send(json.dumps({"type": "end"}))
        while True:
            message = ws.recv(timeout=120)
            if isinstance(message, bytes):
                audio += message
                continue
            events.append(json.loads(message))
            if events[-1]["type"] in ("done", "error"):
                return audio, events


def test_streamed_text_over_the_websocket_is_spoken_sentence_by_sentence(server: ServerProcess) -> None:
    """The WebSocket session on vLLM-Omni (the sentence fallback): text arrives in fragments that cut words and
    sentences; each complete sentence is one pipeline request (streaming-text mode, greedy, its own frame budget),
    so the session's audio is exactly that of each sentence given whole in a session of its own, in order."""
    frames = 8
    options = {"min_new_tokens": frames, "max_new_tokens": frames, "temperature": 0.0}
    fragments = ["Hello th", "ere. Gen", "eral Ken", "obi."]
    audio, events = _ws_utterance(server, options, fragments)
    done = events[-1]
    assert done["type"] == "done" and done["finish_reason"] == "budget", events  # each sentence ran to its budget
    assert done["frames"] == 2 * frames and done["samples"] == 2 * frames * FRAME, done
    assert done["text_chars"] == len("".join(fragments)), done
    assert [e["type"] for e in events if e["type"] != "audio"][:1] == ["started"], events
    alone = []
    for sentence in ("Hello there. ", "General Kenobi."):  # where the segmenter cuts the text
        one, one_events = _ws_utterance(server, {**options, "text": sentence}, [])
        assert one_events[-1]["type"] == "done" and one_events[-1]["frames"] == frames, one_events
        alone.append(pcm16(one))
    assert int(np.abs(alone[0].astype(np.int32) - alone[1]).max()) > 300  # two sentences, two different audios
    # Same codes, so the same waveform to float rounding: vLLM-Omni's Code2Wav stage batches what is in flight, and
    # a sum in another batch can round the other way, moving an int16 sample by one. A single differing code would
    # move the audio by thousands.
    diff = np.abs(pcm16(audio).astype(np.int32) - np.concatenate(alone))
    assert int(diff.max()) <= 1, (int(diff.max()), int((diff > 1).sum()))
    server.wait_idle(30)


def test_an_icl_voice_gives_the_native_engines_icl_audio(server: ServerProcess, checkpoint: Path) -> None:
    """An ICL voice (reference codes and transcript in its profile) through vLLM-Omni's in-context request with the
    codes precomputed (no encoder runs): greedy float32, every frame of its waveform equals the native engine's ICL
    audio for the same reference, to float rounding, as the x-vector case above."""
    if server.transport != "tensor":
        pytest.skip("checked once, on the fast-path server")
    from icl_helpers import write_icl_voice

    from qwen_tts import icl_profile
    from qwen_tts.engine_api import EngineSettings, SynthesisRequest
    from qwen_tts.engines import create_engine
    from qwen_tts.voices import load_profile

    frames = 24
    profile = load_profile(write_icl_voice(server.voices, "iris", DIM, frames=30, text="What iris said.", seed=4))

    async def native() -> np.ndarray:
        engine = create_engine(EngineSettings(model_path=str(checkpoint), device="cpu", dtype="float32", max_slots=1))
        await engine.start()
        try:
            icl = icl_profile.make_reference(profile.ref_codes, profile.ref_text)
            req = SynthesisRequest(text=TEXT, xvector=profile.x_vector, greedy=True, min_frames=frames,
                                   max_frames=frames, icl=icl)  # fmt: skip
            return await engine.submit(req).collect()
        finally:
            await engine.stop()

    body = {**_body(frames=frames, response_format="f32le"), "speaker_id": "iris", "voice_mode": "icl"}
    with httpx.Client(base_url=server.url, timeout=120) as c, c.stream("POST", "/synthesize/stream", json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["x-voice-mode"] == "icl"
        theirs = np.frombuffer(b"".join(r.iter_raw()), "<f4")
    ours = asyncio.run(native())
    assert theirs.size == ours.size == frames * FRAME
    per_frame = np.abs(theirs - ours).reshape(frames, FRAME).max(axis=1)
    agree = int((per_frame < 1e-4).sum())
    assert agree == frames, f"{agree}/{frames} frames agree; first difference at {int(np.argmax(per_frame >= 1e-4))}"
    assert float(np.abs(ours).max()) > 0.1


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _stage_process(server_pid: int, stage: int) -> int:
    for pid in _descendants(server_pid):
        try:
            cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            comm = (Path("/proc") / str(pid) / "comm").read_text()
        except OSError:
            continue
        if f"stage{stage}" in cmd or f"stage{stage}" in comm:
            return pid
    raise AssertionError(f"no stage-{stage} process under the server")


def test_a_killed_stage_gives_503_then_the_pipeline_recovers(server: ServerProcess, client: httpx.Client) -> None:
    if server.transport != "list":
        pytest.skip("checked once, on the last server")
    os.kill(_stage_process(server.proc.pid, 0), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while client.get("/ready").status_code == 200:
        assert time.monotonic() < deadline, "the server still claims to be ready with a dead stage"
        time.sleep(0.2)
    r = client.post("/synthesize", json=_body(frames=8))
    assert r.status_code == 503, r.text
    deadline = time.monotonic() + 300
    while client.get("/ready").status_code != 200:
        assert server.proc.poll() is None, "the server exited instead of restarting the pipeline"
        assert time.monotonic() < deadline, "the pipeline did not come back"
        time.sleep(1.0)
    r = client.post("/synthesize", json=_body(response_format="pcm"))
    assert r.status_code == 200
    assert pcm16(r.content).size == FRAMES * FRAME
    assert "vLLM-Omni pipeline restarted" in server.log()
