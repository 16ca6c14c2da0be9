"""The frame step's few-row matmuls alone, on CUDA: cuBLAS, cuBLASLt and our Triton kernel (qwen_tts/fastpath/small_m_gemm.py)
over a sweep of its block sizes, at the decoder layers' real shapes.

For each weight shape of the talker's and the code predictor's layers (q|k|v, o, gate|up, down) and each row
count it captures `--reps` calls into a CUDA graph, each on its own copy of the weight (together larger than L2,
so the weights come from memory as in the step), replays it back to back (CUDA events) and reports microseconds
per call and the weight bytes read per second. Each kernel configuration is checked against float64 first. Last,
the step's total over its calls (the talker's layers once, the code predictor's 16 times) for cuBLAS, cuBLASLt and
the best single kernel configuration: the figure that decides `FastPath.small_m_gemm` and its block sizes.
`--max-splits` adds split K (`FastPath.small_m_split_k`): a configuration "16x256x4k4" splits each narrow
weight over up to 4 programs per column block, as `small_m_gemm.split_k_for` chooses on this GPU.

    python3 benchmarks/kernels/bench_gemm.py --size 1.7b --rows 2,4,8,16 --max-splits 1,2,4 --out gemm.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from bench_attention import time_calls  # graph replays on CUDA, the clock elsewhere

from qwen_tts.fastpath import small_m_gemm
from qwen_tts.model.random_checkpoint import model_config

# One-token passes of the code predictor per frame on the fast path: its two prompt tokens, then 14 codes fed back.
CODE_PREDICTOR_PASSES = 16


def layer_shapes(size: str) -> list[dict]:
    """(name, N, K, calls per frame step) of every decoder-layer matmul of a checkpoint size."""
    t = model_config(size).talker
    out = []
    for stack, c, calls in (("talker", t, 1), ("code_predictor", t.code_predictor, CODE_PREDICTOR_PASSES)):
        H, D = c.hidden_size, c.head_dim
        for name, n, k in (
            ("qkv", (c.num_attention_heads + 2 * c.num_key_value_heads) * D, H),
            ("o", H, c.num_attention_heads * D),
            ("gate_up", 2 * c.intermediate_size, H),
            ("down", H, c.intermediate_size),
        ):
            out.append({"stack": stack, "name": name, "N": n, "K": k, "calls": calls * c.num_hidden_layers})
    return out


def timed(fn, x, weights: list, device: str, iters: int) -> float:
    """Microseconds per call of fn(x, w), over one call per weight copy."""
    return round(1e6 * time_calls(lambda: [fn(x, w) for w in weights], device, iters) / len(weights), 2)


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    """'16,32x128,256x3,4' -> every (block_n, block_k, stages) of the three comma lists."""
    parts = [[int(v) for v in p.split(",")] for p in text.split("x")]
    if len(parts) != 3:
        raise SystemExit("--configs: BLOCK_Ns x BLOCK_Ks x STAGES, e.g. 16,32x128,256x3,4")
    return list(itertools.product(*parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1.7b", choices=["tiny", "0.6b", "1.7b"])
    ap.add_argument("--rows", default="2,4,8,16", help="rows per matmul (a lone stream runs as two)")
    ap.add_argument("--configs", default="16,32,64x128,256x3,4,5", help="BLOCK_Ns x BLOCK_Ks x STAGES")
    ap.add_argument("--max-splits", default="1,4", help="split-K maxima (small_m_gemm's max_split_k); 1: none")
    ap.add_argument("--reps", type=int, default=0, help="calls per graph (0: enough weight copies for 400 MB)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (Triton's interpreter, no graphs)")
    ap.add_argument("--out", default="gemm.json")
    a = ap.parse_args()
    dev, dtype = a.device, torch.bfloat16
    configs = [(*c, s) for c in parse_configs(a.configs) for s in (int(v) for v in a.max_splits.split(","))]
    rows = [int(r) for r in a.rows.split(",")]
    results = []
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.inference_mode():
        for shape in layer_shapes(a.size):
            N, K = shape["N"], shape["K"]
            reps = a.reps or max(1, (400 << 20) // (N * K * 2))
            weights = [torch.randn(N, K, device=dev, dtype=dtype, generator=g) * K**-0.5 for _ in range(reps)]
            for M in rows:
                x = torch.randn(M, K, device=dev, dtype=dtype, generator=g)
                ref = x.double() @ weights[0].double().T
                row = {**shape, "M": M, "reps": reps}

                row["cublas_us"] = timed(F.linear, x, weights, dev, a.iters)
                if dev == "cuda":
                    torch.backends.cuda.preferred_blas_library("cublaslt")  # read when the graph is captured
                    row["cublaslt_us"] = timed(F.linear, x, weights, dev, a.iters)
                    torch.backends.cuda.preferred_blas_library("cublas")
                row["kernel_us"] = {}
                row["splits"] = {}
                for bn, bk, st, ms in configs:
                    sk = small_m_gemm.split_k_for(N, K, x.device, bn, bk, ms)

                    def kernel(x, w, bn=bn, bk=bk, st=st, sk=sk):
                        return small_m_gemm.small_m_matmul(x, w, block_n=bn, block_k=bk, num_stages=st, split_k=sk)

                    name = f"{bn}x{bk}x{st}" + (f"k{ms}" if ms > 1 else "")
                    err = ((kernel(x, weights[0]).double() - ref).norm() / ref.norm()).item()
                    if err > 4e-3:  # bf16 output rounding gives ~1.7e-3 relative; more is a wrong kernel
                        raise SystemExit(f"{shape['stack']}.{shape['name']} M={M} {name}: rel err {err:.3g}")
                    row["kernel_us"][name] = timed(kernel, x, weights, dev, a.iters)
                    row["splits"][name] = sk
                best = min(row["kernel_us"], key=row["kernel_us"].get)
                row["best_config"], row["best_us"] = best, row["kernel_us"][best]
                gb = N * K * 2 / 1e9
                row["tb_per_s"] = {
                    k: float(f"{gb / (row[k] * 1e-6) / 1e3:.3g}")
                    for k in ("cublas_us", "cublaslt_us", "best_us")
                    if k in row
                }  # fmt: skip
                print(json.dumps(row), flush=True)
                results.append(row)
            del weights
            if dev == "cuda":
                torch.cuda.empty_cache()
    # Per step and row count: every call of the step, each library, and each kernel configuration applied to all.
    steps = []
    for M in rows:
        rs = [r for r in results if r["M"] == M]
        step = {"M": M, "cublas_ms": round(sum(r["calls"] * r["cublas_us"] for r in rs) / 1e3, 3)}
        if all("cublaslt_us" in r for r in rs):
            step["cublaslt_ms"] = round(sum(r["calls"] * r["cublaslt_us"] for r in rs) / 1e3, 3)
        per_config = {c: sum(r["calls"] * r["kernel_us"][c] for r in rs) / 1e3 for c in rs[0]["kernel_us"]}
        best = min(per_config, key=per_config.get)
        step.update(best_config=best, kernel_ms=round(per_config[best], 3))
        step["per_shape_best_ms"] = round(sum(r["calls"] * r["best_us"] for r in rs) / 1e3, 3)
        steps.append(step)
    name = torch.cuda.get_device_name() if dev == "cuda" else dev
    Path(a.out).write_text(json.dumps({"device": name, "args": vars(a), "shapes": results, "step": steps}, indent=2))
    cols = ["stack", "name", "N", "K", "M", "cublas_us", "cublaslt_us", "best_us", "best_config"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    cols = ["M", "cublas_ms", "cublaslt_ms", "kernel_ms", "best_config", "per_shape_best_ms"]
    print("\nthe step's decoder-layer matmuls:\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for s in steps:
        print("| " + " | ".join(str(s.get(c, "")) for c in cols) + " |")


if __name__ == "__main__":
    main()
