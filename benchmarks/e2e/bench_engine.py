"""Engine throughput and latency at a fixed generated length (end-of-speech held off).

Writes a random checkpoint of the chosen size (or uses --model), then for each concurrency level submits that many
requests at once and reports time to first audio (p50/p95), per-request xRT, aggregate audio-s/s and the
talker step time. Prints a table last and writes JSON.

    python benchmarks/e2e/bench_engine.py --size tiny --concurrency 1,8 --frames 50
    python benchmarks/e2e/bench_engine.py --size 1.7b --device cuda --concurrency 1,8,32 --frames 100 --json out.json

On CUDA the engine replays CUDA graphs of the frame step (--no-cuda-graphs: eager). --verify first checks on these
weights that graphs and the eager path give identical codes; --eager-frames N then also times the eager path at N
frames per request. The eager path is a second engine on the same checkpoint (FastPath.frame_step="eager");
everything goes through the factory and the engine interface.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from qwen_tts.engine_api import Engine, EngineSettings, SynthesisRequest
from qwen_tts.engines import create_engine
from qwen_tts.fastpath.options import FastPath
from qwen_tts.model.random_checkpoint import write_random_checkpoint

TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello world, this is a test of speech synthesis for "
    "many voices. The quick brown fox jumps over the lazy dog."
)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def fixed_requests(n: int, frames: int, dim: int, greedy: bool) -> list[SynthesisRequest]:
    """`n` requests of exactly `frames` frames each (end-of-speech masked: every request does the same work)."""
    return [
        SynthesisRequest(
            text=TEXT,
            xvector=torch.randn(dim, generator=torch.Generator().manual_seed(i)),
            seed=i,
            greedy=greedy,
            max_frames=frames,
            min_frames=frames + 1,
        )
        for i in range(n)
    ]


async def one_level(engine: Engine, n: int, frames: int, dim: int, greedy: bool) -> dict:
    before = dict(engine.timings)
    reqs = fixed_requests(n, frames, dim, greedy)
    t0 = time.perf_counter()
    handles = [engine.submit(r) for r in reqs]
    audio = await asyncio.gather(*(h.collect() for h in handles))
    wall = time.perf_counter() - t0
    ttfa = [h.stats.time_to_first_audio for h in handles]
    audio_s = sum(a.shape[0] for a in audio) / engine.sample_rate
    per_req = [h.stats.audio_seconds / h.stats.wall_time for h in handles]
    return {
        "concurrency": n,
        "frames": frames,
        "wall_s": round(wall, 3),
        "audio_s": round(audio_s, 2),
        "audio_s_per_s": round(audio_s / wall, 2),
        "xrt_per_request_median": round(statistics.median(per_req), 3),
        "ttfa_p50_ms": round(1000 * pct(ttfa, 0.5), 1),
        "ttfa_p95_ms": round(1000 * pct(ttfa, 0.95), 1),
        "ms_per_frame_step": round(1000 * wall / frames, 2),
        **phase_times(before, engine.timings, n),
    }


def phase_times(before: dict, after: dict, n: int) -> dict:
    """Worker time per batched step (generation, Code2Wav decode) and prefill per request, in ms."""
    d = {k: after[k] - before[k] for k in after}
    steps = max(1, d["steps"])
    return {
        "gen_ms_per_step": round(1000 * d["step_s"] / steps, 2),
        "decode_ms_per_step": round(1000 * d["decode_s"] / steps, 2),
        "prefill_ms_per_req": round(1000 * d["prefill_s"] / n, 1),
    }


async def codes_of_run(engine: Engine, reqs: list[SynthesisRequest]) -> list[torch.Tensor]:
    handles = [engine.submit(r) for r in reqs]
    await asyncio.gather(*(h.collect() for h in handles))
    return [torch.cat(h.codes) if h.codes else torch.zeros(0, 16, dtype=torch.long) for h in handles]


async def verify(engine: Engine, eager_engine: Engine, dim: int, frames: int = 24) -> dict:
    """Graphs vs the eager path (same checkpoint), and a request alone vs in a batch, on codes."""

    def reqs() -> list[SynthesisRequest]:
        xs = [torch.randn(dim, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        kw = dict(max_frames=frames, return_codes=True)
        return [
            SynthesisRequest(text=TEXT, xvector=xs[0], seed=1, greedy=True, min_frames=frames + 1, **kw),
            SynthesisRequest(text=TEXT[:60], xvector=xs[1], seed=2, min_frames=frames + 1, **kw),
            SynthesisRequest(text=TEXT[:30], xvector=xs[2], seed=3, **kw),  # may end by EOS
        ]

    graphed = await codes_of_run(engine, reqs())
    alone = [(await codes_of_run(engine, [r]))[0] for r in reqs()[:2]]
    eager = await codes_of_run(eager_engine, reqs())
    out = {
        "frames_per_request": [c.shape[0] for c in graphed],
        "graphs_equal_eager": [
            c.shape == e.shape and bool(torch.equal(c, e)) for c, e in zip(graphed, eager, strict=True)
        ],
        "alone_equal_batched": [bool(torch.equal(a, g)) for a, g in zip(alone, graphed[:2], strict=True)],
    }
    for c, e in zip(graphed, eager, strict=True):
        if c.shape == e.shape and not torch.equal(c, e):
            out.setdefault("first_diff_frame", []).append(int((c != e).any(1).nonzero()[0]))
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=["tiny", "0.6b", "1.7b"])
    ap.add_argument("--model", help="an existing checkpoint directory instead of a random one")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--frames", type=int, default=50)
    ap.add_argument("--first-chunk", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=12)
    ap.add_argument("--sampling", action="store_true", help="sample (default: greedy)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-cuda-graphs", action="store_true", help="eager frame steps on CUDA")
    ap.add_argument("--no-fused", action="store_true", help="the eager kernels instead of the fused decode path")
    ap.add_argument("--decoder-tf32", action="store_true", help="TF32 convolutions in Code2Wav")
    ap.add_argument("--inline-decode", action="store_true", help="Code2Wav in the engine loop, not its own thread")
    ap.add_argument("--no-decode-graphs", action="store_true", help="Code2Wav eager on CUDA")
    ap.add_argument("--verify", action="store_true", help="first compare graphs with eager on codes")
    ap.add_argument("--eager-frames", type=int, default=0, help="also time the eager path at this many frames")
    ap.add_argument("--json", help="write results here")
    a = ap.parse_args()

    levels = [int(x) for x in a.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = Path(a.model) if a.model else write_random_checkpoint(Path(tmp) / a.size, size=a.size, seed=0)
        t_write = time.perf_counter() - t0
        settings = EngineSettings(
            model_path=str(path),
            device=a.device,
            dtype=a.dtype,
            max_slots=max(levels),
            max_queue=0,
            max_frames=a.frames,
            max_text_tokens=256,
            first_chunk_frames=a.first_chunk,
            chunk_frames=a.chunk,
            decoder_tf32=a.decoder_tf32,
        )
        fast = FastPath(
            frame_step="eager" if a.no_cuda_graphs else "auto",
            fused_kernels=not a.no_fused,
            decode_thread=not a.inline_decode,
            decode_graphs=not a.no_decode_graphs,
        )
        t0 = time.perf_counter()
        engine = create_engine(settings, fast)
        await engine.start()
        t_load = time.perf_counter() - t0
        print(f"checkpoint {a.size}: write {t_write:.1f}s, load+warmup {t_load:.1f}s, {engine.model_info}", flush=True)
        graphs = bool(engine.model_info.get("cuda_graphs"))
        eager_engine = None
        if graphs and (a.verify or a.eager_frames):  # the eager path: a second engine on the same checkpoint
            eager_engine = create_engine(settings, dataclasses.replace(fast, frame_step="eager"))
            await eager_engine.start()
        checks = None
        if a.verify and eager_engine is not None:
            checks = await verify(engine, eager_engine, engine.xvector_dim)
            print("verify:", json.dumps(checks), flush=True)
        results = []
        for n in levels:
            await one_level(engine, n, min(a.frames, 8), engine.xvector_dim, not a.sampling)  # warm this batch size
            best = None
            for _ in range(a.repeats):
                r = await one_level(engine, n, a.frames, engine.xvector_dim, not a.sampling)
                if best is None or r["audio_s_per_s"] > best["audio_s_per_s"]:
                    best = r
            print(json.dumps(best), flush=True)
            results.append({"mode": "graphs" if graphs else "eager", **best})
        if a.eager_frames and eager_engine is not None:
            for n in levels:
                await one_level(eager_engine, n, min(a.eager_frames, 8), engine.xvector_dim, not a.sampling)
                r = await one_level(eager_engine, n, a.eager_frames, engine.xvector_dim, not a.sampling)
                print(json.dumps(r), flush=True)
                results.append({"mode": "eager", **r})
        if eager_engine is not None:
            await eager_engine.stop()
        await engine.stop()
    cols = list(results[0])
    print("\n| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if a.json:
        out = {"args": vars(a), "info": engine.model_info, "load_s": t_load, "verify": checks, "results": results}
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
