"""The vllm-omni backend beside the native engine, in one run, on the same weights and fixed length.

For each backend: start-up time, then for each concurrency level that many requests at once (end-of-speech held
off, so every request makes exactly --frames frames): per-stream x real time, aggregate audio-s/s, time to first
audio p50/p95; for vllm-omni also the mean per-stage generation time from vLLM-Omni's own stage metrics (which
stage limits throughput). Prints a table and writes JSON. Run it in the vLLM-Omni environment:

    python benchmarks/bench_vllm_omni.py --size tiny --stage-config stage_config_cpu.yaml --concurrency 1,4 --frames 50
    python benchmarks/bench_vllm_omni.py --size 1.7b --stage-config stage_config_optimized.yaml \\
        --concurrency 1,16,64 --frames 100 --json bench_out/vllm_omni.json     # on the GPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from bench_engine import TEXT, pct  # the same text and percentile as the native engine's bench

from qwen_tts.engine_api import FRAME_SAMPLES, Engine, EngineSettings, SynthesisRequest
from qwen_tts.engines import create_engine
from qwen_tts.random_checkpoint import write_random_checkpoint


async def level(engine: Engine, n: int, frames: int, dim: int, greedy: bool) -> dict:
    reqs = [
        SynthesisRequest(
            text=TEXT,
            xvector=torch.randn(dim, generator=torch.Generator().manual_seed(i)),
            seed=i,
            greedy=greedy,
            max_frames=frames,
            min_frames=frames + 1,  # end-of-speech masked: every request does the same work
        )
        for i in range(n)
    ]
    t0 = time.perf_counter()
    handles = [engine.submit(r) for r in reqs]
    audio = await asyncio.gather(*(h.collect() for h in handles))
    wall = time.perf_counter() - t0
    secs = [len(a) / 24000 for a in audio]
    assert all(h.stats.frames == frames for h in handles), [h.stats.frames for h in handles]
    ttfa = [h.stats.time_to_first_audio for h in handles]
    out = {
        "concurrency": n,
        "wall_s": round(wall, 3),
        "audio_s": round(sum(secs), 3),
        "audio_s_per_s": round(sum(secs) / wall, 2),
        "xrt_per_stream": round(statistics.mean(s / h.stats.wall_time for s, h in zip(secs, handles, strict=True)), 3),
        "ttfa_p50_ms": round(1000 * pct(ttfa, 0.5), 1),
        "ttfa_p95_ms": round(1000 * pct(ttfa, 0.95), 1),
    }
    stage = [getattr(h, "stage_metrics", None) for h in handles]
    if all(stage):
        for sid in ("0", "1"):
            times = [m[sid]["stage_gen_time_ms"] for m in stage if sid in m]
            if times:
                out[f"stage{sid}_gen_ms_mean"] = round(statistics.mean(times), 1)
    return out


async def run(name: str, engine: Engine, levels: list[int], frames: int, greedy: bool) -> dict:
    t0 = time.perf_counter()
    await engine.start()
    startup = time.perf_counter() - t0
    try:
        results = [await level(engine, n, frames, engine.xvector_dim, greedy) for n in levels]
    finally:
        await engine.stop()
    return {"backend": name, "startup_s": round(startup, 1), "levels": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "0.6b", "1.7b"])
    ap.add_argument("--model", help="an existing checkpoint directory instead of a random one")
    ap.add_argument("--stage-config", default="stage_config_optimized.yaml")
    ap.add_argument("--device", default="auto", help="native engine device")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--sampling", action="store_true", help="sample (default: greedy)")
    ap.add_argument("--backends", default="native,vllm-omni")
    ap.add_argument("--json", help="write results here")
    a = ap.parse_args()
    levels = [int(c) for c in a.concurrency.split(",")]
    tmp = None
    model = a.model
    if model is None:
        tmp = tempfile.TemporaryDirectory()
        model = str(write_random_checkpoint(Path(tmp.name) / a.size, size=a.size, seed=0))
    slots = max(levels)
    results = []
    for name in a.backends.split(","):
        engine = create_engine(
            EngineSettings(
                model_path=model,
                backend=name,
                device=a.device,
                stage_config=Path(a.stage_config),
                max_slots=slots,
                max_frames=4096,
            )
        )
        results.append(asyncio.run(run(name, engine, levels, a.frames, not a.sampling)))
    print(f"{'backend':10} {'c':>4} {'xRT/stream':>10} {'audio-s/s':>10} {'TTFA p50':>9} {'p95':>7}  start-up")
    for r in results:
        for lv in r["levels"]:
            print(
                f"{r['backend']:10} {lv['concurrency']:>4} {lv['xrt_per_stream']:>10} {lv['audio_s_per_s']:>10} "
                f"{lv['ttfa_p50_ms']:>8}ms {lv['ttfa_p95_ms']:>5}ms  {r['startup_s']} s"
                + (f"  stage0 {lv['stage0_gen_ms_mean']} ms" if "stage0_gen_ms_mean" in lv else "")
            )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(
            json.dumps({"frames": a.frames, "frame_s": FRAME_SAMPLES / 24000, "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
