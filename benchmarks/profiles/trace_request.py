"""One request's whole timeline through the engine, host threads and CUDA streams, and where its frames lose time.

Builds an engine on a random checkpoint, runs a few requests to warm it, then records one request under
torch.profiler (CPU and CUDA activity) and writes the Chrome trace (gzipped; chrome://tracing or Perfetto opens it).
`analyze` then reads the trace's events:
- frames: one per frame step, from one step's copy of its codes to the host to the next (the steps' stream is the
  one the engine thread's graph launches go to, the decoder's is every other stream with kernels);
- for each frame its kernels' busy time, the gaps on the steps' stream and how much of those gaps the decoder's
  kernels were running, and the longest gap with the kernel after it;
- per host thread the longest stretch between two CUDA runtime calls (a thread held up, say, by another's lock).
It prints the median frame, the slowest frames and the longest host stretches as JSON lines. This is how the
twenty-seventh round found the engine loop standing still ~3.3 ms every 12 frames behind the decoder's blocking
copy (docs/history/benchmarks-diary.md).

    V=one-stream
    python3 benchmarks/profiles/trace_request.py --size 0.6b --variant $V --out trace_0.6b.json.gz     # on the GPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # bench_gpu

from bench_gpu import TEXT, variant_engine

from qwen_tts.engine_api import SynthesisRequest
from qwen_tts.engines import create_engine
from qwen_tts.model.random_checkpoint import write_random_checkpoint

CODES_COPY = "Memcpy DtoH (Device -> Pinned)"  # each frame step's codes on their way to the host


def _span(e: dict) -> tuple[float, float]:
    return e["ts"], e["ts"] + e.get("dur", 0.0)


def _busy(intervals: list[tuple[float, float]], a: float, b: float) -> float:
    """Time within [a, b] covered by the (sorted, non-overlapping) intervals."""
    total = 0.0
    for s, f in intervals:
        if f <= a:
            continue
        if s >= b:
            break
        total += min(f, b) - max(s, a)
    return total


def analyze(events: list[dict], slowest: int = 5) -> dict:
    """Frames, their gaps and the host threads' longest stretches from a Chrome trace's events (times in us)."""
    runtime = sorted((e for e in events if e.get("cat") == "cuda_runtime"), key=lambda e: e["ts"])
    launches = Counter(e["tid"] for e in runtime if e["name"] == "cudaGraphLaunch")
    if not launches:
        raise ValueError("no CUDA graph launch in the trace: not a graphed engine on CUDA")
    engine_tid = launches.most_common(1)[0][0]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per_stream = Counter(e["args"]["stream"] for e in kernels)
    copies = sorted(
        (e for e in events if e.get("cat") == "gpu_memcpy" and e["name"] == CODES_COPY), key=lambda e: e["ts"]
    )
    if not copies:
        raise ValueError("no codes copy to pinned memory in the trace")
    steps_stream = Counter(e["args"]["stream"] for e in copies).most_common(1)[0][0]
    steps = [e for e in kernels if e["args"]["stream"] == steps_stream]
    other = sorted(_span(e) for e in kernels if e["args"]["stream"] != steps_stream)
    ends = [_span(e)[1] for e in copies if e["args"]["stream"] == steps_stream]
    frames = []
    for a, b in itertools.pairwise(ends):
        ks = [e for e in steps if a <= e["ts"] < b]
        prev, gaps, gaps_beside, longest = a, 0.0, 0.0, (0.0, "")
        for e in ks:
            s, f = _span(e)
            if s > prev:
                gaps += s - prev
                gaps_beside += _busy(other, prev, s)
                longest = max(longest, (s - prev, e["name"][:60]))
            prev = max(prev, f)
        frames.append(
            {
                "at_us": round(a - ends[0], 1),
                "frame_us": round(b - a, 1),
                "kernels": len(ks),
                "busy_us": round(sum(e.get("dur", 0.0) for e in ks), 1),
                "gaps_us": round(gaps, 1),
                "gaps_with_decoder_us": round(gaps_beside, 1),
                "decoder_us": round(_busy(other, a, b), 1),
                "longest_gap_us": round(longest[0], 1),
                "before": longest[1],
            }
        )
    stretches = []
    for tid in sorted({e["tid"] for e in runtime}, key=str):
        calls = [_span(e) for e in runtime if e["tid"] == tid]
        best = max(((s2 - f1, f1) for (_, f1), (s2, _) in itertools.pairwise(calls)), default=None)
        stretches.append(
            {
                "thread": str(tid),
                "engine_loop": tid == engine_tid,
                "runtime_calls": len(calls),
                "longest_without_a_call_us": round(best[0], 1) if best else None,
                "from_us": round(best[1] - ends[0], 1) if best else None,
            }
        )
    return {
        "steps_stream": steps_stream,
        "kernels_by_stream": dict(per_stream),
        "frames": len(frames),
        "median_frame_us": round(statistics.median(f["frame_us"] for f in frames), 1) if frames else None,
        "slowest": sorted(frames, key=lambda f: -f["frame_us"])[:slowest],
        "host_threads": stretches,
        "frame_list": frames,
    }


def _request(i: int, dim: int, frames: int) -> SynthesisRequest:
    x = torch.randn(dim, generator=torch.Generator().manual_seed(i))
    return SynthesisRequest(text=TEXT, xvector=x, seed=i, greedy=True, max_frames=frames, min_frames=frames + 1)


async def _timed(engine, i: int, frames: int) -> dict:
    t0 = time.perf_counter()
    handle = engine.submit(_request(i, engine.xvector_dim, frames))
    first, samples = None, 0
    async for chunk in handle:
        first = first if first is not None else time.perf_counter() - t0
        samples += chunk.shape[0]
    wall = time.perf_counter() - t0
    return {"x_real_time": round(samples / engine.sample_rate / wall, 2), "first_audio_ms": round(1000 * first, 1)}


async def trace(args: argparse.Namespace) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_random_checkpoint(Path(tmp) / args.size, size=args.size, seed=0)
        settings = variant_engine(
            args.variant,
            model_path=str(ckpt),
            device="cuda",
            max_slots=args.slots,
            max_frames=args.frames,
            max_text_tokens=256,
        )
        engine = create_engine(*settings)
        await engine.start()
        try:
            warm = [await _timed(engine, 100 + i, args.frames) for i in range(args.warm)]
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                traced = await _timed(engine, 7, args.frames)
        finally:
            await engine.stop()
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        events = json.loads(raw.read_text())["traceEvents"]
        if args.out:
            with raw.open("rb") as src, gzip.open(args.out, "wb") as dst:
                shutil.copyfileobj(src, dst)
    out = analyze(events, args.slowest)
    return {"size": args.size, "variant": args.variant, "warm": warm, "traced": traced, **out}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.6b", help="random checkpoint size: tiny, 0.6b or 1.7b")
    ap.add_argument("--variant", default="", help="engine settings by bench_gpu.py's variant names, joined by '+'")
    ap.add_argument("--slots", type=int, default=1, help="the engine's max_slots (bench_gpu: the concurrency)")
    ap.add_argument("--frames", type=int, default=100, help="frames of each request (end-of-speech held off)")
    ap.add_argument("--warm", type=int, default=3, help="requests before the traced one")
    ap.add_argument("--slowest", type=int, default=5, help="slowest frames to print")
    ap.add_argument("--out", default="", help="where the gzipped Chrome trace goes (none if empty)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("trace_request.py needs CUDA: it traces the graphed engine's streams")
    res = asyncio.run(trace(args))
    for key in ("size", "variant", "warm", "traced", "steps_stream", "kernels_by_stream", "frames", "median_frame_us"):
        print(json.dumps({key: res[key]}), flush=True)
    for f in res["slowest"]:
        print(json.dumps({"slow_frame": f}), flush=True)
    for t in res["host_threads"]:
        print(json.dumps({"host_thread": t}), flush=True)
    return res


if __name__ == "__main__":
    main()
