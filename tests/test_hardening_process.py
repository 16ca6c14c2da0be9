"""Hostile clients against a real `python inference_server.py` process (issue: no client can lock others out,
every error in one shape). Raw sockets where a client library would tidy the attack away.

One server process with deliberately small limits serves every test in this module.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server_helpers import ServerProcess, demo_env, demo_server, metric, server_process

pytestmark = pytest.mark.slow

KEY = "hardening-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example.com"
HEADER_TIMEOUT = 2.0
KEEP_ALIVE_TIMEOUT = 1.0
MAX_CONNECTIONS = 20
PER_CLIENT = 12


def hostile_server(
    root: Path, key: str, max_connections: int, per_client: int, **extra: str
) -> contextlib.AbstractContextManager[ServerProcess]:
    """A demo server behind `key` with small caps (4 running, 4 queued, `max_connections` connections, `per_client`
    of them a client): what the hostile clients here and in test_hardening_connections meet."""
    return demo_server(
        root,
        TTS_API_KEYS=key,
        TTS_MAX_CONCURRENT="4",
        TTS_MAX_QUEUE="4",
        TTS_MAX_CONNECTIONS=str(max_connections),
        TTS_MAX_CONNECTIONS_PER_CLIENT=str(per_client),
        **extra,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("hardening")
    timeouts = {
        "TTS_HEADER_TIMEOUT": str(HEADER_TIMEOUT),
        "TTS_KEEP_ALIVE_TIMEOUT": str(KEEP_ALIVE_TIMEOUT),
        "TTS_BODY_TIMEOUT": "20",
    }
    with hostile_server(root, KEY, MAX_CONNECTIONS, PER_CLIENT, TTS_CORS_ORIGINS=ORIGIN, **timeouts) as srv:
        yield srv


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


# --- helpers ---------------------------------------------------------------------------------------------
def assert_error_shape(status: int, headers: dict[str, str], body: bytes, expected: int) -> dict:
    """The one documented error shape: JSON {"error": {message, type, param, code}, "request_id"} + X-Request-Id."""
    assert status == expected, (status, body[:300])
    assert headers.get("content-type", "").startswith("application/json"), headers
    doc = json.loads(body)
    assert set(doc) == {"error", "request_id"}, doc
    assert set(doc["error"]) == {"message", "type", "param", "code"}, doc
    assert doc["error"]["message"] and doc["error"]["type"] and doc["error"]["code"]
    assert headers.get("x-request-id") and headers["x-request-id"] == doc["request_id"], (headers, doc)
    return doc


def assert_response_error(r: httpx.Response, expected: int) -> dict:
    return assert_error_shape(r.status_code, dict(r.headers), r.content, expected)


def connect(server: ServerProcess, source: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=(source, 0))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_response(s: socket.socket, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length, read off a raw socket."""
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return status, headers, body[:length]


def closed_by_server(s: socket.socket, timeout: float) -> bool:
    """True if the server closes `s` within `timeout` s (after any response it writes first)."""
    s.settimeout(timeout)
    try:
        while True:
            if not s.recv(65536):
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@contextlib.contextmanager
def sockets(n: int, server: ServerProcess, first: bytes, source: str = "127.0.0.1") -> Iterator[list[socket.socket]]:
    opened = []
    try:
        for _ in range(n):
            s = connect(server, source)
            if first:
                s.sendall(first)
            opened.append(s)
        yield opened
    finally:
        for s in opened:
            s.close()


SLOW_HEADER = b"GET /health HTTP/1.1\r\nHost: x\r\n"  # headers never finished
HALF_BODY = (
    b"POST /synthesize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
    b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"speaker_id"'
)  # a request in progress: headers done, body still coming


# --- defect 1: idle and slow-header sockets ------------------------------------------------------------------
def _rejections(server: ServerProcess, reason: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    prefix = f'tts_rejections_total{{reason="{reason}"}} '
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


def test_slow_header_sockets_beyond_the_connection_limit_do_not_lock_anyone_out(server: ServerProcess) -> None:
    reasons = ("idle_evicted", "header_timeout", "connection_limit", "client_connection_limit")
    before = {reason: _rejections(server, reason) for reason in reasons}
    with sockets(MAX_CONNECTIONS + 5, server, SLOW_HEADER) as slow:
        time.sleep(0.2)
        # At the cap the longest-idle connections make room: /health and a real request still get through.
        for _ in range(3):
            r = httpx.get(server.url + "/health", timeout=5)
            assert r.status_code == 200 and r.json()["status"] == "ok"
        # Every slow socket is answered in the error shape and closed within the header timeout: 408 at the header
        # timeout; 429 or 503 at once if it came over the per-client or global cap while every other connection was
        # too new to judge (none had sent a byte yet, http_server.FRESH_GRACE_S); or a bare close if it was evicted
        # before the server had read its bytes (then nothing else comes).
        started = time.monotonic()
        answered = {408: 0, 429: 0, 503: 0}
        for s in slow:
            try:
                status, headers, body = read_response(s, timeout=HEADER_TIMEOUT + 3)
            except (ConnectionResetError, AssertionError) as e:
                assert "closed before a response: b''" in str(e) or isinstance(e, ConnectionResetError), e
                continue
            assert status in answered, status
            doc = assert_error_shape(status, headers, body, status)
            if status != 408:
                assert doc["error"]["code"] == "too_many_connections"
            assert closed_by_server(s, timeout=2)
            answered[status] += 1
        assert time.monotonic() - started < HEADER_TIMEOUT + 3
        # Those still open after the three /health connections made room (per-client cap 12, all from 127.0.0.1)
        # reach the header timeout with their bytes read: at least those nine are answered 408.
        assert answered[408] >= PER_CLIENT - 3, answered
        assert answered[429] + answered[503] <= MAX_CONNECTIONS + 5 - PER_CLIENT, answered  # only those over a cap
    # Each close is counted by its reason in /metrics (the /metrics connection itself may evict one more).
    closed = sum(_rejections(server, reason) - before[reason] for reason in reasons)
    assert MAX_CONNECTIONS + 5 <= closed <= MAX_CONNECTIONS + 6


def test_a_silent_socket_is_closed_after_the_header_timeout(server: ServerProcess) -> None:
    with sockets(1, server, b"") as (s,):
        started = time.monotonic()
        assert closed_by_server(s, timeout=HEADER_TIMEOUT + 3)
        assert HEADER_TIMEOUT - 0.5 < time.monotonic() - started < HEADER_TIMEOUT + 3


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(server: ServerProcess) -> None:
    with sockets(1, server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n") as (s,):
        status, _, _ = read_response(s)
        assert status == 200
        started = time.monotonic()
        assert closed_by_server(s, timeout=KEEP_ALIVE_TIMEOUT + 3)
        assert time.monotonic() - started < KEEP_ALIVE_TIMEOUT + 2


def test_a_client_over_its_connection_cap_gets_429_and_others_are_still_served(server: ServerProcess) -> None:
    with sockets(PER_CLIENT, server, HALF_BODY, source="127.0.0.2"):
        time.sleep(0.3)
        with sockets(1, server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", source="127.0.0.2") as (extra,):
            status, headers, body = read_response(extra)
            doc = assert_error_shape(status, headers, body, 429)
            assert doc["error"]["code"] == "too_many_connections" and headers["retry-after"] == "1"
            assert f"limit {PER_CLIENT}" in doc["error"]["message"]
        assert _rejections(server, "client_connection_limit") >= 1
        # Another client address is not affected by the greedy one.
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_the_global_connection_limit_answers_503_in_the_error_shape_when_all_are_busy(server: ServerProcess) -> None:
    with (
        sockets(PER_CLIENT, server, HALF_BODY, source="127.0.0.2"),
        sockets(MAX_CONNECTIONS - PER_CLIENT, server, HALF_BODY, source="127.0.0.3"),
    ):
        time.sleep(0.3)
        with sockets(1, server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", source="127.0.0.4") as (extra,):
            status, headers, body = read_response(extra)
            doc = assert_error_shape(status, headers, body, 503)
            assert doc["error"]["code"] == "too_many_connections" and headers["retry-after"] == "1"
    assert _rejections(server, "connection_limit") >= 1
    # The busy ones are gone: served again.
    deadline = time.monotonic() + 5
    while httpx.get(server.url + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline


# --- defect 2: header size ---------------------------------------------------------------------------------
def test_oversized_headers_get_431(server: ServerProcess) -> None:
    before = _rejections(server, "headers_too_large")
    r = httpx.get(server.url + "/health", headers={"X-Padding": "a" * 20000}, timeout=10)
    doc = assert_response_error(r, 431)
    assert "16384 bytes" in doc["error"]["message"]
    # 16 MiB of header: refused as soon as the limit is crossed, long before the client has sent it all.
    with sockets(1, server, b"") as (s,):
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: ")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(256):
                s.sendall(b"a" * 65536)
        status, headers, body = read_response(s)
        assert_error_shape(status, headers, body, 431)
    assert httpx.get(server.url + "/health", headers={"X-Padding": "a" * 8000}).status_code == 200
    assert _rejections(server, "headers_too_large") == before + 2


# --- defect 3: log injection ----------------------------------------------------------------------------
def test_a_request_path_cannot_forge_log_lines_or_write_nul(server: ServerProcess) -> None:
    r = httpx.get(server.url + "/x%0aFORGED%20LINE%0d%00end")  # no key needed: refused, but logged
    assert_response_error(r, 401)
    time.sleep(0.2)
    log = server.log_path.read_bytes()
    assert b"\x00" not in log
    lines = log.decode(errors="replace").splitlines()
    assert not any(line.startswith("FORGED") for line in lines)
    access = [line for line in lines if r.headers["x-request-id"] in line]
    assert len(access) == 1 and "/x%0AFORGED%20LINE%0D%00end" in access[0], access


# --- defect 6: errors outside the shape -------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
    ],
)
def test_malformed_http_gets_400_in_the_error_shape(server: ServerProcess, raw: bytes) -> None:
    with sockets(1, server, raw) as (s,):
        status, headers, body = read_response(s)
        doc = assert_error_shape(status, headers, body, 400)
        assert doc["error"]["code"] == "invalid_http"


def test_a_refused_cors_preflight_gets_400_in_the_error_shape(client: httpx.Client) -> None:
    ok = client.options("/synthesize", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    bad = client.options(
        "/synthesize", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "PUT"}
    )
    doc = assert_response_error(bad, 400)
    assert doc["error"]["code"] == "cors_refused" and "origin" in doc["error"]["message"]
    assert "access-control-allow-origin" not in bad.headers


# --- synthesis defects over the socket --------------------------------------------------------------------
def test_min_new_tokens_equal_to_max_fixes_the_length_beyond_the_text_budget(client: httpx.Client) -> None:
    # "Hi." has a text budget of 25 + 8 per token, well under 100 frames: the explicit length must win.
    body = {"speaker_id": "demo", "text": "Hi.", "min_new_tokens": 100, "max_new_tokens": 100, "seed": 3}
    r = client.post("/synthesize", json={**body, "response_format": "pcm"})
    assert r.status_code == 200, r.text
    assert len(r.content) == 100 * 1920 * 2
    assert r.headers["x-finish-reason"] == "budget"
    # max_new_tokens alone only caps: the text budget still ends a text this short well before 100 frames.
    capped = client.post("/synthesize", json={**body, "min_new_tokens": 60, "response_format": "pcm"})
    assert len(capped.content) >= 60 * 1920 * 2


def test_openai_route_names_voice_not_speaker_id(client: httpx.Client) -> None:
    speech = {"model": "tts-1", "input": "hi", "response_format": "wav"}
    bad = client.post("/v1/audio/speech", json={**speech, "voice": "../etc/passwd"})
    assert assert_response_error(bad, 422)["error"]["param"] == "voice"
    assert bad.json()["error"]["message"].startswith("voice: ")
    ghost = client.post("/v1/audio/speech", json={**speech, "voice": "ghost"})
    assert assert_response_error(ghost, 404)["error"]["param"] == "voice"
    assert (
        client.post("/synthesize", json={"speaker_id": "ghost", "text": "hi"}).json()["error"]["param"] == "speaker_id"
    )


@pytest.mark.parametrize("text", ["\u200b\u200b\ufeff", "\u200b \u2060\u00ad\n", "\x01\x02"])
def test_text_of_invisible_characters_only_is_refused(client: httpx.Client, text: str) -> None:
    r = client.post("/synthesize", json={"speaker_id": "demo", "text": text})
    doc = assert_response_error(r, 422)
    assert doc["error"]["param"] == "text" and "visible" in doc["error"]["message"]
    r = client.post("/v1/audio/speech", json={"model": "tts-1", "voice": "demo", "input": text})
    assert assert_response_error(r, 422)["error"]["param"] == "input"
    # Visible text around the invisible characters is fine.
    ok = client.post("/synthesize", json={"speaker_id": "demo", "text": "\u200bHi.", "max_new_tokens": 4})
    assert ok.status_code == 200


def test_a_stream_cut_by_its_client_is_counted_499_not_200(server: ServerProcess, client: httpx.Client) -> None:
    label = 'tts_http_requests_total{route="/synthesize/stream",status="%s"}'
    before = client.get("/metrics").text
    long = {"speaker_id": "demo", "text": "A long story. " * 25, "min_new_tokens": 2048, "max_new_tokens": 2048}
    with (
        httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c,
        c.stream("POST", "/synthesize/stream", json=long) as r,
    ):
        assert r.status_code == 200
        next(r.iter_raw())  # audio is flowing; hang up
    server.wait_idle(30)
    deadline = time.monotonic() + 5
    while metric(client.get("/metrics").text, label % "499") == metric(before, label % "499"):
        assert time.monotonic() < deadline, "the cut stream was never counted as 499"
        time.sleep(0.05)
    after = client.get("/metrics").text
    assert metric(after, label % "499") - metric(before, label % "499") == 1
    assert metric(after, label % "200") == metric(before, label % "200")


def test_the_server_sets_torch_threads(server: ServerProcess) -> None:
    import os

    omp = os.environ.get("OMP_NUM_THREADS", "")
    expected = int(omp) if omp.isdigit() and int(omp) > 0 else max(1, len(os.sched_getaffinity(0)) - 1)
    assert f"torch intra-op threads: {expected}\n" in server.log()


def test_an_sse_timeout_is_logged_once(tmp_path: Path) -> None:
    with demo_server(tmp_path, TTS_REQUEST_TIMEOUT="1.5") as srv:
        long = {"model": "tts-1", "voice": "demo", "input": "A long story. " * 25, "response_format": "pcm",
                "stream_format": "sse", "min_new_tokens": 2048, "max_new_tokens": 2048}  # fmt: skip
        rid = "sse-deadline-1"
        with httpx.stream(
            "POST", srv.url + "/v1/audio/speech", json=long, headers={"X-Request-Id": rid}, timeout=30
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == {"type": "error", "error": {"message": "request timed out", "code": "timeout"}}

        def mentions() -> list[str]:
            return [line for line in srv.log().splitlines() if rid in line and "timeout" in line]

        deadline = time.monotonic() + 10  # the line is written when the job closes: on a loaded machine, later
        while not mentions() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # time for a second line, if there were one
        mentions = mentions()
        assert len(mentions) == 1, mentions
        assert "ended: timeout" in mentions[0]


# --- engine faults -------------------------------------------------------------------------------------------
LONG = {"speaker_id": "demo", "text": "A long story. " * 25, "min_new_tokens": 2048, "max_new_tokens": 2048}
SHORT = {"speaker_id": "demo", "text": "Hello after a fault.", "min_new_tokens": 24, "max_new_tokens": 24,
         "seed": 5, "response_format": "pcm"}  # fmt: skip


def _fault_server(root: Path) -> contextlib.AbstractContextManager[ServerProcess]:
    """A demo server whose engine fails as root/fault says (tts_server/faults.py)."""
    return demo_server(
        root,
        TTS_FAULT_FILE=str(root / "fault"),
        TTS_ENGINE_RESTART_DELAY="1.5",
        TTS_MAX_CONCURRENT="4",
        TTS_MAX_QUEUE="4",
    )


def _stream_until_cut(c: httpx.Client) -> tuple[int, bool]:
    """(bytes received, whether the server cut the stream) of a long stream."""
    received = 0
    with c.stream("POST", "/synthesize/stream", json={**LONG, "seed": 9}) as r:
        assert r.status_code == 200
        try:
            for chunk in r.iter_raw():
                received += len(chunk)
        except httpx.RemoteProtocolError:
            return received, True
    return received, False


def _inject_under_load(srv: ServerProcess, fault_file: Path, kind: str) -> tuple[list[httpx.Response], tuple]:
    """Three long whole-file requests and a stream decoding... then the fault; returns what each got."""
    import concurrent.futures

    with httpx.Client(base_url=srv.url, timeout=60) as c, concurrent.futures.ThreadPoolExecutor(4) as pool:
        stream = pool.submit(_stream_until_cut, c)
        futures = [pool.submit(c.post, "/synthesize", json={**LONG, "seed": i}) for i in range(3)]
        deadline = time.monotonic() + 20
        while c.get("/health").json()["running"] < 4:
            assert time.monotonic() < deadline, "the load never started"
            time.sleep(0.02)
        time.sleep(0.3)  # the stream's first chunks are out
        fault_file.write_text(kind)
        return [f.result() for f in futures], stream.result()


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    root = tmp_path_factory.mktemp("faults")
    with _fault_server(root) as srv:
        yield srv, root / "fault"


@pytest.mark.parametrize("kind", ["oom", "loop"])
def test_an_engine_fault_fails_in_flight_requests_in_shape_then_the_engine_restarts(
    fault_server: tuple[ServerProcess, Path], kind: str
) -> None:
    srv, fault_file = fault_server
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        before = c.post("/synthesize", json=SHORT)
        assert before.status_code == 200
        restarts = c.get("/health").json()["engine_restarts"]
        stream_500 = 'tts_http_requests_total{route="/synthesize/stream",status="500"}'
        cut_before = metric(c.get("/metrics").text, stream_500)

        failed, (received, cut) = _inject_under_load(srv, fault_file, kind)
        for r in failed:  # every request the fault touched: a 500 in the documented shape, with its id
            doc = assert_response_error(r, 500)
            assert doc["error"]["code"] == "synthesis_failed" and doc["request_id"] in doc["error"]["message"]
        # The stream had started: it is cut (an incomplete chunked body, never a clean end), and counted as a 500.
        assert cut and 0 < received < 2048 * 1920 * 4
        assert metric(c.get("/metrics").text, stream_500) == cut_before + 1
        # Not ready while the engine is replaced; new work is refused in shape with Retry-After, never hangs.
        assert c.get("/ready").status_code == 503
        health = c.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "restarting"
        refused = c.post("/synthesize", json=SHORT)
        assert assert_response_error(refused, 503)["error"]["code"] == "not_ready"
        assert refused.headers["retry-after"] == "1"

        deadline = time.monotonic() + 60
        while c.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, srv.log()[-3000:]
            time.sleep(0.05)
        health = c.get("/health").json()
        assert health["status"] == "ok" and health["engine_restarts"] == restarts + 1
        assert health["speakers"] == 1
        # Nothing that was not in flight is lost: the same request gives the same audio as before the fault.
        after = c.post("/synthesize", json=SHORT)
        assert after.status_code == 200 and after.content == before.content
        assert f"tts_engine_restarts_total {float(restarts + 1)}" in c.get("/metrics").text
    assert srv.proc.poll() is None
    log = srv.log()
    assert f"injecting fault '{kind}'" in log and "engine restarted" in log
    assert "the old engine was not freed" not in log  # freed before the next one loaded (its memory with it)


def test_a_sticky_cuda_error_exits_non_zero_for_the_supervisor(tmp_path: Path) -> None:
    fault_file = tmp_path / "fault"
    with _fault_server(tmp_path) as srv:
        failed, _ = _inject_under_load(srv, fault_file, "cuda")
        for r in failed:
            assert_response_error(r, 500)
        assert srv.proc.wait(timeout=60) == 3
        log = srv.log()
        assert "AcceleratorError" in log and "exiting with status 3" in log


# --- defect 5: what "same seed, same audio" means under concurrency ---------------------------------------------
def _alone_then_batched(url: str) -> tuple[bytes, list[bytes]]:
    """The same request alone, then at the same moment as three others (other voices' texts and seeds)."""
    import concurrent.futures

    def body(i: int) -> dict:
        text = ["The same request, alone and in company.", "Another text entirely.", "A third.", "And a fourth."][i]
        return {"speaker_id": "demo", "text": text, "min_new_tokens": 48, "max_new_tokens": 48, "seed": 21 + i,
                "response_format": "pcm"}  # fmt: skip

    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        alone = c.post("/synthesize", json=body(0))
        assert alone.status_code == 200
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            batched = list(pool.map(lambda i: c.post("/synthesize", json=body(i)), range(4)))
    assert all(r.status_code == 200 for r in batched)
    return alone.content, [r.content for r in batched]


def test_by_default_the_same_request_batched_is_within_one_lsb_of_it_alone(server: ServerProcess) -> None:
    import numpy as np

    alone, batched = _alone_then_batched(server.url)
    a, b = np.frombuffer(alone, "<i2").astype(int), np.frombuffer(batched[0], "<i2").astype(int)
    assert a.shape == b.shape == (48 * 1920,)
    diff = np.abs(a - b)
    print(f"\nbatched decode: {(diff > 0).mean():.2%} of samples differ, at most {diff.max()} LSB")
    assert diff.max() <= 1


def test_batch_invariant_decode_makes_the_same_request_bit_identical(tmp_path: Path) -> None:
    with demo_server(tmp_path, TTS_API_KEYS=KEY, TTS_MAX_CONCURRENT="4", TTS_BATCH_INVARIANT_DECODE="1") as srv:
        for _ in range(2):
            alone, batched = _alone_then_batched(srv.url)
            assert batched[0] == alone


def test_an_open_bind_address_without_keys_is_warned_about(tmp_path: Path) -> None:
    env = demo_env(tmp_path, TTS_HOST="0.0.0.0")
    with server_process(env, tmp_path / "server.log") as srv:
        assert "listening on 0.0.0.0 with no API keys" in srv.log()
    with server_process({**env, "TTS_API_KEYS": KEY}, tmp_path / "server-keys.log") as srv:
        assert "with no API keys" not in srv.log()


def test_a_port_taken_before_the_server_binds_it_is_retried_on_another(tmp_path: Path, monkeypatch) -> None:
    """The helper's startup retry: the first port it picks is held by another socket, the server exits "in use",
    and the helper reads that log (after its kill closed it) and starts the server on the next port."""
    import server_helpers

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = iter([taken])
        real = server_helpers.free_port
        monkeypatch.setattr(server_helpers, "free_port", lambda: next(ports, None) or real())
        with server_process(demo_env(tmp_path), tmp_path / "server.log") as srv:
            assert srv.port != taken
            assert httpx.get(srv.url + "/health", timeout=10).json()["ready"] is True
