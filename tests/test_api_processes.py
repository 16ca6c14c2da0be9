"""TTS_API_PROCESSES: the engine in its own process and two HTTP front-ends (tts_server/processes.py), as real
processes over real sockets with the fake backend (10 ms a frame, one frame a character): a stream, the admission
limit over both front-ends, a client that leaves or stops reading, the WebSocket session, SIGTERM's drain, and an
engine process killed in flight (requests failed in shape, not ready, a new engine process, then exit 3)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import wave
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from server_helpers import REPO_ROOT, ServerProcess, demo_env, pcm16, server_process

pytestmark = pytest.mark.slow
SLOTS, QUEUE = 2, 1  # admission: 3 requests over both front-ends


def split_env(root: Path, **extra: str) -> dict[str, str]:
    return demo_env(
        root,
        TTS_BACKEND="fake",
        TTS_API_PROCESSES="2",
        TTS_MAX_CONCURRENT=str(SLOTS),
        TTS_MAX_QUEUE=str(QUEUE),
        **extra,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("api-processes")
    with server_process(split_env(root, TTS_REQUEST_TIMEOUT="4"), root / "server.log") as srv:
        yield all_serving(srv)


def all_serving(server: ServerProcess) -> ServerProcess:
    """`server` once both front-ends serve (/ready answers 200 as soon as one does)."""
    wait_for(lambda: server.log().count("serving model=") == 2, 60, "two front-ends", server)
    return server


def engine_pid(server: ServerProcess) -> int:
    return int(re.findall(r"engine process pid (\d+)", server.log())[-1])


def front_end_pids(server: ServerProcess) -> list[int]:
    return [int(p) for p in re.findall(r"API front-end process pids: ([\d ]+)", server.log())[-1].split()]


def tone(seed: int, frames: int) -> np.ndarray:
    """The fake engine's audio (FakeEngine.tone) as the pcm format's 16-bit samples."""
    n = np.arange(frames * 1920)
    f32 = (0.3 * np.sin(2 * np.pi * (110.0 + 10.0 * (seed % 40)) * n / 24000)).astype(np.float32)
    return np.clip(np.round(f32 * 32767), -32768, 32767).astype(np.int16)


def body(text: str, **kw: object) -> dict:
    return {"text": text, "speaker_id": "demo", "response_format": "pcm", "seed": 5, **kw}


def long_body(frames: int = 2000) -> dict:
    """A request of `frames` frames (10 ms each to make) in one engine request (a long text would be split)."""
    return body("hello", min_new_tokens=frames, max_new_tokens=frames)


def hold_streams(url: str, n: int, stop: threading.Event) -> list[threading.Thread]:
    """`n` long streaming requests, each on its own connection, open until `stop`."""

    def one() -> None:
        with httpx.Client(timeout=30) as c, c.stream("POST", url + "/synthesize/stream", json=long_body()) as r:
            for _ in r.iter_bytes():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def wait_for(check: Callable[[], bool], limit: float, what: str, server: ServerProcess) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"{what} not reached:\n{server.log()[-4000:]}"
        time.sleep(0.05)


def test_a_stream_through_a_front_end_is_the_engines_audio(server: ServerProcess) -> None:
    assert len(front_end_pids(server)) == 2 and engine_pid(server) not in front_end_pids(server)
    r = httpx.post(server.url + "/synthesize/stream", json=body("hello world"), timeout=30)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(pcm16(r.content), tone(5, 11), atol=1)
    health = server.health()
    assert (health["status"], health["ready"], health["backend"], health["model"]["xvector_dim"]) == (
        "ok",
        True,
        "fake",
        16,
    )


def test_admission_is_one_limit_over_both_front_ends(server: ServerProcess) -> None:
    stop = threading.Event()
    threads = hold_streams(server.url, SLOTS + QUEUE, stop)
    try:
        wait_for(lambda: server.health()["admitted"] == SLOTS + QUEUE, 10, "3 admitted", server)
        refused = []
        for _ in range(12):  # each on a new connection: the kernel hands them to either front-end
            r = httpx.post(server.url + "/synthesize", json=body("hello"), timeout=10)
            refused.append((r.status_code, r.json()["error"]["code"], r.headers.get("retry-after")))
        assert refused == [(429, "server_overloaded", "1")] * 12
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    server.wait_idle(10)


def test_a_client_that_leaves_mid_stream_stops_the_engines_work(server: ServerProcess) -> None:
    with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/synthesize/stream", json=long_body()) as r:
        assert r.status_code == 200
        next(r.iter_bytes())
        assert server.health()["running"] == 1
    t0 = time.monotonic()
    health = server.wait_idle(3)  # 2000 frames would take the engine 20 s
    assert health["running"] == 0 and time.monotonic() - t0 < 3


def test_a_client_that_stops_reading_is_cut_at_its_deadline(server: ServerProcess) -> None:
    data = json.dumps(long_body()).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    head = (
        f"POST /synthesize/stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    )
    sock.sendall(head.encode() + b"\r\n\r\n" + data)
    t0 = time.monotonic()
    try:
        time.sleep(2)
        assert server.health()["running"] == 1  # not reading: the request holds its row
        wait_for(lambda: server.health()["admitted"] == 0, 12, "the cut", server)
        elapsed = time.monotonic() - t0
        assert 4 <= elapsed < 10, elapsed  # at TTS_REQUEST_TIMEOUT
        sock.settimeout(15)
        received = 0
        with contextlib.suppress(ConnectionResetError):  # closed with unread data: a reset
            while chunk := sock.recv(65536):  # what was sent before the cut, then the end
                received += len(chunk)
    finally:
        sock.close()
    assert received < 2000 * 1920 * 2  # cut: not the whole utterance
    assert server.wait_idle(5)["running"] == 0
    assert "ended: timeout" in server.log()


def test_a_websocket_session_streams_text_through_a_front_end(server: ServerProcess, tmp_path: Path) -> None:
    out, text = tmp_path / "out.wav", "Streaming text in, audio out."
    ws_url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    cmd = [sys.executable, str(REPO_ROOT / "examples" / "ws_client.py"), "--url", ws_url, "--text", text,
           "--out", str(out), "--rate", "50"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr + server.log()[-3000:]
    assert "(eos)" in result.stdout, result.stdout
    with wave.open(str(out)) as w:
        assert w.getnframes() == len(text) * 1920
    server.wait_idle(10)


def test_sigterm_lets_a_stream_in_flight_finish_and_exits_0(tmp_path: Path) -> None:
    with server_process(split_env(tmp_path), tmp_path / "server.log") as srv:
        all_serving(srv)
        got: list[bytes] = []

        def stream() -> None:
            with httpx.Client(timeout=30) as c:
                got.append(c.post(srv.url + "/synthesize/stream", json=long_body(150)).content)  # 1.5 s of work

        t = threading.Thread(target=stream)
        t.start()
        wait_for(lambda: srv.health()["running"] == 1, 10, "running", srv)
        assert srv.terminate(60) == 0, srv.log()[-3000:]
        t.join(30)
        np.testing.assert_allclose(pcm16(got[0]), tone(5, 150), atol=1)
        assert "engine stopped" in srv.log()


def test_a_killed_engine_process_fails_requests_in_shape_is_replaced_then_exits_3(tmp_path: Path) -> None:
    env = split_env(tmp_path, TTS_ENGINE_MAX_RESTARTS="1", TTS_ENGINE_RESTART_DELAY="1")
    with server_process(env, tmp_path / "server.log") as srv:
        all_serving(srv)
        results: list[httpx.Response] = []

        def whole() -> None:
            results.append(httpx.post(srv.url + "/synthesize", json=long_body(1000), timeout=30))

        t = threading.Thread(target=whole)
        t.start()
        wait_for(lambda: srv.health()["running"] == 1, 10, "running", srv)
        first = engine_pid(srv)
        os.kill(first, signal.SIGKILL)
        t.join(30)
        (r,) = results
        assert r.status_code == 500 and r.json()["error"]["code"] == "synthesis_failed", r.text
        assert r.json()["request_id"] == r.headers["x-request-id"]
        # Not ready while the new engine process starts (its spawn takes seconds); the front-ends stay up.
        ready = httpx.get(srv.url + "/ready", timeout=10)
        health = srv.health()
        assert ready.status_code == 503 and health["status"] == "restarting" and not health["ready"]
        refused = httpx.post(srv.url + "/synthesize", json=body("hello"), timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        wait_for(lambda: httpx.get(srv.url + "/ready", timeout=10).status_code == 200, 120, "ready again", srv)
        assert engine_pid(srv) != first
        again = httpx.post(srv.url + "/synthesize/stream", json=body("hello world"), timeout=30)
        np.testing.assert_allclose(pcm16(again.content), tone(5, 11), atol=1)
        os.kill(engine_pid(srv), signal.SIGKILL)  # past TTS_ENGINE_MAX_RESTARTS=1 within the hour
        assert srv.proc.wait(60) == 3
        assert "1 restarts within the hour already; exiting with status 3" in srv.log()


def test_the_tiny_model_through_a_front_end_gives_the_single_process_servers_audio(tmp_path: Path) -> None:
    request = {"text": "Hello from the engine process.", "speaker_id": "demo", "response_format": "pcm",
               "temperature": 0, "seed": 3, "min_new_tokens": 24, "max_new_tokens": 24}  # fmt: skip
    env = demo_env(tmp_path, TTS_MAX_CONCURRENT="2", TTS_MAX_QUEUE="2")
    audio = {}
    for processes in ("0", "1"):
        with server_process({**env, "TTS_API_PROCESSES": processes}, tmp_path / f"server{processes}.log") as srv:
            r = httpx.post(srv.url + "/synthesize", json=request, timeout=120)
            assert r.status_code == 200, r.text
            assert (r.headers["x-finish-reason"], srv.health()["backend"]) == ("budget", "native")
            audio[processes] = pcm16(r.content)
            with httpx.Client(timeout=120) as c, c.stream("POST", srv.url + "/synthesize/stream",
                                                          json={**request, "min_new_tokens": 400,
                                                                "max_new_tokens": 400}) as s:  # fmt: skip
                next(s.iter_bytes())  # the client leaves after the first chunk: its work stops
            assert srv.wait_idle(30)["admitted"] == 0
    assert len(audio["1"]) == 24 * 1920
    np.testing.assert_array_equal(audio["1"], audio["0"])


def test_children_stop_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    with server_process(split_env(tmp_path), tmp_path / "server.log") as srv:
        children = [engine_pid(all_serving(srv)), *front_end_pids(srv)]
        srv.proc.kill()  # SIGKILL: no chance to stop them itself
        srv.proc.wait(10)

        def gone(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            # A zombie: exited, waiting for its reaper (init adopts and reaps orphans).
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")

        wait_for(lambda: all(gone(pid) for pid in children), 30, "children gone", srv)
        with pytest.raises(httpx.ConnectError):  # nothing listens on the port any more
            httpx.get(srv.url + "/health", timeout=5)
