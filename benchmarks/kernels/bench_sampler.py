"""The frame step's sampler alone, on CUDA: the sort-free Triton kernel (qwen_tts/fastpath/sample_kernel.py) at several
warp sizes against the compiled `sampling.sample` it replaces, at the code predictor's (2048) and the talker's
(3072) vocab, graphed as the frame step runs them (16 draws a frame).

For each vocab, batch and variant it captures 16 calls into a CUDA graph, replays it back to back (CUDA events)
and reports microseconds per draw (`--scales`: flatter or more peaked rows); it checks that every variant draws
what `sampling.sample` draws (top-k rows, the Qwen3-TTS default top_p 1). Prints a table last, writes JSON.

    python3 benchmarks/kernels/bench_sampler.py --batches 2,64,256 --warp-elements 256,512,1024,2048 --out sampler.json
    python3 benchmarks/kernels/bench_sampler.py --batches 1,64 --warp-elements 512 --scales 1,3
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from bench_attention import time_calls  # this script's directory is on sys.path when run

from qwen_tts.fastpath import fused, sample_kernel
from qwen_tts.model import sampling

DRAWS = 16  # one frame: codebook 0 and 15 residual codes


def graph_us(run, iters: int) -> float:
    """Microseconds per draw of `run` (DRAWS draws), graphed and replayed back to back (bench_attention's timer)."""
    return time_calls(run, "cuda", iters) * 1e6 / DRAWS


def draws(fn, *args):
    """A frame's DRAWS calls of fn(*args)."""
    return lambda: [fn(*args) for _ in range(DRAWS)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="2,64,256")
    ap.add_argument("--vocabs", default="2048,3072")
    ap.add_argument("--warp-elements", default="256,512,1024,2048")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument(
        "--scales", default="3", help="the logits' standard deviations (flatter rows: more draws outside top-k)"
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sampler: needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    compiled = fused.compiled("sample")
    rows = []
    for vocab, batch, scale in itertools.product(
        map(int, args.vocabs.split(",")), map(int, args.batches.split(",")), map(float, args.scales.split(","))
    ):
        logits = torch.randn(batch, vocab, device="cuda", generator=g) * scale
        temp = torch.full((batch,), 0.9, device="cuda")
        top_k = torch.full((batch,), 50, device="cuda", dtype=torch.long)
        top_p = torch.ones(batch, device="cuda")
        greedy = torch.zeros(batch, device="cuda", dtype=torch.bool)
        seeds = torch.arange(batch, device="cuda")
        counters = torch.zeros(batch, device="cuda", dtype=torch.long)
        settings = (temp, top_k, top_p, greedy, seeds, counters)
        want = sampling.sample(logits, *settings)
        us = graph_us(draws(compiled, logits, *settings), args.iters)
        base = {"vocab": vocab, "batch": batch, "scale": scale}
        rows.append({**base, "sampler": "compiled", "us_per_draw": round(us, 2)})
        print(json.dumps(rows[-1]), flush=True)
        for we in map(int, args.warp_elements.split(",")):
            kernel = functools.partial(sample_kernel.sample, warp_elements=we)
            got = kernel(logits, *settings)
            same = bool(torch.equal(got, want))
            us = graph_us(draws(kernel, logits, *settings), args.iters)
            name = f"kernel/{we}"
            rows.append({**base, "sampler": name, "warps": sample_kernel.num_warps(vocab, we),
                         "us_per_draw": round(us, 2), "same_draws": same})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    print("| vocab | batch | logit sd | sampler | warps | us/draw | same draws |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['vocab']} | {r['batch']} | {r['scale']} | {r['sampler']} | {r.get('warps', '')} | "
              f"{r['us_per_draw']} | {r.get('same_draws', '')} |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
