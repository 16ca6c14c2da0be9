"""The vllm-omni backend beside the native engine, in one run, on the same weights and fixed length.

For each backend: start-up time, then for each concurrency level that many requests at once (end-of-speech held
off, so every request makes exactly --frames frames): per-stream x real time, aggregate audio-s/s, time to first
audio p50/p95, GPU memory (nvidia-smi, where there is one) after start-up and after each level. For vllm-omni also
vLLM-Omni's own per-stage metrics of each request (names as in 0.26 and 0.30): stage 0 (talker) and stage 1
(Code2Wav) generation time from their submit to their finish, and from them which stage the requests waited on:
`talker_share` = stage 0's time / the request's wall time. Near 1, Code2Wav kept up and the talker set the pace;
well below 1, audio kept coming after the talker had finished (Code2Wav behind). Prints a line per level as it
ends and a table last; the JSON (--json) is rewritten after every level, so a run cut short keeps what it measured.
Run it in the vLLM-Omni environment:

    python benchmarks/e2e/bench_vllm_omni.py --size tiny --stage-config stage_config_cpu.yaml --concurrency 1,4 --frames 50
    python benchmarks/e2e/bench_vllm_omni.py --size 1.7b --stage-config stage_config_optimized.yaml \\
        --concurrency 1,16,64 --frames 100 --json bench_out/vllm_omni.json     # on the GPU machine

On the GPU machine benchmarks/gpu/gpu_vllm_omni_bench.sh installs the carried wheels and runs it within one device call
(--time-budget-s: no level or backend is started once too little time is left).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from bench_engine import fixed_requests, pct  # the same requests and percentile as the native engine's bench

from qwen_tts.engine_api import FRAME_SAMPLES, Engine, EngineSettings
from qwen_tts.engines import create_engine
from qwen_tts.model.random_checkpoint import write_random_checkpoint

# Per-stage keys of vLLM-Omni's request metrics (`output.metrics["stage_metrics"][stage]`), the same in 0.26 and
# 0.30, and our short names: each stage's time from its submit to its finish, its mean time per output token
# (stage 0: per frame; vLLM fills it only when it tracks stats, else 0), its mean gap between outputs, its outputs.
STAGE_KEYS = {
    "stage_gen_time_ms": "gen_ms",
    "vllm_tpot_ms": "tpot_ms",
    "inter_output_latency_ms": "output_gap_ms",
    "num_tokens_out": "tokens",
}
TALKER_BOUND = 0.8  # talker_share at or above this: the talker set the pace


def log(*parts: object) -> None:
    print("[bench]", *parts, flush=True)


def gpu_memory() -> str | None:
    """'used MiB, total MiB' of each GPU from nvidia-smi, or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip().replace("\n", "; ") or None


def stage_summary(handles: list, frames: int) -> dict:
    """Means of vLLM-Omni's per-stage metrics over the requests that reported them, and which stage limited."""
    got = [(h, m) for h in handles if isinstance(m := getattr(h, "stage_metrics", None), dict) and m]
    out: dict = {"stage_metrics_requests": len(got)}
    for sid in ("0", "1"):
        for key, short in STAGE_KEYS.items():
            vals = [float(m[sid][key]) for _, m in got if isinstance(m.get(sid), dict) and (m[sid].get(key) or 0) > 0]
            if vals:
                out[f"stage{sid}_{short}_mean"] = round(statistics.mean(vals), 1)
    pairs = [
        (float(m["0"]["stage_gen_time_ms"]), 1000.0 * h.stats.wall_time)
        for h, m in got
        if isinstance(m.get("0"), dict) and m["0"].get("stage_gen_time_ms") and h.stats.wall_time
    ]
    if pairs:
        talker = statistics.mean(p[0] for p in pairs)
        wall = statistics.mean(p[1] for p in pairs)
        out["talker_ms_per_frame"] = round(talker / frames, 2)
        out["code2wav_tail_ms_mean"] = round(statistics.mean(w - t for t, w in pairs), 1)  # audio after the talker
        out["talker_share"] = round(talker / wall, 3)
        out["limited_by"] = "talker" if talker / wall >= TALKER_BOUND else "code2wav"
    return out


async def level(engine: Engine, n: int, frames: int, dim: int, greedy: bool) -> dict:
    reqs = fixed_requests(n, frames, dim, greedy)
    t0 = time.perf_counter()
    handles = [engine.submit(r) for r in reqs]
    audio = await asyncio.gather(*(h.collect() for h in handles))
    wall = time.perf_counter() - t0
    secs = [len(a) / 24000 for a in audio]
    ttfa = [h.stats.time_to_first_audio for h in handles if h.stats.time_to_first_audio is not None]
    out = {
        "concurrency": n,
        "wall_s": round(wall, 3),
        "audio_s": round(sum(secs), 3),
        "audio_s_per_s": round(sum(secs) / wall, 2),
        "xrt_per_stream": round(statistics.mean(s / h.stats.wall_time for s, h in zip(secs, handles, strict=True)), 3),
        "ttfa_p50_ms": round(1000 * pct(ttfa, 0.5), 1) if ttfa else None,
        "ttfa_p95_ms": round(1000 * pct(ttfa, 0.95), 1) if ttfa else None,
        "frames_per_request": sorted({h.stats.frames for h in handles}),
        "errors": sorted({h.stats.error for h in handles if h.stats.error}),
    }
    if out["frames_per_request"] != [frames]:  # recorded, not fatal: the other levels and backend still run
        log(f"c={n}: requests made {out['frames_per_request']} frames, not {frames}")
    if any(getattr(h, "stage_metrics", None) for h in handles):
        out.update(stage_summary(handles, frames))
    out["gpu_memory"] = gpu_memory()
    return out


async def run(
    engine: Engine, result: dict, levels: list[int], frames: int, greedy: bool, deadline: float, report
) -> None:
    t0 = time.perf_counter()
    try:
        await engine.start()
        result["startup_s"] = round(time.perf_counter() - t0, 1)
        result["gpu_memory_after_startup"] = gpu_memory()
        if getattr(engine, "_transport", None):  # vllm-omni: how the speaker vector travels (tensor = fast path)
            result["speaker_transport"] = engine._transport
        log(f"{result['backend']}: started in {result['startup_s']} s; GPU memory {result['gpu_memory_after_startup']}")
        report()
        for n in levels:
            left = deadline - time.monotonic()
            if left < 20 + n * 0.5:  # a level takes seconds; leave room to stop cleanly
                log(f"{result['backend']}: {left:.0f} s left, skipping c={n} and above")
                result["skipped"] = [c for c in levels if c >= n]
                break
            lv = await level(engine, n, frames, engine.xvector_dim, greedy)
            result["levels"].append(lv)
            log(f"{result['backend']}: {json.dumps(lv)}")
            report()
    finally:
        t1 = time.perf_counter()
        try:
            await engine.stop()
        finally:
            result["shutdown_s"] = round(time.perf_counter() - t1, 1)
            report()


def release_gpu(timeout_s: float = 30.0) -> None:
    """After a backend: free this process's cached GPU memory and wait (bounded) until the stage processes that
    vLLM-Omni spawned have given theirs back, so the next backend starts on an empty GPU."""
    gc.collect()
    if not torch.cuda.is_available():
        return
    torch.cuda.empty_cache()
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        free, total = torch.cuda.mem_get_info()
        if free >= 0.9 * total:
            return
        time.sleep(1.0)
    log(f"GPU memory still in use after {timeout_s:.0f} s: {gpu_memory()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "0.6b", "1.7b"])
    ap.add_argument("--model", help="an existing checkpoint directory instead of a random one")
    ap.add_argument("--tokenizer-dir", help="a real Qwen2 tokenizer for a full-size random checkpoint")
    ap.add_argument("--stage-config", default="stage_config_optimized.yaml")
    ap.add_argument("--device", default="auto", help="native engine device")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--sampling", action="store_true", help="sample (default: greedy)")
    ap.add_argument("--backends", default="native,vllm-omni", help="in this order")
    ap.add_argument("--time-budget-s", type=float, help="no level or backend starts past this many seconds")
    ap.add_argument("--json", help="write results here (rewritten after every level)")
    a = ap.parse_args()
    t_start = time.monotonic()
    deadline = t_start + (a.time_budget_s if a.time_budget_s else float("inf"))
    levels = [int(c) for c in a.concurrency.split(",")]
    backends = a.backends.split(",")
    tmp = None
    model = a.model
    if model is None:
        tmp = tempfile.TemporaryDirectory()
        t0 = time.monotonic()
        model = str(
            write_random_checkpoint(Path(tmp.name) / a.size, size=a.size, seed=0, tokenizer_dir=a.tokenizer_dir)
        )
        log(f"random {a.size} checkpoint written in {time.monotonic() - t0:.1f} s")
    results: list[dict] = []
    doc = {"frames": a.frames, "frame_s": FRAME_SAMPLES / 24000, "stage_config": a.stage_config, "results": results}

    def report() -> None:
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(doc, indent=2))

    slots = max(levels)
    for i, name in enumerate(backends):
        result: dict = {"backend": name, "levels": []}
        results.append(result)
        left = deadline - time.monotonic()
        if left < 60:
            log(f"{left:.0f} s left: not starting {name}")
            result["skipped"] = levels
            report()
            continue
        try:
            engine = create_engine(
                EngineSettings(
                    model_path=model,
                    backend=name,
                    device=a.device,
                    backend_options={"stage_config": Path(a.stage_config)},
                    max_slots=slots,
                    max_frames=4096,
                )
            )
            asyncio.run(run(engine, result, levels, a.frames, not a.sampling, deadline, report))
        except Exception as e:  # recorded; the next backend still runs
            result["error"] = f"{type(e).__name__}: {e}"
            log(f"{name} failed: {result['error']}")
            report()
        engine = None
        if i + 1 < len(backends):
            release_gpu()
    print(f"{'backend':10} {'c':>4} {'xRT/stream':>10} {'audio-s/s':>10} {'TTFA p50':>9} {'p95':>7}  start-up")
    for r in results:
        for lv in r["levels"]:
            print(
                f"{r['backend']:10} {lv['concurrency']:>4} {lv['xrt_per_stream']:>10} {lv['audio_s_per_s']:>10} "
                f"{lv['ttfa_p50_ms']:>8}ms {lv['ttfa_p95_ms']:>5}ms  {r.get('startup_s')} s"
                + (
                    f"  talker {lv['talker_ms_per_frame']} ms/frame, share {lv['talker_share']}: {lv['limited_by']}"
                    if "limited_by" in lv
                    else ""
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
