"""The server on Ray Serve (tts_serve/): two CPU replicas of the tiny demo engine behind Serve's proxy.

One `python -m tts_serve --replicas 2` process (in .venv-ray, made by scripts/setup_ray.sh; scripts/test.sh sets
it up) serves the module; the tests talk HTTP to its proxy. Each replica has one engine slot and a queue of one
(max_ongoing_requests 2), the proxy queues up to 40 more. The replica-kill test runs last: it changes the
replica set.
"""

from __future__ import annotations

import asyncio
import collections
import io
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import soundfile as sf
from test_voice_routes import GOOD_CLIP

from server_helpers import REPO_ROOT, free_port, write_voice

pytestmark = pytest.mark.slow

RAY_PYTHON = REPO_ROOT / ".venv-ray" / "bin" / "python"
READY_LINE = re.compile(r"Ray Serve ready in ([\d.]+) s")
REPLICA_LINE = re.compile(r"replica (\w+) ready \(pid (\d+)\)")
DEMO_DIM = 32  # the demo checkpoint's x-vector width
QUEUED = 40  # TTS_RAY_MAX_QUEUED_REQUESTS of the fixture


def _ray_env_missing() -> str | None:
    if not RAY_PYTHON.exists():
        return ".venv-ray is absent: run scripts/setup_ray.sh (scripts/test.sh does)"
    check = subprocess.run([str(RAY_PYTHON), "-c", "import ray.serve"], capture_output=True, text=True)
    if check.returncode != 0:
        return f".venv-ray has no Ray Serve: {check.stderr.strip().splitlines()[-1:]}"
    return None


_missing = _ray_env_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)


def test_a_replica_that_cannot_start_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """Runs before the module's server starts (no second Ray cluster at once)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTS_", "RAY_"))}
    env.update(
        {
            "TTS_MODEL_PATH": str(tmp_path / "no-such-checkpoint"),
            "TTS_HOST": "127.0.0.1",
            "TTS_PORT": str(free_port()),
            "TTS_RAY_NUM_CPUS": "0.25",
            "TTS_RAY_DASHBOARD": "false",
        }
    )
    r = subprocess.run(
        [str(RAY_PYTHON), "-m", "tts_serve", "--replicas", "1"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 1
    (line,) = [line for line in (r.stdout + r.stderr).splitlines() if "startup failed:" in line]
    assert line.endswith(f"startup failed: TTS_MODEL_PATH='{tmp_path / 'no-such-checkpoint'}': "
                         f"{tmp_path / 'no-such-checkpoint'}: no such directory "
                         "(expected 'demo', a checkpoint directory or a hub id like Org/Name)")  # fmt: skip


@dataclass
class RayServer:
    proc: subprocess.Popen
    url: str
    log_path: Path
    profiles: Path
    startup_s: float

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def replicas(self) -> dict[str, int]:
        """Replica id -> pid, for every replica that has logged its start (dead ones included)."""
        return {rid: int(pid) for rid, pid in REPLICA_LINE.findall(self.log())}


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServer]:
    tmp = tmp_path_factory.mktemp("ray")
    profiles = tmp / "profiles"
    profiles.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTS_", "RAY_"))}
    env.update(
        {
            "TTS_HOST": "127.0.0.1",
            "TTS_PORT": str(port),
            "TTS_PROFILES_DIR": str(profiles),
            "TTS_DEMO_DIR": str(tmp / "demo"),
            "TTS_MAX_CONCURRENT": "1",
            "TTS_MAX_QUEUE": "1",
            "TTS_RAY_NUM_CPUS": "0.25",  # two replicas on a two-core machine
            "TTS_RAY_MAX_QUEUED_REQUESTS": str(QUEUED),
            "TTS_RAY_DASHBOARD": "false",
            "TTS_RAY_HEALTH_CHECK_PERIOD_S": "1",
            "TTS_DRAIN_TIMEOUT": "5",
            "TTS_VOICE_UPLOAD": "true",
            "PYTHONUNBUFFERED": "1",
        }
    )
    log_path = tmp / "serve.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(RAY_PYTHON), "-m", "tts_serve", "--replicas", "2"],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the Ray processes it starts go with it
        )
    server = RayServer(proc, f"http://127.0.0.1:{port}", log_path, profiles, 0.0)
    try:
        deadline = time.monotonic() + 240
        while not READY_LINE.search(server.log()):
            if proc.poll() is not None:
                raise RuntimeError(f"tts_serve exited with {proc.returncode}:\n{server.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tts_serve not ready in 240 s:\n{server.log()[-4000:]}")
            time.sleep(0.2)
        server.startup_s = time.monotonic() - t0
        print(f"\nstartup: {server.startup_s:.1f} s to 2 replicas ({READY_LINE.search(server.log())[0]})")
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # graceful: Serve drains the replicas, then Ray stops
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def _body(text: str = "hello there", frames: int = 8, **extra: object) -> dict[str, object]:
    return {"text": text, "speaker_id": "demo", "max_new_tokens": frames, "seed": 1, **extra}


def _replica(r: httpx.Response) -> str:
    return r.headers["x-replica-id"]


def _until_both(ray_server: RayServer, send, accept, want: set[str], tries: int = 200) -> dict[str, httpx.Response]:
    """Send requests until each replica in `want` has answered one that `accept` takes; returns one per replica."""
    seen: dict[str, httpx.Response] = {}
    for _ in range(tries):
        r = send()
        if accept(r):
            seen.setdefault(_replica(r), r)
        if want <= set(seen):
            return seen
    raise AssertionError(f"after {tries} requests only {sorted(seen)} of {sorted(want)} answered as expected")


def test_requests_spread_over_both_replicas(ray_server: RayServer) -> None:
    started = set(ray_server.replicas())
    assert len(started) == 2, ray_server.log()[-3000:]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=ray_server.url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/synthesize", json=_body(seed=i)) for i in range(40)))

    t0 = time.monotonic()
    responses = asyncio.run(run())
    elapsed = time.monotonic() - t0
    assert [r.status_code for r in responses] == [200] * 40, [r.text[:200] for r in responses if r.status_code != 200]
    per_replica = collections.Counter(_replica(r) for r in responses)
    print(f"\n40 requests in {elapsed:.1f} s, per replica: {dict(per_replica)}")
    assert set(per_replica) == started  # both served some
    assert min(per_replica.values()) >= 5  # least-loaded routing: neither replica is left nearly idle
    for r in responses:
        audio, rate = sf.read(io.BytesIO(r.content), dtype="float32")
        assert rate == 24000
        assert len(audio) / rate == pytest.approx(float(r.headers["x-audio-duration"]), abs=1e-3)
        assert 0 < len(audio) <= 8 * 1920  # at most 8 frames of 80 ms
    assert len({r.headers["x-request-id"] for r in responses}) == 40
    assert all(r.headers.get_list("x-request-id") == [r.headers["x-request-id"]] for r in responses)


def _whole_pcm(c: httpx.Client, frames: int) -> bytes:
    """The PCM of `_body(frames=frames)` as one file: what the same request streamed must carry."""
    r = c.post("/synthesize", json=_body(frames=frames, response_format="pcm"))
    assert r.status_code == 200
    return r.content


def test_streaming_through_the_proxy(ray_server: RayServer) -> None:
    with httpx.Client(base_url=ray_server.url, timeout=60) as c:
        whole = _whole_pcm(c, 40)
        with c.stream("POST", "/synthesize/stream", json=_body(frames=40, response_format="pcm")) as r:
            assert r.status_code == 200
            assert r.headers["transfer-encoding"] == "chunked"
            assert r.headers["x-sample-rate"] == "24000"
            pieces = [p for p in r.iter_raw() if p]
        # Same seed, same request: the stream carries the same samples as the whole file, in several pieces.
        assert len(pieces) >= 2
        assert b"".join(pieces) == whole

        with c.stream(
            "POST", "/v1/audio/speech", json={"model": "x", "input": "hello there", "voice": "demo", "seed": 1,
                                             "max_new_tokens": 20, "response_format": "pcm", "stream_format": "sse"}
        ) as r:  # fmt: skip
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert len(events) >= 2
        assert '"speech.audio.done"' in events[-1]


def test_errors_are_the_servers(ray_server: RayServer) -> None:
    with httpx.Client(base_url=ray_server.url, timeout=30) as c:
        r = c.post("/synthesize", json={"text": "", "speaker_id": "demo"})
        assert r.status_code == 422
        assert r.json()["error"]["param"] == "text"
        r = c.post("/synthesize", json=_body() | {"speaker_id": "nobody"})
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "unknown_speaker"
        r = c.post("/synthesize", json=_body() | {"unknown_field": 1})
        assert r.status_code == 422
        assert r.json()["error"]["param"] == "unknown_field"
        r = c.get("/ready")
        assert r.status_code == 200
        assert c.get("/health").json()["ready"] is True


def test_overload_is_refused_with_retry_after_never_a_hang(ray_server: RayServer) -> None:
    """Fill every replica and the proxy's queue, make sure the proxy has taken them all in, then send a burst.

    The proxy takes requests into its queue only as fast as it gets the CPU; on two cores busy with both
    replicas that can be seconds for the fill, so a fixed wait is not enough (CI once saw 19 of 20 burst
    requests admitted behind fill requests the proxy had not yet queued). Probes sent one at a time until the
    first refusal show the queue is full; the burst follows at once, while the long fill requests (60 frames,
    about 1.5 completions a second on the two replicas) still hold it.
    """
    capacity = 2 * 2 + QUEUED  # 2 replicas x (1 slot + 1 queued) + the proxy's queue
    burst = 20
    Timed = tuple[httpx.Response, float, float]  # response, sent, answered
    # Connections: the fill, the burst and the probes (one each 0.2 s for at most 60 s: 300).

    async def run() -> tuple[list[Timed], list[Timed], list[Timed]]:
        async with httpx.AsyncClient(
            base_url=ray_server.url, timeout=120, limits=httpx.Limits(max_connections=capacity + burst + 300)
        ) as c:

            async def timed(i: int, frames: int) -> Timed:
                t0 = time.monotonic()
                r = await c.post("/synthesize", json=_body(frames=frames, seed=i))
                return r, t0, time.monotonic()

            fill = [asyncio.create_task(timed(i, 60)) for i in range(capacity)]
            probes: list[asyncio.Task[Timed]] = []
            deadline = time.monotonic() + 60
            while not any(p.done() and p.result()[0].status_code == 429 for p in probes):
                assert time.monotonic() < deadline, f"no refusal after {len(probes)} probes in 60 s"
                probes.append(asyncio.create_task(timed(500 + len(probes), 8)))
                await asyncio.sleep(0.2)
            late = await asyncio.gather(*(timed(1000 + i, 8) for i in range(burst)))
            return list(await asyncio.gather(*fill)), list(await asyncio.gather(*probes)), late

    t0 = time.monotonic()
    filled, probed, late = asyncio.run(asyncio.wait_for(run(), timeout=240))
    elapsed = time.monotonic() - t0
    fill_codes = collections.Counter(r.status_code for r, _, _ in filled)
    probe_codes = collections.Counter(r.status_code for r, _, _ in probed)
    late_codes = collections.Counter(r.status_code for r, _, _ in late)
    everything = [*filled, *probed, *late]
    refused_s = sorted(end - sent for r, sent, end in everything if r.status_code == 429)
    print(
        f"\nfill {dict(fill_codes)}, probes {dict(probe_codes)}, burst {dict(late_codes)} "
        f"(refusals within {max(refused_s):.2f} s), {elapsed:.1f} s"
    )
    assert set(fill_codes) | set(probe_codes) | set(late_codes) <= {200, 429}, (fill_codes, probe_codes, late_codes)
    assert fill_codes[200] >= capacity - 10  # Serve may refuse a few more than strictly needed
    assert late_codes[429] >= burst // 2  # the queue was full; few fill requests finish while the burst arrives
    assert max(refused_s) < 10  # refused at once, not after waiting for room
    for r, _, _ in everything:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "server_overloaded"
            assert r.json()["request_id"]


def test_a_voice_in_the_shared_directory_is_served_by_both_replicas(ray_server: RayServer) -> None:
    both = set(list(ray_server.replicas())[:2])
    path = write_voice(ray_server.profiles, "shared_voice", DEMO_DIM, seed=3)
    with httpx.Client(base_url=ray_server.url, timeout=30) as c:

        def listed(r: httpx.Response) -> bool:
            return "shared_voice" in {s["id"] for s in r.json()["speakers"]}

        _until_both(ray_server, lambda: c.get("/speakers"), listed, both)
        body = _body() | {"speaker_id": "shared_voice"}
        _until_both(ray_server, lambda: c.post("/synthesize", json=body), lambda r: r.status_code == 200, both)

        path.unlink()
        _until_both(ray_server, lambda: c.get("/speakers"), lambda r: not listed(r), both)
        gone = _until_both(ray_server, lambda: c.post("/synthesize", json=body), lambda r: r.status_code == 404, both)
        assert all(r.json()["error"]["code"] == "unknown_speaker" for r in gone.values())


def test_a_voice_uploaded_through_one_replica_is_served_by_both(ray_server: RayServer) -> None:
    both = set(list(ray_server.replicas())[:2])
    with httpx.Client(base_url=ray_server.url, timeout=60) as c:
        up = c.post("/v1/audio/voices", data={"name": "uploaded"}, files={"audio_sample": ("me.wav", GOOD_CLIP)})
        assert up.status_code == 201, up.text
        t_up = time.monotonic()
        assert (ray_server.profiles / "uploaded.safetensors").is_file()

        def listed(r: httpx.Response) -> bool:
            return "uploaded" in {v["id"] for v in r.json()["data"]}

        _until_both(ray_server, lambda: c.get("/v1/audio/voices"), listed, both)
        body = _body() | {"speaker_id": "uploaded"}
        _until_both(ray_server, lambda: c.post("/synthesize", json=body), lambda r: r.status_code == 200, both)
        print(f"\nuploaded through {_replica(up)}: served by both within {time.monotonic() - t_up:.2f} s")

        gone = c.delete("/v1/audio/voices/uploaded")
        assert gone.status_code == 200, gone.text
        _until_both(ray_server, lambda: c.get("/v1/audio/voices"), lambda r: not listed(r), both)
        refused = _until_both(
            ray_server, lambda: c.post("/synthesize", json=body), lambda r: r.status_code == 404, both
        )
        assert all(r.json()["error"]["code"] == "unknown_speaker" for r in refused.values())


def test_killing_a_replica_under_load(ray_server: RayServer) -> None:
    before = ray_server.replicas()
    assert len(before) == 2
    killed: dict[str, float] = {}

    async def one(c: httpx.AsyncClient, i: int) -> tuple[str | None, int | None, str, float]:
        """(replica, status, outcome, end time): outcome 'complete', 'cut' (the body ended early) or 'error'."""
        try:
            async with c.stream("POST", "/synthesize/stream", json=_body(frames=60, seed=i)) as r:
                replica = r.headers.get("x-replica-id")
                if r.status_code == 200 and not killed and replica in before:
                    os.kill(before[replica], signal.SIGKILL)  # the first replica seen streaming dies
                    killed[replica] = time.monotonic()
                try:
                    data = b"".join([p async for p in r.aiter_raw()])
                except httpx.RemoteProtocolError:
                    return replica, r.status_code, "cut", time.monotonic()
                if r.status_code != 200:
                    assert r.headers["content-type"] == "application/json", data[:200]
                    return replica, r.status_code, "error", time.monotonic()
                assert len(data) % 4 == 0 and data
                return replica, 200, "complete", time.monotonic()
        except httpx.RemoteProtocolError:
            return None, None, "cut", time.monotonic()

    async def run() -> list[tuple[str | None, int | None, str, float]]:
        async with httpx.AsyncClient(base_url=ray_server.url, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(16)))

    results = asyncio.run(asyncio.wait_for(run(), timeout=150))
    assert killed, "no stream started"
    ((dead, t_kill),) = killed.items()
    survivor = next(r for r in before if r != dead)
    outcomes = collections.Counter((rep == dead, outcome) for rep, _, outcome, _ in results)
    print(f"\nkill under load: (on the killed replica, outcome) -> {dict(outcomes)}")
    for replica, status, outcome, end in results:
        if replica == dead and outcome == "complete":
            assert end < t_kill + 0.05, "a stream of the killed replica ended as a complete 200"
        if replica == survivor:
            assert (status, outcome) == (200, "complete")
        if outcome == "error":
            assert status in (500, 503)
    assert outcomes[(True, "cut")] >= 1  # the stream that saw the kill was cut, not ended cleanly
    assert sum(n for (on_dead, o), n in outcomes.items() if o == "complete" and not on_dead) >= 1

    # Serve replaces the dead replica; the new one serves.
    deadline = time.monotonic() + 120
    while not (new := set(ray_server.replicas()) - set(before)):
        assert time.monotonic() < deadline, ray_server.log()[-3000:]
        time.sleep(0.2)
    recovered = time.monotonic() - t_kill
    (new_id,) = new
    with httpx.Client(base_url=ray_server.url, timeout=30) as c:
        seen = _until_both(ray_server, lambda: c.post("/synthesize", json=_body()), lambda r: r.status_code == 200,
                           {survivor, new_id})  # fmt: skip
    serving = time.monotonic() - t_kill
    print(f"replacement {new_id} ready {recovered:.1f} s after the kill, serving within {serving:.1f} s")
    assert dead not in seen


def test_shutdown_drains_the_streams_in_flight(ray_server: RayServer) -> None:
    """SIGTERM (last test: it stops the server): a stream in flight finishes whole, then the process exits 0."""
    with httpx.Client(base_url=ray_server.url, timeout=60) as c:
        whole = _whole_pcm(c, 80)
        with c.stream("POST", "/synthesize/stream", json=_body(frames=80, response_format="pcm")) as r:
            assert r.status_code == 200
            pieces = r.iter_raw()
            first = next(pieces)
            ray_server.proc.send_signal(signal.SIGTERM)
            data = first + b"".join(pieces)
    assert data == whole
    assert ray_server.proc.wait(timeout=90) == 0
    assert "stopping: draining the replicas" in ray_server.log()
