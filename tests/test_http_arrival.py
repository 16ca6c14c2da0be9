"""A request's arrival as the server's HTTP layer records it (tts_server/http_server.py): the time of the read that
completed its headers, not the later moment its task first runs. In a burst the event loop reads many requests in
one turn and then runs their tasks one after another; tts_time_to_engine_seconds counts from the arrival."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from server_helpers import free_port
from tts_server.http_server import ARRIVED_AT, ConnectionLimits, uvicorn_options

HOLD_S = 1.0  # how long each request's handler holds the event loop


@pytest.fixture
def server() -> Iterator[tuple[int, dict[str, tuple[float | None, float]]]]:
    """Our HTTP layer on a thread of its own over an app that records (arrival, its own start) per path and then
    holds the loop for HOLD_S (as a burst's request handling does, one task after another)."""
    seen: dict[str, tuple[float | None, float]] = {}

    async def app(scope, receive, send) -> None:
        assert scope["type"] == "http"
        seen[scope["path"]] = (scope.get("state", {}).get(ARRIVED_AT), time.monotonic())
        if scope["path"] != "/warm":
            time.sleep(HOLD_S)  # the loop is held: nothing else is read or run meanwhile
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    limits = ConnectionLimits(
        header_timeout=10, keep_alive_timeout=5, max_header_bytes=8192, max_connections=16,
        max_connections_per_client=16, retry_after=1,
    )  # fmt: skip
    port = free_port()
    # log_config=None: uvicorn leaves the process's logging as it is (its own config would outlive the test).
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_config=None,
                            **uvicorn_options(limits))  # fmt: skip
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield port, seen
    finally:
        srv.should_exit = True
        thread.join(10)


def _connect(port: int) -> socket.socket:
    """A connection that has served one request already (kept alive, as a client's connection pool holds them)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    _send(s, "/warm")
    assert _answer(s).startswith(b"HTTP/1.1 200")
    return s


def _send(s: socket.socket, path: str) -> None:
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())


def _answer(s: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"ok"):
        chunk = s.recv(4096)
        assert chunk, data
        data += chunk
    return data


def test_requests_read_in_one_turn_are_timed_from_that_read_not_from_their_tasks_start(server) -> None:
    port, seen = server
    first, second, third = (_connect(port) for _ in range(3))
    _send(first, "/first")  # its handler holds the loop: the next two wait in the kernel meanwhile
    time.sleep(HOLD_S / 3)
    _send(second, "/second")
    _send(third, "/third")
    for s in (first, second, third):
        assert _answer(s).startswith(b"HTTP/1.1 200")
        s.close()
    (a2, s2), (a3, s3) = seen["/second"], seen["/third"]
    assert a2 is not None and a3 is not None
    assert a2 <= s2 and a3 <= s3
    # Both were read in the turn after the first's handler let go of the loop; whichever ran second started one
    # handler's hold after its arrival.
    assert abs(a2 - a3) < HOLD_S / 2
    assert max(s2 - a2, s3 - a3) >= HOLD_S * 0.9
    arrived_first, started_first = seen["/first"]
    assert arrived_first is not None and 0 <= started_first - arrived_first < HOLD_S / 2
