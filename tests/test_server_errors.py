"""Server hardening, in process over the deterministic fake engine: bad input, error mapping, admission,
timeouts, disconnects, auth, CORS, body limits. Every refusal has the one error shape and names the field."""

from __future__ import annotations

import asyncio
import gc
import json
from pathlib import Path

import httpx
import pytest

from qwen_tts.engines.fake import FakeEngine
from server_helpers import http_scope, in_process, write_voice

DIM = 16


@pytest.fixture
def voices(tmp_path: Path) -> Path:
    root = tmp_path / "voices"
    write_voice(root, "alice", DIM, seed=1)
    return root


def _ok_body(**extra) -> dict:
    return {"speaker_id": "alice", "text": "Hello there.", **extra}


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error", "request_id"}, body
    assert body["request_id"] == r.headers["x-request-id"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# --- input validation ----------------------------------------------------------------------------------
BAD_INPUTS = [
    # (description, raw body or json, status, param, message fragment)
    ("malformed json", b'{"speaker_id": "alice", "text": ', 400, None, "not valid JSON"),
    ("empty body", b"", 400, None, "body is empty"),
    ("json array", b"[1, 2]", 400, None, "JSON object"),
    ("json string", b'"hello"', 400, None, "JSON object"),
    ("invalid utf-8", b'{"speaker_id": "alice", "text": "\xff\xfe"}', 400, None, "not valid JSON"),
    ("missing text", {"speaker_id": "alice"}, 422, "text", "text: field required"),
    ("missing speaker", {"text": "hi"}, 422, "speaker_id", "speaker_id: field required"),
    ("text wrong type", _ok_body(text=5), 422, "text", "valid string"),
    ("temperature as string", _ok_body(temperature="0.5"), 422, "temperature", "valid number"),
    ("top_k as float", _ok_body(top_k=2.5), 422, "top_k", "valid integer"),
    ("seed as bool", _ok_body(seed=True), 422, "seed", "valid integer"),
    ("unknown field", _ok_body(temprature=0.5), 422, "temprature", "unknown field (allowed: "),
    ("empty text", _ok_body(text=""), 422, "text", "at least 1 character"),
    ("whitespace text", _ok_body(text="   \n\t "), 422, "text", "non-whitespace"),
    ("huge text", _ok_body(text="a" * 5000), 422, "text", "5000 characters, the limit is 4096"),
    ("unknown language", _ok_body(language="Klingon"), 422, "language", "'Klingon' is not supported"),
    ("unknown format", _ok_body(response_format="m4a"), 422, "response_format", "Input should be 'wav'"),
    ("max_new_tokens over cap", _ok_body(max_new_tokens=5000), 422, "max_new_tokens", "limit of 2048"),
    ("min_new_tokens over cap", _ok_body(min_new_tokens=3000), 422, "min_new_tokens", "above max_new_tokens (2048)"),
    ("max_new_tokens zero", _ok_body(max_new_tokens=0), 422, "max_new_tokens", "greater than or equal to 1"),
    ("temperature too high", _ok_body(temperature=3.0), 422, "temperature", "less than or equal to 2"),
    ("top_k zero", _ok_body(top_k=0), 422, "top_k", "greater than or equal to 1"),
    ("negative seed", _ok_body(seed=-1), 422, "seed", "greater than or equal to 0"),
    ("seed too large", _ok_body(seed=2**40), 422, "seed", "less than or equal to 4294967295"),
    ("traversal id", _ok_body(speaker_id="../alice"), 422, "speaker_id", "speaker id must be"),
    ("absolute id", _ok_body(speaker_id="/etc/passwd"), 422, "speaker_id", "speaker id must be"),
    ("nul id", _ok_body(speaker_id="alice\u0000"), 422, "speaker_id", "speaker id must be"),
    ("dot id", _ok_body(speaker_id=".."), 422, "speaker_id", "speaker id must be"),
    ("long id", _ok_body(speaker_id="a" * 65), 422, "speaker_id", "at most 64 characters"),
    ("id wrong type", _ok_body(speaker_id=["alice"]), 422, "speaker_id", "valid string"),
    ("unknown speaker", _ok_body(speaker_id="nobody"), 404, "speaker_id", "unknown speaker 'nobody'"),
]


@pytest.mark.parametrize(
    ("body", "status", "param", "fragment"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
async def test_bad_input_gets_a_clear_4xx_and_the_server_stays_healthy(
    voices: Path, body, status: int, param: str | None, fragment: str
) -> None:
    engine = FakeEngine(xvector_dim=DIM)
    async with in_process(engine, profiles_dir=voices) as s:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await s.client.post("/synthesize", content=content, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        err = _error(r)
        assert fragment in err["message"], err
        assert err["param"] == param
        assert "Traceback" not in r.text
        # Nothing reached the engine, nothing is held, and the next good request works.
        assert engine.submitted == [] and s.runtime.admission.active == 0
        ok = await s.client.post("/synthesize", json=_ok_body())
        assert ok.status_code == 200


async def test_body_without_json_content_type_is_still_parsed(voices: Path) -> None:
    async with in_process(FakeEngine(xvector_dim=DIM), profiles_dir=voices) as s:
        r = await s.client.post("/synthesize", content=json.dumps(_ok_body()).encode())
        assert r.status_code == 200


async def test_stream_refuses_compressed_formats_naming_the_allowed_ones(voices: Path) -> None:
    async with in_process(FakeEngine(xvector_dim=DIM), profiles_dir=voices) as s:
        r = await s.client.post("/synthesize/stream", json=_ok_body(response_format="mp3"))
        assert r.status_code == 422
        assert "'f32le', 'pcm' or 'wav'" in _error(r)["message"]


async def test_engine_refusal_of_options_is_a_422(voices: Path) -> None:
    class TokenLimited(FakeEngine):
        def submit(self, request):
            raise ValueError("text is 2000 tokens, the limit is 1024")

    async with in_process(TokenLimited(xvector_dim=DIM), profiles_dir=voices) as s:
        r = await s.client.post("/synthesize", json=_ok_body())
        assert r.status_code == 422
        err = _error(r)
        assert err["message"] == "text is 2000 tokens, the limit is 1024" and err["param"] == "text"
        assert s.runtime.admission.active == 0


async def test_profile_with_wrong_width_is_a_404_that_says_so(voices: Path) -> None:
    write_voice(voices, "wide", DIM * 2)
    async with in_process(FakeEngine(xvector_dim=DIM), profiles_dir=voices) as s:
        r = await s.client.post("/synthesize", json=_ok_body(speaker_id="wide"))
        assert r.status_code == 404
        err = _error(r)
        assert err["code"] == "invalid_profile" and "unusable profile" in err["message"]
        assert str(voices) not in r.text  # no file system paths to clients


# --- body size -------------------------------------------------------------------------------------------
async def test_declared_oversized_body_is_413_before_parsing(voices: Path) -> None:
    async with in_process(FakeEngine(xvector_dim=DIM), profiles_dir=voices, max_body_bytes=2048) as s:
        r = await s.client.post("/synthesize", json=_ok_body(text="x" * 3000))
        assert r.status_code == 413
        err = _error(r)
        assert "limit of 2048 bytes" in err["message"] and err["code"] == "body_too_large"


async def test_chunked_oversized_body_is_413(voices: Path) -> None:
    async def chunks():
        for _ in range(10):
            yield b" " * 1000

    async with in_process(FakeEngine(xvector_dim=DIM), profiles_dir=voices, max_body_bytes=4096) as s:
        r = await s.client.post("/synthesize", content=chunks())
        assert r.status_code == 413


async def test_body_that_never_finishes_arriving_is_a_408(voices: Path) -> None:
    async with in_process(FakeEngine(xvector_dim=DIM), profiles_dir=voices, body_timeout=0.2) as s:
        stalled = asyncio.Event()

        async def receive():
            if not stalled.is_set():
                stalled.set()
                return {"type": "http.request", "body": b'{"speaker_id": ', "more_body": True}
            await asyncio.sleep(10)  # the rest never comes
            return {"type": "http.disconnect"}

        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/synthesize", "headers": [], "query_string": b""}
        await asyncio.wait_for(s.app(scope, receive, send), timeout=5)
        assert sent[0]["status"] == 408
        assert b"not received within 0.2 s" in sent[1]["body"]


# --- routing -----------------------------------------------------------------------------------------------
async def test_unknown_route_and_wrong_method_use_the_error_shape(voices: Path) -> None:
    async with in_process(FakeEngine(xvector_dim=DIM), profiles_dir=voices) as s:
        r = await s.client.get("/nope")
        assert r.status_code == 404 and _error(r)["code"] == "not_found"
        r = await s.client.get("/synthesize")
        assert r.status_code == 405 and _error(r)["code"] == "method_not_allowed"


# --- engine failures, overload, readiness ------------------------------------------------------------------
async def test_engine_failure_is_a_500_with_the_request_id_and_no_internals(voices: Path) -> None:
    async with in_process(FakeEngine(xvector_dim=DIM), profiles_dir=voices) as s:
        r = await s.client.post("/synthesize", json=_ok_body(text="boom [fail]"), headers={"x-request-id": "req-42"})
        assert r.status_code == 500
        err = _error(r)
        assert err["message"] == "synthesis failed (request id req-42)"
        assert "simulated" not in r.text and "Traceback" not in r.text
        assert s.runtime.admission.active == 0


async def test_stream_failure_before_audio_is_a_500_not_a_broken_stream(voices: Path) -> None:
    async with in_process(FakeEngine(xvector_dim=DIM), profiles_dir=voices) as s:
        r = await s.client.post("/synthesize/stream", json=_ok_body(text="boom [fail]"))
        assert r.status_code == 500 and _error(r)["code"] == "synthesis_failed"


async def test_over_capacity_gets_429_with_retry_after_and_recovers(voices: Path) -> None:
    engine = FakeEngine(xvector_dim=DIM, max_slots=2, max_queue=100, frame_delay=0.02)
    async with in_process(engine, profiles_dir=voices, max_concurrent=2, max_queue=1, retry_after=3) as s:
        slow = [asyncio.create_task(s.client.post("/synthesize", json=_ok_body(text="x" * 30))) for _ in range(3)]
        while s.runtime.admission.active < 3:
            await asyncio.sleep(0.005)
        r = await s.client.post("/synthesize", json=_ok_body())
        assert r.status_code == 429
        assert r.headers["retry-after"] == "3"
        assert _error(r)["type"] == "rate_limit_error"
        assert [t.status_code for t in await asyncio.gather(*slow)] == [200, 200, 200]
        assert s.runtime.admission.active == 0
        assert (await s.client.post("/synthesize", json=_ok_body())).status_code == 200
        metrics = (await s.client.get("/metrics")).text
        assert 'tts_rejections_total{reason="queue_full"} 1.0' in metrics


async def test_engine_queue_full_is_a_429(voices: Path) -> None:
    engine = FakeEngine(xvector_dim=DIM, max_slots=1, max_queue=0, frame_delay=0.02)
    async with in_process(engine, profiles_dir=voices, max_concurrent=4, max_queue=4) as s:
        first = asyncio.create_task(s.client.post("/synthesize", json=_ok_body(text="x" * 20)))
        while engine.num_running + engine.num_waiting < 1:
            await asyncio.sleep(0.005)
        r = await s.client.post("/synthesize", json=_ok_body())
        assert r.status_code == 429 and "retry-after" in r.headers
        assert (await first).status_code == 200
        assert s.runtime.admission.active == 0


async def test_draining_server_refuses_with_503_and_readiness_says_why(voices: Path) -> None:
    async with in_process(FakeEngine(xvector_dim=DIM), profiles_dir=voices) as s:
        assert (await s.client.get("/ready")).status_code == 200
        s.runtime.begin_drain()
        r = await s.client.post("/synthesize", json=_ok_body())
        assert r.status_code == 503 and "draining" in _error(r)["message"] and "retry-after" in r.headers
        ready = await s.client.get("/ready")
        assert ready.status_code == 503 and ready.json() == {"status": "draining"}
        health = await s.client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "draining"


async def test_dead_engine_fails_liveness(voices: Path) -> None:
    engine = FakeEngine(xvector_dim=DIM)
    async with in_process(engine, profiles_dir=voices) as s:
        engine._ready = False  # what an engine whose loop died reports
        assert (await s.client.get("/health")).status_code == 503
        assert (await s.client.get("/ready")).status_code == 503


# --- timeouts ----------------------------------------------------------------------------------------------
async def _until_nothing_runs(engine: FakeEngine) -> None:
    """Wait up to a second for the engine to drop its cancelled request (at its next frame), then assert it did."""
    for _ in range(100):
        if engine.num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.num_running == 0


async def test_timeout_is_a_504_and_cancels_the_engine_request(voices: Path) -> None:
    engine = FakeEngine(xvector_dim=DIM, frame_delay=0.05)
    async with in_process(engine, profiles_dir=voices, request_timeout=0.2) as s:
        r = await s.client.post("/synthesize", json=_ok_body(text="x" * 100), headers={"x-request-id": "slow-1"})
        assert r.status_code == 504
        assert "limit of 0.2 s" in _error(r)["message"]
        assert engine.cancelled == ["slow-1"]
        assert s.runtime.admission.active == 0
        await _until_nothing_runs(engine)


async def test_stream_timeout_before_first_audio_is_a_504(voices: Path) -> None:
    engine = FakeEngine(xvector_dim=DIM, frame_delay=0.2)
    async with in_process(engine, profiles_dir=voices, request_timeout=0.1) as s:
        r = await s.client.post("/synthesize/stream", json=_ok_body(text="x" * 100))
        assert r.status_code == 504
        assert len(engine.cancelled) == 1


# --- disconnects (driven at the ASGI level, where the disconnect message is exact) ---------------------------
async def _call_and_disconnect(app, path: str, body: dict, disconnect_after: float | None) -> list[dict]:
    """Drive one request through the ASGI app; the client hangs up after `disconnect_after` s (None: never)."""
    sent: list[dict] = []
    gone = asyncio.Event()
    payload = json.dumps(body).encode()
    messages = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    headers = [(b"host", b"testserver"), (b"content-type", b"application/json"), (b"x-request-id", b"gone-1")]
    scope = http_scope(path, headers)
    call = asyncio.create_task(app(scope, receive, send))
    if disconnect_after is not None:
        await asyncio.sleep(disconnect_after)
        gone.set()
    await asyncio.wait_for(call, timeout=5)
    gone.set()
    return sent


def _cut_short(sent: list[dict]) -> bool:
    """A response that started with 200 and never sent its final body message: the client sees a broken stream."""
    started = sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    return started and not any(m["type"] == "http.response.body" and not m.get("more_body") for m in sent)


async def test_engine_failure_mid_stream_cuts_the_stream(voices: Path) -> None:
    engine = FakeEngine(xvector_dim=DIM)
    async with in_process(engine, profiles_dir=voices) as s:
        sent = await _call_and_disconnect(s.app, "/synthesize/stream", _ok_body(text="x [fail-mid] " * 5), None)
        assert _cut_short(sent)
        assert sum(len(m.get("body", b"")) for m in sent[1:]) == 3 * 1920 * 4  # the first chunk got out
        assert s.runtime.admission.active == 0
        assert 'tts_syntheses_total{outcome="error"} 1.0' in (await s.client.get("/metrics")).text


async def test_timeout_mid_stream_cuts_the_stream_and_cancels(voices: Path) -> None:
    engine = FakeEngine(xvector_dim=DIM, frame_delay=0.02)
    async with in_process(engine, profiles_dir=voices, request_timeout=0.3) as s:
        sent = await _call_and_disconnect(s.app, "/synthesize/stream", _ok_body(text="x" * 200), None)
        assert _cut_short(sent)
        assert engine.cancelled == ["gone-1"] and s.runtime.admission.active == 0
        assert 'tts_syntheses_total{outcome="timeout"} 1.0' in (await s.client.get("/metrics")).text


@pytest.mark.parametrize("path", ["/synthesize", "/synthesize/stream", "/v1/audio/speech"])
async def test_client_disconnect_cancels_the_engine_request_and_frees_the_slot(voices: Path, path: str) -> None:
    engine = FakeEngine(xvector_dim=DIM, frame_delay=0.02)
    body = _ok_body(text="x" * 200)
    if path == "/v1/audio/speech":
        body = {"model": "m", "voice": "alice", "input": "x" * 200, "response_format": "pcm"}
    async with in_process(engine, profiles_dir=voices) as s:
        sent = await _call_and_disconnect(s.app, path, body, disconnect_after=0.3)
        assert engine.cancelled == ["gone-1"]
        assert s.runtime.admission.active == 0
        await _until_nothing_runs(engine)
        # A whole-file request ends as 499 (nginx's "client closed", for logs and metrics; nobody receives it);
        # a stream had started with 200 and is cut before its end.
        if path == "/synthesize":
            assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
        else:
            assert _cut_short(sent)
        metrics = (await s.client.get("/metrics")).text
        assert "tts_client_disconnects_total 1.0" in metrics
        assert 'tts_syntheses_total{outcome="disconnected"} 1.0' in metrics


# --- auth and CORS -----------------------------------------------------------------------------------------
async def test_api_keys_guard_everything_but_health_ready_and_metrics(voices: Path) -> None:
    keys = "first-key-123,second-key-456"
    async with in_process(FakeEngine(xvector_dim=DIM), profiles_dir=voices, api_keys=keys) as s:
        c = s.client
        r = await c.post("/synthesize", json=_ok_body())
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert "missing API key" in _error(r)["message"]
        r = await c.post("/synthesize", json=_ok_body(), headers={"authorization": "Bearer wrong-key-000"})
        assert r.status_code == 401 and _error(r)["message"] == "invalid API key"
        r = await c.post("/synthesize", json=_ok_body(), headers={"authorization": "Basic second-key-456"})
        assert r.status_code == 401
        for key in ("first-key-123", "second-key-456"):
            r = await c.post("/synthesize", json=_ok_body(), headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200
        assert (await c.get("/speakers")).status_code == 401
        for public in ("/health", "/ready", "/metrics"):
            assert (await c.get(public)).status_code == 200, public


async def test_cors_allows_only_listed_origins(voices: Path) -> None:
    origins = "https://app.example,http://localhost:3000"
    async with in_process(FakeEngine(xvector_dim=DIM), profiles_dir=voices, cors_origins=origins) as s:
        pre = {"origin": "https://app.example", "access-control-request-method": "POST"}
        r = await s.client.options("/synthesize", headers=pre)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = await s.client.post("/synthesize", json=_ok_body(), headers={"origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-audio-duration" in r.headers["access-control-expose-headers"].lower()
        r = await s.client.options("/synthesize", headers={**pre, "origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers


async def test_no_cors_headers_without_configured_origins(voices: Path) -> None:
    async with in_process(FakeEngine(xvector_dim=DIM), profiles_dir=voices) as s:
        r = await s.client.post("/synthesize", json=_ok_body(), headers={"origin": "https://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


async def test_unsafe_client_request_id_is_replaced(voices: Path) -> None:
    async with in_process(FakeEngine(xvector_dim=DIM), profiles_dir=voices) as s:
        r = await s.client.get("/health", headers={"x-request-id": "bad id\twith spaces"})
        rid = r.headers["x-request-id"]
        assert rid != "bad id\twith spaces" and len(rid) == 32


# --- the app factory's own lifespan (uvicorn --factory inference_server:create_app) -------------------------
def test_factory_lifespan_starts_and_stops_the_engine(voices: Path) -> None:
    from fastapi.testclient import TestClient

    from inference_server import create_app
    from server_helpers import clean_settings

    engine = FakeEngine(xvector_dim=DIM)
    app = create_app(clean_settings(profiles_dir=voices, backend="fake"), engine=engine)
    gc.unfreeze()
    with TestClient(app) as c:
        # The start-up heap, engine included, is out of full collections while serving (tts_server/heap.py).
        assert gc.get_freeze_count() > 1000
        assert c.get("/ready").status_code == 200
        assert c.post("/synthesize", json=_ok_body()).status_code == 200
        # backend fake + model "demo": a random demo voice of the fake width is written beside yours.
        assert [s["id"] for s in c.get("/speakers").json()["speakers"]] == ["alice", "demo"]
    assert not engine.ready
    assert gc.get_freeze_count() == 0  # thawed when the engine stopped: its cycles are collectable again
