"""The WebSocket speech session on a real server process (uvicorn, the fake backend) over real sockets: the example
client (examples/ws_client.py) streams word pieces in and writes the audio, with a key and with barge-in; a client
that stops reading is cut at TTS_WS_SEND_TIMEOUT and its engine work cancelled."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import wave
from pathlib import Path

import pytest
from websockets.sync.client import connect

from server_helpers import REPO_ROOT, demo_env, metric, server_process

pytestmark = pytest.mark.slow
KEY = "process-ws-key-1"
TEXT = "Streaming text in, audio out."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ws-process")
    env = demo_env(root, TTS_BACKEND="fake", TTS_API_KEYS=KEY, TTS_WS_SEND_TIMEOUT="1")
    with server_process(env, root / "server.log") as srv:
        srv.ws_url = srv.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
        yield srv


def run_client(server, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out.wav"
    cmd = [sys.executable, str(REPO_ROOT / "examples" / "ws_client.py"), "--url", server.ws_url, "--key", KEY,
           "--text", TEXT, "--out", str(out), *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT), out


def test_the_example_client_streams_word_pieces_and_writes_the_audio(server, tmp_path: Path) -> None:
    result, out = run_client(server, tmp_path, "--rate", "50")
    assert result.returncode == 0, result.stderr + server.log()
    assert "first audio" in result.stdout and "(eos)" in result.stdout, result.stdout
    with wave.open(str(out)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() == len(TEXT) * 1920  # the fake engine: one frame per character
    server.wait_idle(10)


def test_the_example_client_barges_in(server, tmp_path: Path) -> None:
    # 2 pieces a second: the cancel at 1 s comes while the text is still arriving.
    result, out = run_client(server, tmp_path, "--rate", "2", "--barge-in", "1")
    assert result.returncode == 0, result.stderr
    assert "(cancelled)" in result.stdout, result.stdout
    with wave.open(str(out)) as w:
        assert 0 < w.getnframes() < len(TEXT) * 1920
    server.wait_idle(10)


def test_a_client_that_stops_reading_is_cut_and_its_work_cancelled(server) -> None:
    before = metric(server_metrics(server), 'tts_ws_session_ends_total{reason="slow_reader"}')
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's sends fill up soon
    sock.connect(("127.0.0.1", server.port))
    # max_queue=1: the client library stops reading the socket once one message waits unread.
    headers = {"Authorization": f"Bearer {KEY}"}
    with connect(server.ws_url, sock=sock, additional_headers=headers, max_queue=1, close_timeout=1) as ws:
        ws.send(json.dumps({"type": "start", "voice": "demo", "response_format": "f32le", "text": "x" * 1000}))
        ws.send(json.dumps({"type": "text", "text": "y" * 1000}))
        ws.send(json.dumps({"type": "end"}))
        t0 = time.monotonic()
        # 2000 frames (16 MB of f32le) take the fake engine 20 s to make; the cut comes once the buffers are full.
        while metric(server_metrics(server), 'tts_ws_session_ends_total{reason="slow_reader"}') == before:
            assert time.monotonic() < t0 + 20, server.log()
            time.sleep(0.2)
        health = server.wait_idle(5)  # nothing left running, no slot held
        assert health["running"] == 0 and health["admitted"] == 0
        page = server_metrics(server)
        assert metric(page, 'tts_syntheses_total{outcome="disconnected"}') >= 1
        assert "client did not read for 1 s: cut" in server.log()


def server_metrics(server) -> str:
    import httpx

    return httpx.get(server.url + "/metrics", timeout=10).text
