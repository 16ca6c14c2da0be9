"""Round 2 of hostile clients against a real `python inference_server.py` process: the ways one client still held the
server (a stream nobody reads, a trickling body after an early error, connections over a cap, smuggling framing) and
the refusals that left the error shape (WebSocket upgrades, HEAD, HTTP/2.0 request lines, uploads while they are off).

Raw sockets where a client library would tidy the attack away. One server with small limits serves most tests.
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
from test_hardening_process import assert_error_shape, assert_response_error, hostile_server, read_response

from server_helpers import ServerProcess, demo_server

pytestmark = pytest.mark.slow

KEY = "round-two-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
PER_CLIENT = 6
MAX_CONNECTIONS = 40
REQUEST_TIMEOUT = 6.0
# The server lingers at most 2 s after an early response (http_server.LINGER_S); the slack is for a loaded machine.
CLOSED_WITHIN = 8.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("round2")
    timeouts = {"TTS_HEADER_TIMEOUT": "5", "TTS_BODY_TIMEOUT": "3", "TTS_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT)}
    with hostile_server(root, KEY, MAX_CONNECTIONS, PER_CLIENT, **timeouts) as srv:
        yield srv


def connect(server: ServerProcess, source: str = "127.0.0.1", rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect, so the window the server sees is small from the start
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.settimeout(10)
    s.connect(("127.0.0.1", server.port))
    return s


def ended_by_server(s: socket.socket, within: float) -> bool:
    """True if the server ends the connection (EOF or reset) within `within` s, reading and dropping what it sends."""
    deadline = time.monotonic() + within
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        s.settimeout(left)
        try:
            if not s.recv(1 << 20):
                return True
        except TimeoutError:
            return False
        except (ConnectionResetError, BrokenPipeError):
            return True


def post_head(path: str, length: int | None, *, auth: bool = True, extra: bytes = b"") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
    if auth:
        head += f"Authorization: Bearer {KEY}\r\n".encode()
    if length is not None:
        head += f"Content-Length: {length}\r\n".encode()
    return head + extra + b"\r\n"


# --- 1: a client that stops reading is cut at its deadline ---------------------------------------------------------
def _long(route: str) -> bytes:
    body = {"speaker_id": "demo", "text": "A long story. " * 20, "min_new_tokens": 2048, "max_new_tokens": 2048}
    if route == "/v1/audio/speech":
        body = {"model": "tts-1", "voice": "demo", "input": body["text"], "response_format": "pcm",
                "min_new_tokens": 2048, "max_new_tokens": 2048}  # fmt: skip
    raw = json.dumps(body).encode()
    return post_head(route, len(raw)) + raw


@pytest.mark.parametrize("route", ["/synthesize/stream", "/v1/audio/speech"])
def test_a_client_that_stops_reading_is_cut_at_the_request_timeout_and_its_rows_freed(
    server: ServerProcess, route: str
) -> None:
    """Streams: a whole file blocked on its send is cut the same way (tests/test_request_deadline.py), but the tiny
    model cannot make more audio than the kernel buffers hold within a short timeout."""
    server.wait_idle(30)
    timeouts_before = _timeouts(server)
    started = time.monotonic()
    stalled = []
    for _ in range(2):
        s = connect(server, rcvbuf=4096)
        s.sendall(_long(route))
        stalled.append(s)
    try:
        time.sleep(1.0)
        assert server.health()["admitted"] == 2
        # Nobody reads. By the deadline (+1 s of grace for the route's own message) their engine work is cancelled and
        # /health shows them gone, while their sockets are still full of audio nobody took.
        h = server.wait_idle(REQUEST_TIMEOUT + CLOSED_WITHIN)
        assert time.monotonic() - started < REQUEST_TIMEOUT + CLOSED_WITHIN, h
        assert _timeouts(server) == timeouts_before + 2
        # The connections were cut with a reset, not ended in order: a client cannot take a truncated stream for a
        # whole one, and the kernel does not keep trying to deliver the rest.
        time.sleep(0.5)
        for s in stalled:
            s.settimeout(5)
            with pytest.raises(ConnectionResetError):
                while s.recv(1 << 20):
                    pass
        # Others are served at once.
        r = httpx.post(server.url + "/synthesize", headers=AUTH, json={"speaker_id": "demo", "text": "Hi."}, timeout=30)
        assert r.status_code == 200
    finally:
        for s in stalled:
            s.close()


def _timeouts(server: ServerProcess) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    prefix = 'tts_syntheses_total{outcome="timeout"} '
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


# --- 2: early responses close the connection; trickling bodies are bounded --------------------------------------
@pytest.mark.parametrize(
    ("head", "status"),
    [
        (post_head("/synthesize", 100_000, auth=False), 401),  # no key: answered before the body
        (post_head("/synthesize", 10_000_000), 413),  # declared too large
        (post_head("/synthesize", 1000), 408),  # the body never completes within TTS_BODY_TIMEOUT (3 s)
    ],
)
def test_a_trickling_client_is_disconnected_after_an_early_error(
    server: ServerProcess, head: bytes, status: int
) -> None:
    with connect(server) as s:
        s.sendall(head + b"{")
        # Trickle one byte a second while reading whatever comes: the response, then the end of the connection.
        data, ended, started = b"", False, time.monotonic()
        while time.monotonic() - started < 15:
            try:
                s.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                ended = True
                break
            s.settimeout(1.0)
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                ended = True
                break
            if not chunk:
                ended = True
                break
            data += chunk
        assert ended, f"still open after 15 s of trickling; got {data[:200]!r}"
        head_, _, body = data.partition(b"\r\n\r\n")
        lines = head_.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        assert_error_shape(int(lines[0].split()[1]), headers, body[: int(headers["content-length"])], status)


def test_connections_over_the_per_client_cap_are_refused_at_once_and_others_served(server: ServerProcess) -> None:
    busy = [connect(server, "127.0.0.5") for _ in range(PER_CLIENT)]
    try:
        for s in busy:  # requests in progress: headers done, body still coming
            s.sendall(post_head("/synthesize", 1000) + b'{"speaker_id"')
        time.sleep(0.3)
        # Twice the cap more from the same address: each is answered 429 without having sent a byte, then closed.
        for _ in range(2 * PER_CLIENT):
            with connect(server, "127.0.0.5") as extra:
                status, headers, body = read_response(extra, timeout=5)
                doc = assert_error_shape(status, headers, body, 429)
                assert doc["error"]["code"] == "too_many_connections" and headers["retry-after"] == "1"
                assert ended_by_server(extra, CLOSED_WITHIN)
        # Another address is untouched: served, and not told the server is full.
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        for s in busy:
            s.close()


def test_a_burst_over_the_per_client_cap_gets_429s_not_resets(server: ServerProcess) -> None:
    """A client that opens many connections before writing on any (as a pool does in a burst) is held to its cap with
    429s; a new connection that has not written yet is not taken for an idle one and reset."""
    burst = [connect(server, "127.0.0.7") for _ in range(2 * PER_CLIENT)]
    try:
        time.sleep(0.3)  # under http_server.FRESH_GRACE_S: every connection is still new
        for s in burst:
            with contextlib.suppress(BrokenPipeError):  # refused at once: its 429 is waiting to be read
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        statuses = []
        for s in burst:
            status, headers, body = read_response(s)  # a reset or a bare close fails here
            if status != 200:
                doc = assert_error_shape(status, headers, body, 429)
                assert doc["error"]["code"] == "too_many_connections"
            statuses.append(status)
        assert statuses.count(200) == PER_CLIENT and statuses.count(429) == PER_CLIENT, statuses
    finally:
        for s in burst:
            s.close()


# --- 6: request smuggling framing, HTTP versions ------------------------------------------------------------------
def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(server: ServerProcess) -> None:
    smuggled = b"GET /speakers HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    with connect(server) as s:
        s.sendall(post_head("/synthesize", 5, extra=b"Transfer-Encoding: chunked\r\n") + b"0\r\n\r\n" + smuggled)
        status, headers, body = read_response(s)
        doc = assert_error_shape(status, headers, body, 400)
        assert "Content-Length and Transfer-Encoding" in doc["error"]["message"]
        assert headers["connection"] == "close"
        # The request behind it is never answered: the next thing on the socket is its end.
        s.settimeout(5)
        rest = b""
        try:
            while chunk := s.recv(65536):
                rest += chunk
        except ConnectionResetError:
            pass
        assert rest == b""


@pytest.mark.parametrize("version", [b"HTTP/2.0", b"HTTP/3.0"])
def test_other_http_versions_get_505_in_the_error_shape(server: ServerProcess, version: bytes) -> None:
    with connect(server) as s:
        s.sendall(b"GET /health " + version + b"\r\nHost: x\r\n\r\n")
        status, headers, body = read_response(s)
        doc = assert_error_shape(status, headers, body, 505)
        assert version.decode() in doc["error"]["message"]
        assert ended_by_server(s, CLOSED_WITHIN)


# --- 9, 11: WebSocket upgrades, HEAD -------------------------------------------------------------------------------
def _upgrade(path: str, auth: bool) -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        + (f"Authorization: Bearer {KEY}\r\n" if auth else "")
        + "\r\n"
    ).encode()


@pytest.mark.parametrize(("auth", "status"), [(False, 401), (True, 404)])
def test_a_websocket_upgrade_is_refused_in_the_error_shape(server: ServerProcess, auth: bool, status: int) -> None:
    for _ in range(PER_CLIENT + 2):  # refused upgrades leave nothing counted against the client
        with connect(server, "127.0.0.6") as s:
            s.sendall(_upgrade("/v1/audio/no-such-socket", auth))  # (the speech session's is test_ws_*.py's)
            got, headers, body = read_response(s)
            doc = assert_error_shape(got, headers, body, status)
    if status == 404:
        assert "no WebSocket endpoint" in doc["error"]["message"]
    with connect(server, "127.0.0.6") as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(s)[0] == 200


def test_head_is_answered_like_get_without_a_body(server: ServerProcess) -> None:
    get = httpx.get(server.url + "/health", timeout=10)
    head = httpx.head(server.url + "/health", timeout=10)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"] == "application/json"
    page = httpx.head(server.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    refused = httpx.post(server.url + "/health", timeout=10)
    doc = assert_response_error(refused, 405)
    assert refused.headers["allow"] == "GET, HEAD", doc


def test_the_page_forbids_framing_and_foreign_scripts(server: ServerProcess) -> None:
    r = httpx.get(server.url + "/", timeout=10)
    csp = {d.split(" ", 1)[0]: d.split(" ", 1)[1:] for d in r.headers["content-security-policy"].split("; ")}
    assert csp["default-src"] == ["'none'"] and csp["frame-ancestors"] == ["'none'"]
    assert csp["script-src"][0].startswith("'sha256-") and "unsafe-inline" not in csp["script-src"][0]
    assert csp["connect-src"] == ["'self'"]
    assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"


# --- 8, 3: uploads off is 403 before any size check; uploads in flight are bounded ------------------------------
def test_an_upload_while_uploads_are_off_gets_403_not_413(server: ServerProcess) -> None:
    with connect(server) as s:
        s.sendall(post_head("/v1/audio/voices", 5_000_000, extra=b"Expect: 100-continue\r\n"))
        status, headers, body = read_response(s)
        doc = assert_error_shape(status, headers, body, 403)
        assert doc["error"]["code"] == "voice_management_disabled"
        assert ended_by_server(s, CLOSED_WITHIN)


def _multipart_head(length: int) -> bytes:
    return (
        f"POST /v1/audio/voices HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: multipart/form-data; boundary=b0undary\r\nContent-Length: {length}\r\n\r\n"
    ).encode() + b"--b0undary\r\n"


def test_upload_bytes_in_flight_are_bounded_with_429(tmp_path: Path) -> None:
    mib = 1024 * 1024
    with demo_server(
        tmp_path,
        TTS_API_KEYS=KEY,
        TTS_VOICE_UPLOAD="true",
        TTS_VOICE_UPLOAD_MAX_BYTES=str(mib),
        TTS_VOICE_UPLOAD_INFLIGHT_BYTES=str(2 * mib),
        TTS_BODY_TIMEOUT="30",
    ) as srv:
        holding = [connect(srv) for _ in range(2)]
        try:
            for s in holding:  # two uploads of the largest size, their bodies still coming
                s.sendall(_multipart_head(mib))
            time.sleep(0.5)
            with connect(srv) as third:
                third.sendall(_multipart_head(mib // 2))
                status, headers, body = read_response(third)
                doc = assert_error_shape(status, headers, body, 429)
                assert doc["error"]["code"] == "uploads_in_flight" and headers["retry-after"] == "1"
                assert f"{2 * mib} bytes" in doc["error"]["message"]
        finally:
            for s in holding:
                s.close()
        # Their budget comes back when they go: the next upload is read and judged on its content.
        deadline = time.monotonic() + 10
        while True:
            r = httpx.post(
                srv.url + "/v1/audio/voices",
                headers=AUTH,
                data={"name": "late"},
                files={"audio_sample": ("a.wav", b"not audio", "audio/wav")},
                timeout=30,
            )
            if r.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert_response_error(r, 422)
        # A malformed multipart body is the client's error: 400, and nothing from the parser in the server's log.
        broken = b'--b0undaryX\r\nContent-Disposition: form-data; name="name"\r\n\r\nx\r\n--b0undary--\r\n'
        r = httpx.post(
            srv.url + "/v1/audio/voices",
            headers={**AUTH, "Content-Type": "multipart/form-data; boundary=b0undary"},
            content=broken,
            timeout=30,
        )
        assert assert_response_error(r, 400)["error"]["code"] == "invalid_multipart"
        time.sleep(0.2)
        assert "python_multipart" not in srv.log()


# --- the server's own time before the engine ---------------------------------------------------------------------
def _time_to_engine(server: ServerProcess) -> tuple[float, float]:
    """(count, sum in s) of tts_time_to_engine_seconds on the server's /metrics page."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        for field in ("_count", "_sum"):
            if line.startswith(f"tts_time_to_engine_seconds{field} "):
                values[field] = float(line.split()[-1])
    return values["_count"], values["_sum"]


def test_time_to_engine_runs_from_the_arrival_of_the_headers_through_a_slow_body(server: ServerProcess) -> None:
    """The metric starts when the read that completed a request's headers arrived (the app's own clock starts only
    when its task first runs): a body sent 0.5 s after the headers is inside it, and the request is counted once."""
    server.wait_idle(30)
    count0, sum0 = _time_to_engine(server)
    raw = json.dumps({"speaker_id": "demo", "text": "Hello there.", "max_new_tokens": 3}).encode()
    with contextlib.closing(connect(server)) as s:
        s.sendall(post_head("/synthesize", len(raw)))
        time.sleep(0.5)
        s.sendall(raw)
        status, _, body = read_response(s, timeout=60)
    assert status == 200 and body[:4] == b"RIFF"
    count1, sum1 = _time_to_engine(server)
    assert count1 - count0 == 1
    assert 0.5 <= sum1 - sum0 < 5.0
