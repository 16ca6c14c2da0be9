"""A real `python inference_server.py` on loopback, on the tiny demo checkpoint, driven by real clients
(httpx, curl, the openai SDK): what only a real socket shows — streaming, backpressure, disconnects, shutdown.

Requests fix their length with min_new_tokens == max_new_tokens, so "complete audio" is an exact sample count.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import wave
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from server_helpers import REPO_ROOT, ServerProcess, metric, pcm16, server_process
from tts_server.audio_encoding import to_int16

pytestmark = pytest.mark.slow

SR = 24000
FRAME = 1920
KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
FRAMES = 24  # fixed length of the test utterances: 1.92 s
# ~325 tokens with the demo tokenizer: a text budget above 2048 frames, under the engine's 1024-token limit.
LONG_TEXT = "A long story. " * 25


def _body(frames: int = FRAMES, **extra) -> dict:
    text = extra.pop("text", "Hello from the demo voice, over a real socket.")
    return {
        "speaker_id": "demo",
        "text": text,
        "min_new_tokens": frames,
        "max_new_tokens": frames,
        "seed": 11,
        **extra,
    }


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo") / "demo-tiny"


def _env(demo_dir: Path, profiles: Path, **extra: str) -> dict[str, str]:
    return {
        "TTS_DEMO_DIR": str(demo_dir),
        "TTS_PROFILES_DIR": str(profiles),
        "TTS_MAX_CONCURRENT": "4",
        "TTS_MAX_QUEUE": "4",
        "TTS_REQUEST_TIMEOUT": "120",
        **extra,
    }


@pytest.fixture(scope="module")
def server(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("server")
    env = _env(demo_dir, root / "voices", TTS_API_KEYS=KEY)
    with server_process(env, root / "server.log") as srv:
        yield srv


@pytest.fixture
def client(server: ServerProcess):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c
        # Whatever a test did, the server must be idle and healthy afterwards.
        server.wait_idle()


# --- basic serving --------------------------------------------------------------------------------------
def test_startup_logs_the_seed_sequence(server: ServerProcess) -> None:
    log = server.log()
    steps = ["Loaded 1 voice profiles", "Engine initialised", "Ready with 1 speakers", "serving model="]
    positions = [log.find(s) for s in steps]
    assert all(p >= 0 for p in positions), log
    assert positions == sorted(positions)


def test_startup_is_summed_up_in_one_line_and_the_engine_description_is_not_logged_at_info(
    server: ServerProcess,
) -> None:
    log = server.log()
    (summary,) = [line for line in log.splitlines() if "serving model=" in line]
    assert summary.endswith(
        " INFO tts_server: serving model=demo backend=native device=cpu dtype=float32 voices=1 "
        f"listen=http://127.0.0.1:{server.port} auth=on"
    )
    assert "engine initialised: {" not in log  # the engine's whole description: DEBUG only, and /health's `engine`
    assert max(map(len, log.splitlines())) < 300, max(log.splitlines(), key=len)  # no other line dumps a dict
    health = server.health()
    assert health["model"] == {"name": "demo", "size": "tiny", "xvector_dim": 32, "device": "cpu", "dtype": "float32"}
    assert health["engine"]["max_slots"] == 4 and "path" not in health["engine"]


def test_the_startup_heap_is_frozen_before_the_server_serves(server: ServerProcess) -> None:
    """Full garbage collections while serving must not walk torch, the engine and the app (tts_server/heap.py):
    each such walk stopped every stream for ~100 ms on 2 cores."""
    log = server.log()
    match = re.search(r"startup heap frozen: (\d+) objects", log)
    assert match, log
    assert int(match.group(1)) > 50_000  # torch and the app alone leave ~200,000 tracked objects
    assert match.start() < log.find("serving model=")


def test_whole_file_over_the_socket(client: httpx.Client) -> None:
    r = client.post("/synthesize", json=_body())
    assert r.status_code == 200, r.text
    x, sr = sf.read(io.BytesIO(r.content), dtype="int16")
    assert sr == SR and len(x) == FRAMES * FRAME
    assert r.headers["x-audio-duration"] == f"{FRAMES * FRAME / SR:.3f}"
    assert {"x-request-id", "x-latency", "x-sample-rate"} <= set(r.headers)


def test_stream_arrives_in_several_chunks_and_equals_the_whole_file(client: httpx.Client) -> None:
    whole = pcm16(client.post("/synthesize", json=_body(response_format="pcm")).content)
    chunks: list[bytes] = []
    with client.stream("POST", "/synthesize/stream", json=_body()) as r:
        assert r.status_code == 200
        assert r.headers["transfer-encoding"] == "chunked"
        chunks = [c for c in r.iter_raw() if c]
    # 24 frames leave as a 3-frame first chunk, then 12 + 9: the client sees them separately.
    assert len(chunks) >= 2
    assert len(chunks[0]) <= 3 * FRAME * 4 < sum(map(len, chunks))
    pcm = np.frombuffer(b"".join(chunks), "<f4")
    assert len(pcm) == FRAMES * FRAME
    np.testing.assert_array_equal(to_int16(pcm), whole)


def test_curl_whole_file_and_stream(server: ServerProcess, tmp_path: Path) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    out = tmp_path / "out.wav"
    body = json.dumps(_body())
    done = subprocess.run(
        [curl, "-sS", "-f", "-D", "-", "-H", f"Authorization: Bearer {KEY}", "-d", body, "-o", str(out),
         f"{server.url}/synthesize"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "x-audio-duration: 1.920" in done.stdout.lower()
    assert sf.info(str(out)).frames == FRAMES * FRAME
    raw = tmp_path / "out.f32"
    subprocess.run(
        [curl, "-sS", "-f", "-N", "-H", f"Authorization: Bearer {KEY}", "-d", body, "-o", str(raw),
         f"{server.url}/synthesize/stream"],
        timeout=60, check=True,
    )  # fmt: skip
    assert raw.stat().st_size == FRAMES * FRAME * 4
    # curl without a key: 401 and curl -f fails.
    denied = subprocess.run(
        [curl, "-sS", "-f", "-d", body, f"{server.url}/synthesize"], capture_output=True, timeout=30
    )
    assert denied.returncode == 22 and b"401" in denied.stderr


# --- backpressure ---------------------------------------------------------------------------------------
def test_40_concurrent_requests_get_only_200_or_429_and_every_200_is_complete(
    server: ServerProcess, client: httpx.Client
) -> None:
    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120, limits=limits) as c:
            return await asyncio.gather(*[c.post("/synthesize", json=_body(response_format="pcm")) for _ in range(40)])

    started = time.monotonic()
    responses = asyncio.run(burst())
    wall = time.monotonic() - started
    statuses = Counter(r.status_code for r in responses)
    print(f"\n40 concurrent at TTS_MAX_CONCURRENT=4, TTS_MAX_QUEUE=4: {dict(statuses)} in {wall:.1f} s")
    assert set(statuses) <= {200, 429}, statuses
    # 40 arrive at once and 8 fit (4 decoding + 4 queued): most must be refused, never crash or queue unboundedly.
    assert statuses[200] >= 4 and statuses[429] >= 1
    expected = pcm16(client.post("/synthesize", json=_body(response_format="pcm")).content)
    for r in responses:
        if r.status_code == 200:
            assert len(r.content) == FRAMES * FRAME * 2  # complete
            # ...and not mixed with anyone else's: equal to the same request alone, up to the float rounding of a
            # batched decode (a sample or two of int16).
            assert np.abs(pcm16(r.content).astype(int) - expected).max() <= 4
        else:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
    metrics = client.get("/metrics").text
    assert f'tts_rejections_total{{reason="queue_full"}} {float(statuses[429])}' in metrics


# --- disconnects ----------------------------------------------------------------------------------------
def test_client_that_disconnects_mid_stream_frees_its_slot(server: ServerProcess, client: httpx.Client) -> None:
    long = _body(frames=2048, text=LONG_TEXT)  # minutes of work if nobody cancels it
    before = client.get("/metrics").text
    for _ in range(8):  # a burst: every slot and every queue place
        with (
            httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c,
            c.stream("POST", "/synthesize/stream", json=long) as r,
        ):
            assert r.status_code == 200
            next(r.iter_raw())  # audio is flowing; now hang up
    health = server.wait_idle(30)
    assert health["ready"] is True
    after = client.get("/metrics").text
    assert metric(after, "tts_client_disconnects_total") - metric(before, "tts_client_disconnects_total") == 8
    assert client.post("/synthesize", json=_body()).status_code == 200


def test_client_that_disconnects_from_a_whole_file_request_frees_its_slot(
    server: ServerProcess, client: httpx.Client
) -> None:
    long = _body(frames=2048, text=LONG_TEXT)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/synthesize", json=long, headers=AUTH, timeout=1.0)
    server.wait_idle(30)


# --- bad input over the socket ----------------------------------------------------------------------------
BAD = [
    (b"{not json", 400),
    (b"", 400),
    (b"[]", 400),
    (json.dumps({"speaker_id": "demo", "text": 42}).encode(), 422),
    (json.dumps({"speaker_id": "demo", "text": "hi", "temperature": "warm"}).encode(), 422),
    (json.dumps({"speaker_id": "demo", "text": ""}).encode(), 422),
    (json.dumps({"speaker_id": "demo", "text": "a" * 4097}).encode(), 422),
    (json.dumps({"speaker_id": "demo", "text": "a" * 70000}).encode(), 413),
    (json.dumps({"speaker_id": "demo", "text": "hi", "language": "Elvish"}).encode(), 422),
    (json.dumps({"speaker_id": "demo", "text": "hi", "response_format": "ogg"}).encode(), 422),
    (json.dumps({"speaker_id": "../voices/demo", "text": "hi"}).encode(), 422),
    (json.dumps({"speaker_id": "/etc/passwd", "text": "hi"}).encode(), 422),
    (json.dumps({"speaker_id": "demo\u0000x", "text": "hi"}).encode(), 422),
    (json.dumps({"speaker_id": "%2e%2e%2fdemo", "text": "hi"}).encode(), 422),
    (json.dumps({"speaker_id": "x" * 10000, "text": "hi"}).encode(), 422),
    (json.dumps({"speaker_id": "ghost", "text": "hi"}).encode(), 404),
]


def test_bad_inputs_get_4xx_and_the_server_stays_healthy(client: httpx.Client) -> None:
    for body, status in BAD:
        for path in ("/synthesize", "/synthesize/stream"):
            r = client.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, (path, body[:80], r.text)
            assert r.json()["error"]["message"]
            assert "Traceback" not in r.text
    assert client.get("/health").json()["status"] == "ok"
    assert client.post("/synthesize", json=_body()).status_code == 200


# --- the openai SDK ---------------------------------------------------------------------------------------
def test_openai_sdk_whole_and_streamed(server: ServerProcess, client: httpx.Client) -> None:
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    extra = {"seed": 11, "min_new_tokens": FRAMES, "max_new_tokens": FRAMES}
    text = "Hello from the demo voice, over a real socket."
    expected = pcm16(client.post("/synthesize", json=_body(response_format="pcm")).content)

    wav = sdk.audio.speech.create(model="tts-1", voice="demo", input=text, response_format="wav", extra_body=extra)
    x, sr = sf.read(io.BytesIO(wav.content), dtype="int16")
    assert sr == SR
    np.testing.assert_array_equal(x, expected)
    with wave.open(io.BytesIO(wav.content)) as w:  # a length-correct header, not a streaming one
        assert w.getnframes() == len(expected)

    mp3 = sdk.audio.speech.create(model="tts-1", voice="demo", input=text, extra_body=extra)
    assert mp3.response.headers["content-type"] == "audio/mpeg" and len(mp3.content) > 0

    with sdk.audio.speech.with_streaming_response.create(
        model="tts-1", voice="demo", input=text, response_format="pcm", extra_body=extra
    ) as resp:
        parts = [p for p in resp.iter_bytes() if p]
    assert len(parts) >= 2
    np.testing.assert_array_equal(pcm16(b"".join(parts)), expected)

    with sdk.audio.speech.with_streaming_response.create(
        model="tts-1", voice="demo", input=text, response_format="pcm", stream_format="sse", extra_body=extra
    ) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    np.testing.assert_array_equal(pcm16(audio), expected)


def test_openai_sdk_sees_our_errors(server: ServerProcess) -> None:
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.UnprocessableEntityError, match=r"response_format: .*'aac', 'flac', 'wav' or 'pcm'"):
        sdk.audio.speech.create(model="tts-1", voice="demo", input="hi", response_format="m4a")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError, match="unknown speaker 'alloy'"):
        sdk.audio.speech.create(model="tts-1", voice="alloy", input="hi")
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong-key-000", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.audio.speech.create(model="tts-1", voice="demo", input="hi")


def test_health_ready_and_metrics_are_public(server: ServerProcess) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200
    assert httpx.get(server.url + "/speakers").status_code == 401


# --- shutdown ------------------------------------------------------------------------------------------------
def test_sigterm_during_load_drains_in_flight_work_and_exits_zero(demo_dir: Path, tmp_path: Path) -> None:
    env = _env(demo_dir, tmp_path / "voices", TTS_DRAIN_TIMEOUT="60")
    srv = ServerProcess(env, tmp_path / "server.log")
    try:
        frames = 48

        async def load() -> tuple[list[httpx.Response], list[bytes]]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                wholes = [c.post("/synthesize", json=_body(frames, response_format="pcm")) for _ in range(3)]

                async def stream() -> bytes:
                    async with c.stream("POST", "/synthesize/stream", json=_body(frames)) as r:
                        assert r.status_code == 200
                        return b"".join([chunk async for chunk in r.aiter_raw()])

                tasks = [asyncio.ensure_future(x) for x in [*wholes, stream()]]
                while (await c.get("/health")).json()["admitted"] < 4:
                    await asyncio.sleep(0.02)
                srv.proc.send_signal(15)  # SIGTERM while all four are in flight
                await asyncio.sleep(0.3)
                # New work is refused: the listener is closed (or, on a kept-alive connection, 503).
                try:
                    late = await c.post("/synthesize", json=_body(frames))
                    assert late.status_code == 503
                except httpx.TransportError:
                    pass
                *done, streamed = await asyncio.gather(*tasks)
                return done, [streamed]

        done, streamed = asyncio.run(load())
        for r in done:
            assert r.status_code == 200 and len(r.content) == frames * FRAME * 2
        assert len(streamed[0]) == frames * FRAME * 4
        assert srv.proc.wait(timeout=60) == 0
        log = srv.log()
        assert "draining" in log and "engine stopped" in log
    finally:
        srv.kill()


def test_sigterm_past_the_drain_timeout_cancels_and_still_exits_zero(demo_dir: Path, tmp_path: Path) -> None:
    env = _env(demo_dir, tmp_path / "voices", TTS_DRAIN_TIMEOUT="1")
    srv = ServerProcess(env, tmp_path / "server.log")
    try:
        with (
            httpx.Client(base_url=srv.url, timeout=60) as c,
            c.stream("POST", "/synthesize/stream", json=_body(2048, text=LONG_TEXT)) as r,
        ):
            chunks = r.iter_raw()
            next(chunks)
            srv.proc.send_signal(15)
            with pytest.raises(httpx.TransportError):  # cut short: the client can tell it is incomplete
                for _ in chunks:
                    pass
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.kill()


# --- startup failures ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "code", "line"),
    [
        ({"TTS_PORT": "eighty"}, 2, "invalid configuration: TTS_PORT='eighty': Input should be a valid integer"),
        ({"TTS_MAX_CONCURRENT": "0"}, 2, "invalid configuration: TTS_MAX_CONCURRENT='0'"),
        (
            {"TTS_MODEL_PATH": "/nonexistent/model"},
            1,
            "TTS_MODEL_PATH='/nonexistent/model': /nonexistent/model: no such",
        ),
    ],
)
def test_bad_configuration_fails_at_startup_with_one_clear_line(env: dict, code: int, line: str) -> None:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TTS_")}
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "inference_server.py")],
        env={**full, **env}, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == code, done.stderr
    assert line in done.stderr
    assert "Traceback" not in done.stderr


# --- command line, .env file, log format, the port ---------------------------------------------------------------
def test_the_port_flag_and_a_dotenv_file_configure_the_server_flag_first(demo_dir: Path, tmp_path: Path) -> None:
    """--port serves on its port although the .env file names another (one held by this test: the server would fail
    there); the .env file in the working directory sets the profiles folder and the JSON log format."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        (tmp_path / ".env").write_text(
            f"# read by the server from its working directory\nTTS_PORT={taken}\nTTS_PROFILES_DIR=voices-from-dotenv\n"
            "TTS_LOG_FORMAT=json\nTTS_API_KEYS_FILE=keys\n"
        )
        (tmp_path / "keys").write_text(f"{KEY}\n")
        srv = ServerProcess({"TTS_DEMO_DIR": str(demo_dir)}, tmp_path / "server.log", cwd=tmp_path, port_flag=True)
        try:
            assert srv.port != taken
            r = httpx.get(srv.url + "/speakers", headers={**AUTH, "X-Request-Id": "dotenv-1"}, timeout=30)
            assert r.status_code == 200 and [v["id"] for v in r.json()["speakers"]] == ["demo"]
            assert httpx.get(srv.url + "/speakers", timeout=30).status_code == 401  # the keys file's key is needed
            assert (tmp_path / "voices-from-dotenv" / "demo.safetensors").is_file()
            assert srv.terminate() == 0
            log = srv.log()
        finally:
            srv.kill()
    lines = [json.loads(line) for line in log.splitlines() if line.strip()]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    (summary,) = [line for line in lines if line["message"].startswith("serving model=")]
    assert summary["message"].endswith(f"listen=http://127.0.0.1:{srv.port} auth=on") and summary["level"] == "INFO"
    access = [line for line in lines if line["logger"] == "tts_server.access" and "/speakers" in line["message"]]
    assert access[0]["request_id"] == "dotenv-1"
    assert any(line["logger"].startswith("uvicorn") for line in lines)  # uvicorn's own records too


def test_a_port_in_use_fails_at_once_with_one_line_before_any_model_loads(tmp_path: Path) -> None:
    import socket

    demo = tmp_path / "demo-tiny"  # not written yet: the demo checkpoint is written when the model is loaded
    full = {k: v for k, v in os.environ.items() if not k.startswith("TTS_") and k != "TRITON_INTERPRET"}
    env = {**full, "TTS_DEMO_DIR": str(demo), "TTS_PROFILES_DIR": str(tmp_path / "voices"), "TTS_HOST": "127.0.0.1"}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, str(REPO_ROOT / "inference_server.py"), "--port", str(port)],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "startup failed" in line]
    assert line.endswith(f"ERROR tts_server: startup failed: port {port} on 127.0.0.1 is in use")
    for loading in ("demo checkpoint", "voice profiles", "Engine initialised", "Ready with"):
        assert loading not in done.stderr
    assert not demo.exists() and not (tmp_path / "voices").exists()
    assert "Traceback" not in done.stderr
    assert elapsed < 60, elapsed  # the imports only (a few seconds), not a model load
