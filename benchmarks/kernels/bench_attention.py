"""The one-token attention kernels alone, on CUDA: the one-program-per-(row, kv head) kernel against the one split
over positions (qwen_tts/fastpath/decode_attention.py), at the talker's shape, graphed as the frame step runs them.

For each batch size and cache position it builds a talker-sized KV cache (one slice per layer, so the reads come
from memory, not from L2), captures `--layers` calls of each kernel into a CUDA graph, replays it back to back
(CUDA events) and reports microseconds per call and the K/V bytes read per second; it also checks each kernel
against float64 gather + SDPA on the same inputs. Prints a table last, writes JSON.

    python3 benchmarks/kernels/bench_attention.py --batches 1,8,64,256 --positions 100,300,1000 --out attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from qwen_tts.fastpath.decode_attention import decode_attention, reference_decode_attention

KERNELS = {"one-program": False, "split": True}


def time_calls(run, device: str, iters: int) -> float:
    """Seconds per call of run(): on CUDA as a CUDA graph replayed back to back, timed by events (the call
    warmed up on a side stream first, so compilation stays outside the capture); elsewhere by the clock."""
    if device != "cuda":
        run()
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        return (time.perf_counter() - t0) / iters
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return replay_seconds(graph, iters)


def replay_seconds(graph: torch.cuda.CUDAGraph, iters: int, warmups: int = 3) -> float:
    """Seconds per replay of a captured graph: `warmups` replays, then `iters` back to back timed by CUDA events."""
    for _ in range(warmups):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def case(B: int, pos: int, a: argparse.Namespace) -> list[dict]:
    dtype, dev = getattr(torch, a.dtype), a.device
    g = torch.Generator(device=dev).manual_seed(B * 10_000 + pos)
    L = pos + 1 + a.headroom
    cache_k = torch.randn(a.layers, B, a.kv_heads, L, a.head_dim, device=dev, dtype=dtype, generator=g)
    cache_v = torch.randn(cache_k.shape, device=dev, dtype=dtype, generator=g)
    q = torch.randn(B, a.heads, a.head_dim, device=dev, dtype=dtype, generator=g)
    k, v = (torch.randn(B, a.kv_heads, a.head_dim, device=dev, dtype=dtype, generator=g) for _ in range(2))
    slots = torch.randperm(B, device=dev, generator=g)
    positions = torch.full((B,), pos, device=dev, dtype=torch.long)
    ref = reference_decode_attention(
        q.double(), k.double(), v.double(), cache_k[0].double(), cache_v[0].double(), slots, positions
    )
    kv_bytes = 2 * B * a.kv_heads * (pos + 1) * a.head_dim * cache_k.element_size()
    rows = []
    for name, split in KERNELS.items():
        out = decode_attention(q, k, v, cache_k[0], cache_v[0], slots, positions, split)
        err = ((out.double() - ref).norm() / ref.norm()).item()

        def run(split=split):
            for i in range(a.layers):
                decode_attention(q, k, v, cache_k[i], cache_v[i], slots, positions, split)

        us = 1e6 * time_calls(run, dev, a.iters) / a.layers
        rows.append({
            "kernel": name, "batch": B, "position": pos, "us_per_call": round(us, 2),
            "kv_tb_per_s": float(f"{kv_bytes / (us * 1e-6) / 1e12:.3g}"), "rel_err_vs_fp64": float(f"{err:.3g}"),
        })  # fmt: skip
    base = rows[0]["us_per_call"]
    for r in rows:
        r["speedup"] = round(base / r["us_per_call"], 2)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--positions", default="100,300,1000")
    ap.add_argument("--heads", type=int, default=16, help="query heads (the 1.7B talker's)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=28, help="calls per graph, each on its own cache slice")
    ap.add_argument("--headroom", type=int, default=64, help="cache positions past the row's")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (Triton's interpreter, no graphs)")
    ap.add_argument("--out", default="attention.json")
    a = ap.parse_args()
    rows = []
    with torch.inference_mode():
        for B in [int(x) for x in a.batches.split(",")]:
            for pos in [int(x) for x in a.positions.split(",")]:
                for r in case(B, pos, a):
                    print(json.dumps(r), flush=True)
                    rows.append(r)
                if a.device == "cuda":
                    torch.cuda.empty_cache()  # the case's caches are gone: give their memory back
    name = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    result = {"device": name, "torch": torch.__version__, "args": vars(a), "rows": rows}
    Path(a.out).write_text(json.dumps(result, indent=2))
    cols = ["batch", "position", "kernel", "us_per_call", "kv_tb_per_s", "speedup", "rel_err_vs_fp64"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
