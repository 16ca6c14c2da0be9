"""Is a request's output independent of what runs beside it? And what does batch-invariant decode cost?

For each of --trials seeds, one request runs alone, then the same request runs batched with --others others
(different voices, texts and seeds). Reports whether the codes are identical and how the int16 audio differs
(samples differing, largest difference in LSB), with the default batched Code2Wav decode and with
batch_invariant_decode; then the decode time and throughput of --load concurrent requests in both modes.

    python benchmarks/bench_determinism.py --size tiny
    python benchmarks/bench_determinism.py --size 1.7b --device cuda --load 32 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from qwen_tts.engine_api import EngineSettings, SynthesisRequest
from qwen_tts.engines.native import NativeEngine
from qwen_tts.model.random_checkpoint import write_random_checkpoint

TEXTS = [
    "The same request, alone and in company.",
    "Another voice says something else entirely, at its own length.",
    "A third one, shorter.",
    "And a fourth request that runs beside the first for a while, then leaves.",
]


def to_int16(x: np.ndarray) -> np.ndarray:
    return np.round(np.clip(x, -1.0, 1.0) * 32767.0).astype(np.int16)


def request(dim: int, i: int, seed: int, frames: int) -> SynthesisRequest:
    x = torch.randn(dim, generator=torch.Generator().manual_seed(1000 + i))
    return SynthesisRequest(
        text=TEXTS[i % len(TEXTS)], xvector=x, seed=seed + i, max_frames=frames, min_frames=frames, return_codes=True
    )


async def compare(engine: NativeEngine, trials: int, others: int, frames: int) -> dict:
    dim = engine.xvector_dim
    same_codes, differing, total, worst = 0, 0, 0, 0
    for t in range(trials):
        alone = engine.submit(request(dim, 0, 100 * t, frames))
        a = await alone.collect()
        batch = [engine.submit(request(dim, i, 100 * t, frames)) for i in range(others + 1)]
        outs = await asyncio.gather(*(h.collect() for h in batch))
        same_codes += bool(torch.equal(torch.cat(alone.codes), torch.cat(batch[0].codes)))
        diff = np.abs(to_int16(a).astype(np.int32) - to_int16(outs[0]).astype(np.int32))
        differing += int((diff > 0).sum())
        total += diff.size
        worst = max(worst, int(diff.max()))
    return {"trials": trials, "codes_identical": same_codes, "samples_differing": differing, "samples": total,
            "max_lsb": worst}  # fmt: skip


async def load(engine: NativeEngine, n: int, frames: int) -> dict:
    dim = engine.xvector_dim
    before = dict(engine.timings)
    t0 = time.perf_counter()
    handles = [engine.submit(request(dim, i, 7, frames)) for i in range(n)]
    audio = await asyncio.gather(*(h.collect() for h in handles))
    wall = time.perf_counter() - t0
    seconds = sum(a.shape[0] for a in audio) / 24000
    return {
        "wall_s": wall,
        "audio_s_per_s": seconds / wall,
        "decode_s": engine.timings["decode_s"] - before["decode_s"],
    }


async def run(args: argparse.Namespace, model_path: Path) -> dict:
    results = {}
    for invariant in (False, True):
        cfg = EngineSettings(model_path=str(model_path), device=args.device, max_slots=max(args.load, args.others + 1),
                           batch_invariant_decode=invariant)  # fmt: skip
        engine = NativeEngine(cfg)
        await engine.start()
        try:
            results["invariant" if invariant else "batched"] = {
                **await compare(engine, args.trials, args.others, args.frames),
                **await load(engine, args.load, args.frames),
            }
        finally:
            await engine.stop()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="tiny", help="random checkpoint size (tiny, 0.6b, 1.7b) when no --model")
    p.add_argument("--model", type=Path, help="an existing checkpoint directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--others", type=int, default=3)
    p.add_argument("--frames", type=int, default=48)
    p.add_argument("--load", type=int, default=8)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or write_random_checkpoint(Path(tmp) / args.size, size=args.size, seed=0)
        results = asyncio.run(run(args, path))
    print(
        f"{'decode':<10} {'codes same':>10} {'samples differing':>18} {'max LSB':>8} {'decode s':>9} {'audio-s/s':>10}"
    )
    for name, r in results.items():
        share = f"{r['samples_differing']}/{r['samples']}"
        print(f"{name:<10} {r['codes_identical']:>5}/{r['trials']:<4} {share:>18} {r['max_lsb']:>8} "
              f"{r['decode_s']:>9.3f} {r['audio_s_per_s']:>10.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
