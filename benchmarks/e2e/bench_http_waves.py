"""Waves of streaming clients against the server with the fake engine: is the HTTP path's latency the server's?

Starts `inference_server.py` with TTS_BACKEND=fake (sine tones, 10 ms per frame, no model) in a subprocess, then
sends `--waves` waves of `--clients` concurrent POST /synthesize/stream requests of `--frames` frames each and
reports per wave the time to first audio (TTFA) p50/p95/max at the client and where it went: `pool` is the time
from the call to the request's headers going onto the wire (httpx: its connection pool, connecting included;
h11: connecting, in the first wave), `server` the engine's submit-to-first-audio that the server reports
(X-Time-To-First-Audio), `server_time_to_engine` the server's own time from each request's arrival to its submission
(tts_time_to_engine_seconds, as bucket bounds), plus the CPU seconds the client and the server spent in the wave.

    python benchmarks/e2e/bench_http_waves.py                         # httpx, one client shared by both waves
    python benchmarks/e2e/bench_http_waves.py --client httpx-fresh    # a new httpx client per wave
    python benchmarks/e2e/bench_http_waves.py --client h11            # plain h11 over asyncio, connections kept alive
    python benchmarks/e2e/bench_http_waves.py --client bench-gpu      # bench_gpu.py's HTTP level, once per wave

What it showed (2 cores, 64 clients of 100 frames): a second wave over one httpx client's kept-alive connections
waits ~300 ms in httpcore 1.0's pool (a burst of requests is handed the same idle connection and all but one retry,
pass after pass), the load generator's own cost; and a full garbage collection of the server's startup heap
stopped every stream for ~110 ms in whichever wave it fell (the server now freezes that heap: tts_server/heap.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))
from bench_gpu import HttpConn, free_port, http_level, pct, stream_body, time_to_engine  # noqa: E402  (the GPU benchmark's helpers and its HTTP level)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Record:
    __slots__ = ("called", "error", "first_audio", "on_wire", "server_ttfa")

    def __init__(self) -> None:
        self.called = time.perf_counter()
        self.on_wire: float | None = None
        self.first_audio: float | None = None
        self.server_ttfa: float | None = None
        self.error: str | None = None


def body(i: int, frames: int) -> dict:
    return stream_body(i, frames, greedy=False, voice="demo")


class HttpxClient:
    """httpx's AsyncClient, `fresh` for each wave or one for all of them."""

    def __init__(self, url: str, n: int, fresh: bool, keepalive_expiry: float):
        self.url, self.n, self.fresh, self.expiry = url, n, fresh, keepalive_expiry
        self.client: httpx.AsyncClient | None = None

    def _make(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.n, max_keepalive_connections=self.n, keepalive_expiry=self.expiry)
        return httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits)

    async def begin_wave(self) -> None:
        if self.client is None or self.fresh:
            if self.client is not None:
                await self.client.aclose()
            self.client = self._make()

    async def one(self, i: int, frames: int, rec: Record) -> None:
        async def trace(name: str, info: dict) -> None:
            if name == "http11.send_request_headers.started":
                rec.on_wire = time.perf_counter()

        assert self.client is not None
        try:
            req = self.client.build_request("POST", self.url + "/synthesize/stream", json=body(i, frames))
            req.extensions["trace"] = trace
            resp = await self.client.send(req, stream=True)
            try:
                if resp.status_code != 200:
                    rec.error = f"http_{resp.status_code}"
                    return
                rec.server_ttfa = float(resp.headers.get("x-time-to-first-audio", "nan"))
                async for piece in resp.aiter_raw():
                    if piece and rec.first_audio is None:
                        rec.first_audio = time.perf_counter()
            finally:
                await resp.aclose()
        except httpx.HTTPError as e:
            rec.error = type(e).__name__

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()


class H11Client:
    """A connection per stream, kept open across waves: h11 over asyncio streams, no pool in between."""

    def __init__(self, url: str, n: int):
        self.url = url
        self.conns: dict[int, HttpConn] = {}
        self.opened = 0  # connections opened in this wave

    async def begin_wave(self) -> None:
        self.opened = 0

    async def one(self, i: int, frames: int, rec: Record) -> None:
        if i not in self.conns:
            self.conns[i] = await HttpConn.open(self.url)
            self.opened += 1
        rec.on_wire = time.perf_counter()
        try:
            async for piece in self.conns[i].post_stream("/synthesize/stream", body(i, frames)):
                if isinstance(piece, bytes):
                    if piece and rec.first_audio is None:
                        rec.first_audio = time.perf_counter()
                    continue
                if piece.status_code != 200:
                    rec.error = f"http_{piece.status_code}"
                rec.server_ttfa = float(dict(piece.headers).get(b"x-time-to-first-audio", b"nan"))
        except ConnectionError:
            rec.error = "closed"

    async def close(self) -> None:
        for conn in self.conns.values():
            conn.close()


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


def summary(wave: int, recs: list[Record], wall: float, client_cpu: float, server_cpu: float) -> dict:
    ok = [r for r in recs if r.error is None and r.first_audio is not None]
    ttfa = [r.first_audio - r.called for r in ok]
    pool = [r.on_wire - r.called for r in ok if r.on_wire is not None]
    server = [r.server_ttfa for r in ok if r.server_ttfa is not None]
    errors: dict[str, int] = {}
    for r in recs:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "wave": wave,
        "ok": len(ok),
        "errors": errors,
        "ttfa_p50_ms": ms(pct(ttfa, 0.5)),
        "ttfa_p95_ms": ms(pct(ttfa, 0.95)),
        "ttfa_max_ms": ms(max(ttfa, default=None)),
        "pool_p50_ms": ms(pct(pool, 0.5)),
        "pool_p95_ms": ms(pct(pool, 0.95)),
        "server_ttfa_p50_ms": ms(pct(server, 0.5)),
        "server_ttfa_p95_ms": ms(pct(server, 0.95)),
        "wall_s": round(wall, 3),
        "client_cpu_s": round(client_cpu, 3),
        "server_cpu_s": round(server_cpu, 3),
    }


async def metrics_page(url: str) -> str:
    async with httpx.AsyncClient(timeout=10) as c:
        return (await c.get(url + "/metrics")).text


async def run_bench_gpu(a: argparse.Namespace, url: str, server_pid: int) -> list[dict]:
    """bench_gpu.py's own HTTP level (a new client per call), as its HTTP part runs it, once per wave."""
    out = []
    for wave in range(1, a.waves + 1):
        page = await metrics_page(url)
        c0, s0, t0 = time.process_time(), cpu_seconds(server_pid), time.perf_counter()
        r = await http_level(url, a.clients, a.frames, greedy=True)
        keys = (
            "ok",
            "errors",
            "audio_s",
            "ttfa_p50_ms",
            "ttfa_p95_ms",
            "ttfa_max_ms",
            "server_ttfa_p50_ms",
            "server_ttfa_p95_ms",
        )
        row = {"wave": wave, **{k: r[k] for k in keys}, "wall_s": round(time.perf_counter() - t0, 3)}
        row.update(client_cpu_s=round(time.process_time() - c0, 3), server_cpu_s=round(cpu_seconds(server_pid) - s0, 3))
        row["server_time_to_engine"] = time_to_engine(page, await metrics_page(url))
        print(json.dumps({"client": a.client, **row}), flush=True)
        out.append(row)
        await asyncio.sleep(a.pause)
    return out


async def run(a: argparse.Namespace, url: str, server_pid: int) -> list[dict]:
    if a.client == "bench-gpu":
        return await run_bench_gpu(a, url, server_pid)
    if a.client == "h11":
        client: HttpxClient | H11Client = H11Client(url, a.clients)
    else:
        client = HttpxClient(url, a.clients, a.client == "httpx-fresh", a.keepalive_expiry)
    out = []
    try:
        for wave in range(1, a.waves + 1):
            await client.begin_wave()
            page = await metrics_page(url)
            recs = [Record() for _ in range(a.clients)]
            c0, s0, t0 = time.process_time(), cpu_seconds(server_pid), time.perf_counter()
            for r in recs:
                r.called = t0
            await asyncio.gather(*(client.one(i, a.frames, r) for i, r in enumerate(recs)))
            wall = time.perf_counter() - t0
            row = summary(wave, recs, wall, time.process_time() - c0, cpu_seconds(server_pid) - s0)
            # the server's own time from each request's arrival to the engine (its clock: 0.5 ms buckets and up)
            row["server_time_to_engine"] = time_to_engine(page, await metrics_page(url))
            if isinstance(client, H11Client):
                row["connections_opened"] = client.opened
            print(json.dumps({"client": a.client, "started": round(time.time() - wall, 3), **row}), flush=True)
            out.append(row)
            await asyncio.sleep(a.pause)
    finally:
        await client.close()
    return out


async def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=5) as c:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if (await c.get(url + "/ready")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds between waves")
    ap.add_argument("--client", choices=("httpx", "httpx-fresh", "h11", "bench-gpu"), default="httpx")
    ap.add_argument("--keepalive-expiry", type=float, default=5.0, help="httpx's keepalive_expiry")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE", help="extra server settings")
    ap.add_argument("--server-log", type=Path, help="keep the server's log here")
    a = ap.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_")}
        env.update(
            TTS_BACKEND="fake",
            TTS_MODEL_PATH="demo",
            TTS_PROFILES_DIR=str(Path(tmp) / "profiles"),
            TTS_HOST="127.0.0.1",
            TTS_PORT=str(port),
            TTS_MAX_CONCURRENT=str(a.clients),
            TTS_MAX_QUEUE=str(a.clients),
            # Every client comes from 127.0.0.1: the per-client cap must not be what a wave measures. Room for the
            # /metrics reads between waves too: at the cap the server evicts a wave's idle kept-alive connection.
            TTS_MAX_CONNECTIONS_PER_CLIENT=str(max(a.clients + 8, 64)),
            TTS_LOG_LEVEL="warning",
        )
        env.update(kv.split("=", 1) for kv in a.server_env)
        if a.client == "bench-gpu":  # its requests name the voice "bench"; the fake engine's voices are 16 wide
            import torch

            from qwen_tts.voices import VoiceProfile, save_profile

            x = torch.randn(16, generator=torch.Generator().manual_seed(7))
            save_profile(Path(tmp) / "profiles" / "bench.safetensors", VoiceProfile(x_vector=x, model="fake"))
        log_path = a.server_log or Path(tmp) / "server.log"
        log = log_path.open("wb")
        proc = subprocess.Popen([sys.executable, str(REPO / "inference_server.py")], cwd=REPO, env=env,
                                stdout=log, stderr=log)  # fmt: skip
        try:
            asyncio.run(wait_ready(url, proc, 120))
            return asyncio.run(run(a, url, proc.pid))
        except Exception:
            log.flush()
            sys.stderr.write(log_path.read_text()[-3000:])
            raise
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


if __name__ == "__main__":
    main()
