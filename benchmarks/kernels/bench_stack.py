"""The code predictor's 15 passes a frame alone, on CUDA: the fused path's kernels (fused.stack_step: compiled
blocks, the few-row matmul split over K, split attention; the engine's defaults) against the one-kernel stack, the
CUDA kernel (qwen_tts/fastpath/stack/stack_cuda.cu, mode "cuda", at most four rows: more fall back to the fused
path).

Full-size code-predictor weights (random, bf16; the 1.7B's and the 0.6B's are the same shape), built on the GPU,
or another stack's (--dims, --cache-len, --position: the 0.6B's talker). For each row count and mode it captures a frame's passes (positions 1-15, as after the prompt) into a CUDA graph,
replays it back to back (CUDA events) and reports microseconds per pass and the weight bandwidth that implies;
it checks each mode's output against the fused path's. Prints a table last, writes JSON.

    python3 benchmarks/kernels/bench_stack.py --rows 1,2,4 --out stack.json
    python3 benchmarks/kernels/bench_stack.py --dims 1024,3072,28,16,8,128 --cache-len 3088 --position 300 --modes fused,cuda
        # the 0.6B's talker (the code predictor's layer shape, 28 layers, a long cache): 15 of its passes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from bench_attention import time_calls  # this script's directory is on sys.path when run

from qwen_tts.fastpath import fused, small_m_gemm
from qwen_tts.fastpath.options import FastPath
from qwen_tts.fastpath.stack import stack_cuda, stack_kernel
from qwen_tts.fastpath.stack.stack_cuda import StackOptions
from qwen_tts.fastpath.stack.stack_kernel import StackKernel
from qwen_tts.model.config import DecoderLayersConfig
from qwen_tts.model.layers import DecoderStack
from qwen_tts.model.random_checkpoint import layer_stack

PASSES = 15  # positions 1..15 of a frame
CACHE_LEN = 16


@torch.no_grad()
def build(dims: tuple[int, ...], seed: int = 0) -> DecoderStack:
    cfg = DecoderLayersConfig(
        **layer_stack(*dims), rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=65536, vocab_size=2048
    )
    torch.manual_seed(seed)
    with torch.device("cuda"):
        stack = DecoderStack(cfg)
    for p in stack.parameters():
        p.requires_grad_(False)  # inference only: the compiled blocks must not trace a backward
        p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) / p.shape[1] ** 0.5)
    return stack.to(torch.bfloat16)


KINDS = ("q|k|v", "attn", "o", "gate|up", "down")  # a layer's phases, in order
STEPS = ("wait", "weights", "rows", "products", "write", "to next")  # the stamps' intervals, then the gap to the next


class Bench:
    """One copy of the stack: its layers' fused weights and, for a "cuda" mode, the stack kernel with the mode's
    options (as the fast path's object takes a stack)."""

    def __init__(self, dims: tuple[int, ...], mode: str) -> None:
        self.stack = build(dims)
        self.fused = fused.fuse(self.stack)
        kind = mode.split("+")[0]
        self.kernel = StackKernel(self.stack, self.fused, CACHE_LEN, options(mode)) if kind == "cuda" else None

    def step(self, x: torch.Tensor, p: torch.Tensor, cache, slots: torch.Tensor) -> torch.Tensor:
        """FastStep.stack_step's choice: the kernel where it takes the pass, else the fused path's kernels (the
        engine's defaults: the few-row matmul split over K, split attention)."""
        if self.kernel is not None and self.kernel.runs(x, cache):
            return self.kernel.stack_pass(x, p, cache, slots)
        return fused.stack_step(self.stack, self.fused, x, p, cache, slots, REGIONS, split_attention=True)


REGIONS = fused.Regions(small_m=FastPath().small_m_split_k)


def options(mode: str) -> StackOptions:
    """The kernel's options a mode names (module defaults otherwise)."""
    parts = mode.split("+")[1:]
    opts = StackOptions(weights="noweights" not in parts, chunked="chunked" in parts,
                        split_barrier="splitbar" in parts, stage="stage" in parts,
                        exact_rows=3 if "exact" in parts else 0)  # fmt: skip
    for p in parts:
        if p.startswith("t") and p[1:].isdigit():  # t512: blocks of 512 threads
            opts = opts.replace(threads=int(p[1:]))
        if p.startswith("chunk") and p[5:].isdigit():  # chunk128: a long cache's chunks of 128 positions at least
            opts = opts.replace(chunk=int(p[5:]))
    for p in parts:  # after the chunk (split may not exceed it)
        if p.startswith("split") and p[5:].isdigit():  # split32: past the chunk, chunks of 32 positions at least
            opts = opts.replace(split=int(p[5:]))
    return opts


def stamp_pass(kernel: StackKernel, M: int, args) -> dict:
    """One pass of M rows with the timeline on: each phase kind's mean microseconds per step over the layers (the
    first block's and the last block's), at the clock the pass's timed length implies."""
    sw = kernel.weights
    stack = build((sw.H, sw.I, sw.L, sw.NQ, sw.NKV, sw.D))  # for its cache's shape
    cache = stack.new_cache(M, args.cache_len, "cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(M)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    x = torch.randn(M, sw.H, device="cuda", generator=g).to(torch.bfloat16)
    slots, pos = torch.arange(M, device="cuda"), torch.full((M,), args.position, device="cuda")
    barrier = stack_kernel.prepare("cuda")
    plain, stamped = kernel.options.replace(timeline=False), kernel.options.replace(timeline=True)
    us = time_calls(lambda: stack_cuda.stack_pass(sw, x, pos, cache, slots, barrier, options=plain), "cuda",
                    args.iters) * 1e6  # fmt: skip
    tl = torch.zeros(stack_cuda.timeline_stamps(sw), dtype=torch.int64, device="cuda")
    for _ in range(3):
        stack_cuda.stack_pass(sw, x, pos, cache, slots, barrier, timeline=tl, options=stamped)
    torch.cuda.synchronize()
    st = tl.view(2, 5 * sw.L + 1, 6).double().cpu()
    ghz = (st[0, 5 * sw.L - 1, 5] - st[0, 0, 0]).item() / 1e3 / us  # cycles over the timed pass (the launch aside)
    phases = {}
    for k, kind in enumerate(KINDS):
        idx = [5 * layer + k for layer in range(sw.L)]
        steps = {}
        for i, name in enumerate(STEPS):
            vals = []
            for blk in (0, 1):
                s = st[blk, idx]
                if name == "to next":
                    nxt = st[blk, [j + 1 for j in idx[:-1]], 0] if k < 4 or sw.L > 1 else None
                    d = nxt - s[: len(nxt), 5] if nxt is not None and len(nxt) else torch.zeros(1)
                elif kind == "attn" and name in ("weights", "rows"):
                    d = torch.zeros(1)  # attention has no weights and loads its own vectors: all in "products"
                elif kind == "attn" and name == "products":
                    d = s[:, 4] - s[:, 1]
                else:
                    d = s[:, i + 1] - s[:, i]
                vals.append(round(d.mean().item() / ghz / 1e3, 2))
            steps[name] = vals
        phases[kind] = steps
    out = {"rows": M, "us": round(us, 1), "ghz": round(ghz, 3), "phases": phases}
    if args.cache_len > stack_cuda.MAX_POSITIONS:  # a long cache: attention_long stamps its first unit's steps
        out["attention"] = attention_detail(st, sw.L, ghz)
    return out


ATT_STEPS = ("vectors", "positions", "combine")  # attention_long's first unit: stamps 1 -> 2 -> 3 -> 4


def attention_detail(st, layers: int, ghz: float) -> dict:
    """A long cache's attention phase inside, from the timeline's stamps (st: (2 blocks, 5 L + 1 phases, 6)): its
    first unit's queries and this pass's keys normed and roped (the wait's end to stamp 2), its positions (2 to 3),
    its partials written and, for the last chunk, the chunks combined (3 to the products' end, 4); mean us over the
    layers, for the first and the last block, None for a block that had no unit (stamp 2 is 0)."""
    idx = [5 * layer + 1 for layer in range(layers)]
    detail = {name: [] for name in ATT_STEPS}
    for blk in (0, 1):
        s = st[blk, idx].double()
        had = bool((s[:, 2] > 0).all())
        for i, name in enumerate(ATT_STEPS):
            d = s[:, i + 2] - s[:, i + 1]
            detail[name].append(round(d.mean().item() / ghz / 1e3, 2) if had else None)
    return detail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--modes", default="fused,cuda",
                    help="fused or cuda, cuda with options: +noweights (no weight copies: profiling only), +chunked (a "
                    "short cache's attention by the long cache's code), +splitbar (four arrival counters), +chunkN (a "
                    "long cache's chunks of at least N positions), +splitN (past the chunk, chunks of at least N "
                    "positions), +tN (blocks of N threads), +stage (a long cache's cached keys and values copied into the free "
                    "weight slot before attention's wait), +exact (a pass of M rows by the kernel's M-row build)")  # fmt: skip
    ap.add_argument("--dims", default="1024,3072,5,16,8,128", help="hidden,intermediate,layers,heads,kv heads,head dim")
    ap.add_argument(
        "--cache-len",
        type=int,
        default=CACHE_LEN,
        help="cache positions (the talker's: max text tokens + 16 + max frames: 3088 at the defaults)",
    )
    ap.add_argument(
        "--position",
        type=int,
        default=1,
        help="the first pass's position (a frame's passes run at it and the 14 after it)",
    )
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument(
        "--phase-profile",
        default="1,2,3,4,5,6,10,15,20,25,26",
        help="time the CUDA kernel cut after each of these phase counts (one row); empty: skip",
    )
    ap.add_argument("--profile-mode", default="cuda", help="the options of the phase profile, as in --modes")
    ap.add_argument(
        "--timeline",
        default="",
        help="row counts: one pass of the CUDA kernel each (the --profile-mode options if cuda's) with every phase's "
        "steps stamped by the SM clock of its first and last block: a table of where a phase's time goes; empty: skip",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_stack: needs CUDA")
    dims = tuple(map(int, args.dims.split(",")))
    modes = args.modes.split(",")
    small_m_gemm.prepare("cuda")
    stack_kernel.prepare("cuda")
    benches = {mode: Bench(dims, mode) for mode in modes}  # one copy of the same weights each (same seed)
    base = benches[modes[0]].stack

    weight_bytes = sum(
        p.numel() * p.element_size() for n, p in base.named_parameters() if n.startswith("layers.") and p.dim() > 1
    )
    rows_out = []
    torch.set_grad_enabled(False)
    profile_kind, *_ = args.profile_mode.split("+")
    if args.phase_profile and profile_kind != "cuda":
        sys.exit(f"bench_stack: --profile-mode must be cuda with options, not {args.profile_mode}")
    for M in map(int, args.rows.split(",")):
        g = torch.Generator(device="cuda").manual_seed(M)
        xs = [torch.randn(M, dims[0], device="cuda", generator=g).to(torch.bfloat16) for _ in range(PASSES)]
        slots = torch.arange(M, device="cuda")
        positions = [torch.full((M,), args.position + t, device="cuda") for t in range(PASSES)]
        outs, times = {}, {}
        init = base.new_cache(M, args.cache_len, "cuda", torch.bfloat16)
        init.k.normal_(generator=g)
        init.v.normal_(generator=g)
        for mode in modes:
            bench = benches[mode]
            cache = bench.stack.new_cache(M, args.cache_len, "cuda", torch.bfloat16)
            res: list[torch.Tensor] = []

            def frame(bench=bench, cache=cache, res=res, xs=xs, positions=positions, slots=slots):
                res.clear()
                res.extend(bench.step(x, p, cache, slots) for x, p in zip(xs, positions, strict=True))

            times[mode] = time_calls(frame, "cuda", args.iters) / PASSES
            cache.k.copy_(init.k)  # every mode's check from the same cache
            cache.v.copy_(init.v)
            frame()  # eager, from the same cache as every mode
            torch.cuda.synchronize()
            outs[mode] = torch.stack(res).float()
        ref = outs[modes[0]]
        for mode in modes:
            us = times[mode] * 1e6
            diff = (outs[mode] - ref).abs().max().item()
            row = dict(rows=M, mode=mode, us_per_pass=round(us, 2), tb_per_s=round(weight_bytes / times[mode] / 1e12, 3),
                       max_abs_diff_vs_first=diff, out_scale=ref.abs().max().item())  # fmt: skip
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    profile = []
    if args.phase_profile:  # the kernel cut after k phases: what each phase adds, barrier included
        M = 1
        cache = base.new_cache(M, args.cache_len, "cuda", torch.bfloat16)
        x, slots, pos = torch.randn(M, dims[0], device="cuda").to(torch.bfloat16), torch.zeros(M, dtype=torch.long,
            device="cuda"), torch.full((M,), args.position, dtype=torch.long, device="cuda")  # fmt: skip
        for variant in dict.fromkeys((args.profile_mode, profile_kind)):  # and the defaults, once
            kernel = Bench(dims, variant).kernel  # its own copy: the modes' stacks keep their kinds
            for k in map(int, args.phase_profile.split(",")):
                us = time_calls(lambda k=k, kernel=kernel: kernel.stack_pass(x, pos, cache, slots, phase_range=(0, k)),
                                "cuda", args.iters) * 1e6  # fmt: skip
                profile.append(dict(phases=k, options=variant, us=round(us, 2)))
                print(json.dumps(profile[-1]), flush=True)
    timeline = []
    if args.timeline:
        kernel = Bench(dims, args.profile_mode if profile_kind == "cuda" else "cuda").kernel
        for M in map(int, args.timeline.split(",")):
            timeline.append(stamp_pass(kernel, M, args))
            print(json.dumps(timeline[-1]), flush=True)
    print(f"\nweights a pass: {weight_bytes / 1e6:.1f} MB; {torch.cuda.get_device_name()}")
    print(f"{'rows':>4} {'mode':>26} {'us/pass':>8} {'TB/s':>6} {'max diff':>9}")
    for r in rows_out:
        print(
            f"{r['rows']:>4} {r['mode']:>26} {r['us_per_pass']:>8.1f} {r['tb_per_s']:>6.2f} {r['max_abs_diff_vs_first']:>9.4f}"
        )
    for t in timeline:
        print(f"\ntimeline, {t['rows']} row(s), us at {t['ghz']} GHz (pass {t['us']} us; block: first / last)")
        print(f"{'phase':>8} " + " ".join(f"{k:>13}" for k in STEPS))
        for kind, steps in t["phases"].items():
            print(f"{kind:>8} " + " ".join(f"{steps[k][0]:>6.2f}/{steps[k][1]:<6.2f}" for k in STEPS))
        if "attention" in t:  # None: the block had no attention unit
            cells = [
                f"{k} " + " / ".join("-" if v is None else f"{v:.2f}" for v in t["attention"][k]) for k in ATT_STEPS
            ]
            print("    attn inside (first unit): " + ", ".join(cells))
    if args.out:
        out = {"device": torch.cuda.get_device_name(), "dims": dims, "rows": rows_out, "phase_profile": profile,
               "timeline": timeline}  # fmt: skip
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
