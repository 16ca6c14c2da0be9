"""The WebSocket speech session (/v1/audio/speech/stream) as a voice agent uses it: text arriving as an LLM's word
pieces at --rates tokens a second, with --sessions sessions at once, each speaking one utterance.

Measured at the client, per (rate, sessions) level:
  ttfa      time from the first text fragment sent to the first audio received (p50, p95, max);
  stalls    each session's audio arrivals replayed against a player that starts at its first chunk (bench_gpu's
            continuity replay): the stall while text is still arriving (arrivals up to the end message) and in all,
            p95 and max over sessions, and the share of sessions with no stall while text arrives. Text slower than
            speech stalls any player: at 10 pieces a second about 2.5 words arrive a second, a speaking pace;
  errors    sessions that got an error event or no audio.

It runs against --url, or a server it starts (inference_server.py on a free port: --model, --backend, --device).
A CPU smoke run on the fake backend (sine tones, 10 ms a frame) takes seconds:

    python benchmarks/e2e/bench_ws.py --backend fake --rates 30,100 --sessions 1,4 --words 12
    python benchmarks/e2e/bench_ws.py --model /models/Qwen3-TTS-12Hz-1.7B-Base --device cuda --out ws.json
    python benchmarks/e2e/bench_ws.py --url ws://gpu-box:8090/v1/audio/speech/stream --voice alice --key $KEY
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

from bench_gpu import emit, free_port, log, ms_stats, pct, r1, stall_seconds  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402
from ws_client import Utterance, session_event, speak, word_pieces  # noqa: E402

TEXT = (
    "Sure, I can help with that. The quickest way is to take the northern road past the old mill, then turn left "
    "at the second bridge; from there it is about ten minutes on foot, and the station will be on your right. "
    "If you would rather avoid the hill, the bus from the square leaves every quarter of an hour."
)


def stall_while_text(u: Utterance) -> float:
    """The stall accumulated by arrivals up to the moment the text ended (what a listener hears while the LLM is
    still writing)."""
    return stall_seconds([(t, d) for t, d in u.arrivals if t <= u.text_ended_at])


def level_stats(rate: float, n: int, utterances: list[Utterance | BaseException], wall: float) -> dict:
    ok = [u for u in utterances if isinstance(u, Utterance) and u.arrivals and not u.errors]
    failed = len(utterances) - len(ok)
    ttfa = [u.time_to_first_audio for u in ok]
    during = [stall_while_text(u) for u in ok]
    total = [stall_seconds(u.arrivals) for u in ok]
    kinds = sorted({type(u).__name__ if isinstance(u, BaseException) else
                    (u.errors[0]["error"]["code"] if u.errors else "no_audio") for u in utterances
                    if not (isinstance(u, Utterance) and u in ok)})  # fmt: skip
    return {
        "rate_tokens_per_s": rate,
        "sessions": n,
        "ok": len(ok),
        "failed": failed,
        "failures": kinds,
        "wall_s": round(wall, 2),
        "audio_s": round(sum(sum(d for _, d in u.arrivals) for u in ok), 2),
        **ms_stats("ttfa", ttfa),
        **ms_stats("stall_while_text", during, (0.95,)),
        "zero_stall_while_text_share": round(sum(s == 0.0 for s in during) / len(during), 4) if during else None,
        "stall_total_p95_ms": r1(pct(total, 0.95), 1000),
    }


async def run_level(a: argparse.Namespace, rate: float, n: int, pieces: list[str]) -> dict:
    """n sessions, connected before the clock starts, each streaming `pieces` at `rate` a second."""
    headers = {"Authorization": f"Bearer {a.key}"} if a.key else None
    async with contextlib.AsyncExitStack() as stack:
        sockets = []
        for _ in range(n):
            ws = await stack.enter_async_context(connect(a.url, additional_headers=headers, max_size=2**24))
            await session_event(ws)
            sockets.append(ws)
        options = {"seed": 1, "max_new_tokens": a.max_frames}
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(speak(ws, a.voice, pieces, rate, options={**options, "seed": i}) for i, ws in enumerate(sockets)),
            return_exceptions=True,
        )
        wall = time.perf_counter() - t0
    return level_stats(rate, n, list(results), wall)


@contextlib.contextmanager
def started_server(a: argparse.Namespace):
    """inference_server.py on a free loopback port, its voices in a temporary folder (the demo voice where the model
    is `demo`); yields the WebSocket URL."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_")}
        env.update(
            TTS_HOST="127.0.0.1",
            TTS_PORT=str(port),
            TTS_MODEL_PATH=a.model,
            TTS_BACKEND=a.backend,
            TTS_DEVICE=a.device,
            TTS_PROFILES_DIR=a.profiles or str(Path(tmp) / "voices"),
            TTS_MAX_CONCURRENT=str(max(a.sessions)),
            TTS_MAX_QUEUE=str(max(a.sessions)),
            TTS_LOG_LEVEL="warning",
            # Every session of the benchmark comes from 127.0.0.1.
            TTS_WS_MAX_SESSIONS_PER_CLIENT=str(max(1024, max(a.sessions))),
            TTS_MAX_CONNECTIONS_PER_CLIENT="1024",
        )
        log_path = Path(tmp) / "server.log"
        with log_path.open("wb") as out:
            proc = subprocess.Popen([sys.executable, str(REPO / "inference_server.py")], cwd=REPO, env=env,
                                    stdout=out, stderr=out)  # fmt: skip
            try:
                wait_ready(f"http://127.0.0.1:{port}", proc, log_path, a.server_timeout)
                yield f"ws://127.0.0.1:{port}/v1/audio/speech/stream"
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def wait_ready(url: str, proc: subprocess.Popen, log_path: Path, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log_path.read_text()[-1500:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout:.0f} s: {log_path.read_text()[-1500:]}")


def table(rows: list[dict]) -> str:
    head = ["rate/s", "sessions", "ok", "TTFA p50", "p95", "max ms", "stall-while-text p95", "max ms", "no-stall"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        cells = [r["rate_tokens_per_s"], r["sessions"], f"{r['ok']}/{r['sessions']}", r["ttfa_p50_ms"],
                 r["ttfa_p95_ms"], r["ttfa_max_ms"], r["stall_while_text_p95_ms"], r["stall_while_text_max_ms"],
                 r["zero_stall_while_text_share"]]  # fmt: skip
        lines.append(" | ".join(str(c) for c in cells))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server's WebSocket URL (default: start one)")
    ap.add_argument("--key", default=os.environ.get("TTS_API_KEY"), help="API key (default: $TTS_API_KEY)")
    ap.add_argument("--voice", default="demo")
    ap.add_argument("--model", default="demo", help="for the server it starts: TTS_MODEL_PATH")
    ap.add_argument("--backend", default="native", help="for the server it starts: native, vllm-omni, fake")
    ap.add_argument("--device", default="auto", help="for the server it starts")
    ap.add_argument("--profiles", default=None, help="for the server it starts: TTS_PROFILES_DIR")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[10.0, 30.0, 100.0],
                    help="word pieces a second")  # fmt: skip
    ap.add_argument("--sessions", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--words", type=int, default=0, help="the first N words of the text only (0: all)")
    ap.add_argument("--max-frames", type=int, default=600, help="max_new_tokens of each utterance")
    ap.add_argument("--server-timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    return ap.parse_args(argv)


async def run_all(a: argparse.Namespace) -> list[dict]:
    text = " ".join(TEXT.split()[: a.words]) if a.words else TEXT
    pieces = word_pieces(text)
    log(f"{len(pieces)} word pieces of {len(text)} characters per utterance")
    rows = []
    for n in a.sessions:
        for rate in a.rates:
            row = await run_level(a, rate, n, pieces)
            emit(row)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse_args(argv)
    with contextlib.ExitStack() as stack:
        if a.url is None:
            a.url = stack.enter_context(started_server(a))
        rows = asyncio.run(run_all(a))
    print(table(rows))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "levels": rows}, indent=1, default=str))
    return rows


if __name__ == "__main__":
    main()
