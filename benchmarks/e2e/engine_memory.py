"""Device memory an engine takes and leaves behind: build, run one request, stop and free it, several times in one
process, as a server's engine restarts do.

For each engine it reports the memory allocated once started and after its request, whether the engine object was
collected after `stop`, what stayed allocated once it was (with the garbage collector run and the allocator's cache
emptied), and what stayed after `qwen_tts.engines.release_device_memory` (the CUDA libraries' per-stream
workspaces handed back). One JSON line per engine, then a summary line. On a CPU the memory fields are null; the
collection check still runs.

    V=one-stream
    python3 benchmarks/e2e/engine_memory.py --size 0.6b --variant $V     # on the GPU machine (random full-size weights)
    python3 benchmarks/e2e/engine_memory.py --size tiny --device cpu     # anywhere
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import variant_engine

from qwen_tts.engine_api import EngineSettings, SynthesisRequest
from qwen_tts.engines import create_engine, release_device_memory
from qwen_tts.fastpath.options import FastPath
from qwen_tts.model.random_checkpoint import write_random_checkpoint

GIB = 1024**3
TEXT = "The quick brown fox jumps over the lazy dog."


def allocated(device: str) -> float | None:
    """GiB the caching allocator holds in tensors now (None off CUDA)."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    return round(torch.cuda.memory_allocated() / GIB, 3)


async def one_engine(settings: tuple[EngineSettings, FastPath], frames: int) -> tuple[dict, weakref.ref]:
    engine = create_engine(*settings)
    await engine.start()
    out = {"started_gib": allocated(settings[0].device)}
    try:
        handle = engine.submit(
            SynthesisRequest(text=TEXT, xvector=torch.randn(engine.xvector_dim), seed=1, greedy=True, max_frames=frames)
        )
        await handle.collect()
        out["after_request_gib"] = allocated(settings[0].device)
    finally:
        await engine.stop()
    return out, weakref.ref(engine)


async def run(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_random_checkpoint(Path(tmp) / args.size, size=args.size, seed=0)
        settings = variant_engine(
            args.variant,
            model_path=str(ckpt),
            device=args.device,
            max_slots=args.slots,
            max_frames=args.frames,
            max_text_tokens=256,
        )
        records = []
        for i in range(args.engines):
            rec, ref = await one_engine(settings, args.frames)
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            rec = {"engine": i, **rec, "collected": ref() is None, "left_gib": allocated(args.device)}
            release_device_memory()
            rec["left_after_release_gib"] = allocated(args.device)
            print(json.dumps(rec), flush=True)
            records.append(rec)
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.6b", help="random checkpoint size: tiny, 0.6b or 1.7b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variant", default="", help="engine settings by bench_gpu.py's variant names, joined by '+'")
    ap.add_argument("--engines", type=int, default=2, help="engines built and freed one after another")
    ap.add_argument("--slots", type=int, default=4, help="the engines' max_slots")
    ap.add_argument("--frames", type=int, default=24, help="frames of the one request each engine runs")
    args = ap.parse_args(argv)
    records = asyncio.run(run(args))
    summary = {
        "size": args.size,
        "variant": args.variant,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "all_collected": all(r["collected"] for r in records),
        "most_left_gib": max((r["left_gib"] or 0.0) for r in records) if records else None,
    }
    print(json.dumps(summary), flush=True)
    return records


if __name__ == "__main__":
    main()
