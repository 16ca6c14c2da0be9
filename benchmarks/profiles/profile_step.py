"""Where one frame step's time goes, on CUDA: graph replays, kernel counts by part, fused vs eager, and Code2Wav.

For each variant of the frame step (the eager kernels, the fused path, the fused path with split attention) and
each batch size it replays the graphed step back to back (CUDA events: ms per step, and the weights-read
bandwidth that implies), counts the kernels of one eager step with torch.profiler and groups their device time by the step's record_function ranges, and checks
the variants agree (talker logits, teacher-forced top-1). Then it times a 12-frame streaming Code2Wav chunk in
float32, TF32 and bf16 and measures each against the float64-free exact reference: max |stream - whole| and the
largest extra jump at a chunk join, in dB below full scale. Prints a table last, writes JSON.

    python3 benchmarks/profiles/profile_step.py --size 1.7b --batches 1,64 --out profile.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))  # bench_attention

import torch
from bench_attention import replay_seconds

from qwen_tts.engine_api import EngineSettings
from qwen_tts.engines.native.frame_step import FrameStepRunner, SlotState, bucket
from qwen_tts.fastpath import fused, snake_kernel
from qwen_tts.fastpath.options import FastPath
from qwen_tts.fastpath.step import FastStep
from qwen_tts.model.loading import load_model
from qwen_tts.model.random_checkpoint import write_random_checkpoint
from qwen_tts.model.sampling import suppress_mask


def dbfs(x: float) -> float:
    return 20 * math.log10(max(x, 1e-12))


def weight_bytes(talker) -> int:
    """Bytes of weights one frame step reads: the talker once, the code predictor's layers 16 times (its two prompt
    tokens one at a time, then 14 passes; 15 with the prompt in one pass), each of its 15 heads once."""
    cp = talker.code_predictor
    cp_layers = sum(p.numel() * p.element_size() for p in cp.model.layers.parameters())
    heads = sum(p.numel() * p.element_size() for p in cp.lm_head.parameters())
    proj = sum(p.numel() * p.element_size() for p in cp.small_to_mtp_projection.parameters())
    tk = sum(p.numel() * p.element_size() for p in talker.model.layers.parameters())
    tk += talker.codec_head.weight.numel() * talker.codec_head.weight.element_size()
    passes = 15 if talker.kernels is not None and talker.kernels.prompt_one_pass else 16
    proj_reads = 1 if cp.input_tables is not None else passes  # with the tables only the prompt is projected
    return tk + passes * cp_layers + heads + proj_reads * proj


# Frame-step variants: the eager kernels; the fused path with neither optional kernel; with attention split over
# positions, with the few-row Triton matmul, with both (32 x 128 blocks, split K 4), with both but no split K; with
# both and the code predictor's prompt in one pass and/or the sampler kernel (both of those too: the engine's
# default).
_BOTH = {"split_attention": True, "small_m_gemm": True}
STEP_VARIANTS = {
    "eager": None,
    "fused": {},
    "fused-split": {"split_attention": True},
    "fused-small-m": {"small_m_gemm": True},
    "fused-split+small-m": _BOTH,
    "fused-split+small-m+no-split-k": _BOTH,
    "fused-split+small-m+cp-one-pass": _BOTH,  # and the code predictor's two prompt tokens in one pass
    "fused-split+small-m+kernel-sampler": _BOTH,  # and each draw by one Triton kernel, no sort
    "fused-split+small-m+cp-one-pass+kernel-sampler": _BOTH,
    # The engine's default with the heads by the few-row kernel (small_m_heads), the code predictor's inputs from
    # projected tables (cp_input_tables), both.
    "fused-split+small-m+cp-one-pass+kernel-sampler+heads": _BOTH,
    "fused-split+small-m+cp-one-pass+kernel-sampler+tables": _BOTH,
    "fused-split+small-m+cp-one-pass+kernel-sampler+heads+tables": _BOTH,
    # The engine's default with the compiled regions rounding bf16 where the eager layers round (emulate casts).
    "fused-split+small-m+cp-one-pass+kernel-sampler+tables+emulate-casts": _BOTH,
    # and with the regions' reduction configurations picked by rule (inductor's deterministic mode), and without.
    "fused-split+small-m+cp-one-pass+kernel-sampler+tables+deterministic": _BOTH,
    "fused-split+small-m+cp-one-pass+kernel-sampler+tables+no-deterministic": _BOTH,
    # The engine's default with each code-predictor pass of up to four rows by the CUDA stack kernel (stack_cuda.cu:
    # weights copied into shared memory a phase ahead of the grid wait).
    "fused-split+small-m+cp-one-pass+kernel-sampler+tables+stack-cuda": _BOTH,
    # and the talker's passes of up to four rows by that kernel too (its attention over the long cache in chunks;
    # where the talker's layer does not fit the kernel, the 1.7B's, the fused path's kernels).
    "fused-split+small-m+cp-one-pass+kernel-sampler+tables+talker-cuda": _BOTH,
    "fused-split+small-m+cp-one-pass+kernel-sampler+tables+stack-cuda+talker-cuda": _BOTH,
    # and with the heads by the few-row kernel: where both stacks run on the kernel, a lone row's step is one row
    # (frame_step.one_row_steps), as the engine runs one stream with its three opt-in settings.
    "fused-split+small-m+cp-one-pass+kernel-sampler+tables+heads+stack-cuda+talker-cuda": _BOTH,
    # and with the attention units' cached keys staged in shared memory (stack_cuda's stage), with the talker's chunks
    # of 192 positions too.
    "fused-split+small-m+cp-one-pass+kernel-sampler+tables+heads+stack-cuda+talker-cuda+stage": _BOTH,
    "fused-split+small-m+cp-one-pass+kernel-sampler+tables+heads+stack-cuda+talker-cuda+stage+chunk192": _BOTH,
    # and with each residual draw feeding the next pass in its own launch (sample_kernel.sample_feed).
    "fused-split+small-m+cp-one-pass+kernel-sampler+tables+heads+stack-cuda+talker-cuda+stage+feed": _BOTH,
}


def step_deterministic(variant: str) -> bool:
    """Whether a step variant compiles its regions in deterministic mode (EngineSettings.fused_deterministic)."""
    default = EngineSettings().fused_deterministic
    return ("+deterministic" in variant or default) and "+no-deterministic" not in variant


def step_options(variant: str) -> FastPath:
    """The fast path's options a step variant names; the others at the engine's defaults (the stack kernel's
    block sizes), the stack kernel's exact-row builds off."""
    default = FastPath()
    kernels = STEP_VARIANTS[variant] or {}
    return dataclasses.replace(
        default,
        split_attention=kernels.get("split_attention", False),
        small_m_gemm=kernels.get("small_m_gemm", False),
        small_m_split_k=1 if "+no-split-k" in variant else default.small_m_split_k,
        fused_emulate_casts="+emulate-casts" in variant,
        cp_prompt_one_pass="+cp-one-pass" in variant,
        kernel_sampler="+kernel-sampler" in variant,
        cp_fused_feed="+feed" in variant,
        small_m_heads="+heads" in variant,
        cp_input_tables="+tables" in variant,
        cp_stack_kernel="cuda" if "+stack-cuda" in variant else "off",
        talker_stack_kernel="cuda" if "+talker-cuda" in variant else "off",
        talker_stack_stage="+stage" in variant,
        talker_stack_chunk=192 if "+chunk192" in variant else default.talker_stack_chunk,
        stack_exact_rows=0,
    )


def build(path: Path, variant: str, max_rows: int, max_len: int):
    model = load_model(path, device="cuda", dtype=torch.bfloat16)
    talker = model.talker.eval()
    if STEP_VARIANTS[variant] is not None:  # the fast path's object, as the engine hands it to the talker
        FastStep(step_options(variant), "cuda", step_deterministic(variant)).take_talker(talker, max_len)
    t = model.config.talker
    S = max_rows
    cache = talker.new_cache(S + 1, max_len)
    g = torch.Generator(device="cuda").manual_seed(0)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    state = SlotState.zeros(S + 1, t.hidden_size, t.vocab_size, torch.device("cuda"), torch.bfloat16)
    state.h.normal_(generator=g)
    state.rep.fill_(1.05)
    state.greedy.fill_(True)
    state.cp_greedy.fill_(True)
    sup = suppress_mask(t.vocab_size, t.codebook_size, t.codec_eos_token_id, "cuda")
    runner = FrameStepRunner(talker, state, cache, sup, t.codec_eos_token_id, S, scratch=S, use_graphs=True)
    return model, talker, state, cache, runner


def step_inputs(B: int, hidden: int, pos: int):
    g = torch.Generator().manual_seed(B)
    text = [torch.randn(hidden, generator=g).to("cuda", torch.bfloat16) for _ in range(B)]
    return list(range(B)), [50] * B, [10_000] * B, [pos] * B, text


def time_replays(runner: FrameStepRunner, B: int, args, iters: int) -> dict:
    runner.step(*args)  # captures this bucket
    kv = bucket(max(args[3]) + 1, runner.kv_buckets)
    graph = runner._graphs[(bucket(B, runner.batch_buckets), kv)]
    replay_ms = 1000 * replay_seconds(graph, iters, warmups=5)
    t0 = time.perf_counter()
    for _ in range(iters):
        runner.step(*args)  # the engine's call: upload inputs, replay, read the codes back (one sync)
    step_ms = 1000 * (time.perf_counter() - t0) / iters
    return {"replay_ms": round(replay_ms, 3), "step_call_ms": round(step_ms, 3)}


# Kernel families by name (first match wins): where a step's kernels and device time go.
CATEGORIES = (
    ("few-row matmul", ("_small_m_kernel",)),  # not inductor's kernels named after the op
    ("sampler kernel", ("_sample_kernel",)),
    ("gemm", ("gemm", "gemv", "cutlass", "cublas", "sm90_", "sm80_", "xmma", "splitk")),
    ("attention", ("attention", "_attn", "combine_partitions")),
    ("sort", ("sort", "radix", "cub::")),
    ("compiled", ("triton_",)),
    ("copy/index", ("copy", "memcpy", "memset", "index", "gather", "scatter", "cat")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def profile_eager(runner: FrameStepRunner, B: int, args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    kv = max(runner.kv_buckets)
    n = len(args[0])
    host = torch.tensor(args[:4], dtype=torch.long)
    runner._inputs[:, :n].copy_(host)
    runner._text[:n].copy_(torch.stack(args[4]))
    runner._run(B, kv)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner._run(B, kv)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name, by_cat = kernel_tables(kernels, name_len=48)
    ranges = {}
    for ev in prof.key_averages():
        if ev.key in ("code_predictor", "talker"):
            ranges[ev.key + "_device_ms"] = round(getattr(ev, "device_time_total", 0.0) / 1000, 3)
    return {
        "kernels": len(kernels),
        "kernel_device_ms": round(sum(v[1] for v in by_name.values()), 3),
        **ranges,
        "top": top_rows(by_name, 12),
        "by_category": top_rows(by_cat),
    }


def kernel_tables(kernels, name_len: int, runs: int = 1) -> tuple[dict, dict]:
    """Launches and device ms per run of profiler kernel events, by name (its first name_len characters) and by
    family (`category`)."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    by_cat: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in kernels:
        ms = (e.device_time if hasattr(e, "device_time") else e.cuda_time) / 1000 / runs
        for table, key in ((by_name, e.name[:name_len]), (by_cat, category(e.name))):
            table[key][0] += 1 / runs
            table[key][1] += ms
    return by_name, by_cat


def top_rows(table: dict, n: int | None = None) -> list | dict:
    """A `kernel_tables` table by device time, launches and ms rounded: the first n rows as a list, else a dict."""
    rows = sorted(table.items(), key=lambda kv: -kv[1][1])
    if n is not None:
        return [(k, round(v[0]), round(v[1], 3)) for k, v in rows[:n]]
    return {k: (round(v[0]), round(v[1], 3)) for k, v in rows}


def profile_replays(runner: FrameStepRunner, B: int, args, replays: int = 5) -> dict:
    """The captured graph itself under torch.profiler (the kernels a replay runs, not an eager run's): kernels and
    kernel device time per replay, by family and by name, and the replay's wall time on the device beside it. What
    the kernels' sum leaves of the replay is time between kernels (launch gaps, dependency waits)."""
    from torch.profiler import ProfilerActivity, profile

    kv = bucket(max(args[3]) + 1, runner.kv_buckets)
    graph = runner._graphs[(bucket(B, runner.batch_buckets), kv)]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name, by_cat = kernel_tables(kernels, name_len=60, runs=replays)
    kernel_ms = sum(v[1] for v in by_cat.values())
    replay_ms = start.elapsed_time(end) / replays
    return {
        "replay_kernels": round(len(kernels) / replays),
        "replay_kernel_ms": round(kernel_ms, 3),
        "replay_profiled_ms": round(replay_ms, 3),
        "replay_gap_ms": round(replay_ms - kernel_ms, 3),
        "replay_top": top_rows(by_name, 15),
        "replay_by_category": top_rows(by_cat),
    }


# Code2Wav's kernel families by name (first match wins).
CODEC_CATEGORIES = (
    ("snake kernel (bias, residual, SnakeBeta, padding)", ("_snake_kernel",)),
    ("layout transform", ("nchwtonhwc", "nhwctonchw", "transpose", "permute")),
    ("conv", ("conv", "implicit", "xmma", "cutlass", "sm90_", "sm80_", "gemm", "winograd", "fft", "dgrad", "fprop")),
    ("compiled (SnakeBeta)", ("triton_",)),
    ("copy/index", ("copy", "memcpy", "memset", "index", "gather", "scatter", "cat", "fill")),
)


def codec_kernels(dec, codes, stream) -> dict:
    """One more chunk under torch.profiler: device time by kernel family and the top kernels (eager, so the
    launches show; the time is the kernels' own)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.decode_chunk(codes, stream)
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_cat: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = (e.device_time if hasattr(e, "device_time") else e.cuda_time) / 1000
        low = e.name.lower()
        cat = next((c for c, keys in CODEC_CATEGORIES if any(k in low for k in keys)), "other")
        for d, k in ((by_name, e.name[:60]), (by_cat, cat)):
            d[k][0] += 1
            d[k][1] += t
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:10]
    return {
        "kernel_ms": round(sum(v[1] for v in by_cat.values()), 2),
        "by_category": {k: (v[0], round(v[1], 2)) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1][1])},
        "top": [(k, v[0], round(v[1], 2)) for k, v in top],
    }


def conv_times(dec, codes, stream) -> list:
    """One more chunk with CUDA events around every (transposed) convolution: the slowest six, by module name.
    The events wrap the modules' conv entry points (`run`, `run_unbiased`), which the modules' forward
    and the snake kernel's conv stack both call, so every decoder path is timed (the convs alone, not the
    padding around them)."""
    from qwen_tts.model.codec_decoder import CausalConv1d, CausalTransConv1d

    events, wrapped = [], []

    def timed(fn, desc):
        def call(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            events.append((desc, start, end))
            return out

        return call

    for name, m in dec.named_modules():
        if isinstance(m, (CausalConv1d, CausalTransConv1d)):
            c = m.conv
            desc = f"{name} {c.in_channels}->{c.out_channels} k{c.kernel_size[0]} d{c.dilation[0]} s{c.stride[0]}"
            for entry in ("run", "run_unbiased"):
                if hasattr(m, entry):
                    setattr(m, entry, timed(getattr(m, entry), desc))
                    wrapped.append((m, entry))
    try:
        dec.decode_chunk(codes, stream)
        torch.cuda.synchronize()
    finally:
        for m, entry in wrapped:
            delattr(m, entry)  # the instance attribute: the class's method shows through again
    timed_ms = sorted(((d, round(a.elapsed_time(b), 2)) for d, a, b in events), key=lambda t: -t[1])
    return timed_ms[:6]


def codec_variants(path: Path, batches: list[int], chunk: int, chunks: int, variants: list[str]) -> list[dict]:
    model = load_model(path, device="cuda", dtype=torch.bfloat16)
    c2w = model.code2wav.float().eval()
    Q = c2w.cfg.num_quantizers
    size = c2w.cfg.codebook_size
    out = []
    for B in batches:
        g = torch.Generator(device="cuda").manual_seed(B)
        codes = torch.randint(0, size, (B, Q, chunk * chunks), device="cuda", generator=g)
        torch.backends.cudnn.allow_tf32 = False
        with torch.inference_mode():
            whole = c2w(codes[:1]).float()[0]  # exact reference for row 0 (float32, TF32 off)
        for name, tf32, dtype, snake in (
            ("fp32", False, torch.float32, False),
            ("tf32", True, torch.float32, False),
            ("tf32+compiled-snake", True, torch.float32, True),
            ("fp16-decoder", True, "decoder", True),  # the engine's decoder_fp16: the final conv stack in fp16
            ("fp16+polyphase-9", True, "decoder", True),  # and its dilation-9 convs over interleaved phases
            ("fp16+polyphase-9+snake-kernel", True, "decoder", True),  # elementwise work in one pass per activation
            ("fp16+polyphase-9+snake-kernel+fp32-matmul", True, "decoder", True),  # its matmuls in full float32
            ("fp16+polyphase-9+snake-kernel+poly-sin", True, "decoder", True),  # its sin as a polynomial
            ("bf16", False, torch.bfloat16, False),
        ):
            if name not in variants:
                continue
            torch.backends.cudnn.allow_tf32 = tf32
            torch.backends.cuda.matmul.allow_tf32 = tf32 and not name.endswith("+fp32-matmul")
            if dtype == "decoder":
                dec = copy.deepcopy(c2w)
                dec.set_decoder_dtype(torch.float16)
                dec.set_polyphase_dilation(9 if "+polyphase-9" in name else 0)
                poly_sin = name.endswith("+poly-sin")
                kernel = functools.partial(snake_kernel.snake, poly_sin=poly_sin) if "+snake-kernel" in name else None
            else:
                dec = copy.deepcopy(c2w).to(dtype) if dtype != torch.float32 or snake else c2w
                kernel = None
            if snake or kernel is not None:  # Code2Wav's kernels (DecoderKernels): SnakeBeta compiled, the kernel
                snake_beta = fused.snake_beta if snake else None
                dec.use_kernels(SimpleNamespace(snake=kernel, snake_beta=snake_beta))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with torch.inference_mode():
                stream = dec.new_stream(B)
                pieces, times = [], []
                for i in range(chunks):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    w = dec.decode_chunk(codes[:, :, i * chunk : (i + 1) * chunk], stream)
                    e.record()
                    pieces.append(w[0].float())
                    torch.cuda.synchronize()
                    times.append(s.elapsed_time(e))
                streamed = torch.cat(pieces)
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                kernels = codec_kernels(dec, codes[:, :, :chunk], stream)
                kernels["slowest_convs"] = conv_times(dec, codes[:, :, :chunk], stream)
            diff = (streamed - whole).abs()
            joins = torch.arange(1, chunks, device="cuda") * chunk * 1920
            jump = ((streamed[joins] - streamed[joins - 1]) - (whole[joins] - whole[joins - 1])).abs().max()
            out.append(
                {
                    "batch": B,
                    "variant": name,
                    "ms_per_chunk": round(sorted(times[1:])[len(times[1:]) // 2], 2),
                    "peak_extra_gib": round(peak, 2),
                    "max_abs_diff_dbfs": round(dbfs(diff.max().item()), 1),
                    "max_join_jump_dbfs": round(dbfs(jump.item()), 1),
                    **kernels,
                }
            )
            print(json.dumps(out[-1]), flush=True)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1.7b", choices=["tiny", "0.6b", "1.7b"])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--variants", default="eager,fused", help=f"of {','.join(STEP_VARIANTS)}")
    ap.add_argument("--position", type=int, default=300, help="cache position of every row (the kv length)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--codec-batches", default="1,64", help="empty: no Code2Wav part")
    ap.add_argument("--codec-variants", default="fp32,tf32,tf32+compiled-snake,fp16-decoder,bf16")
    ap.add_argument("--out", default="profile.json")
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    results: dict = {"size": a.size, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = write_random_checkpoint(Path(tmp) / a.size, size=a.size, seed=0)
        results["write_s"] = round(time.perf_counter() - t0, 1)
        rows, logits = [], {}
        for variant in filter(None, a.variants.split(",")):  # none: Code2Wav only
            t0 = time.perf_counter()
            model, talker, state, cache, runner = build(path, variant, max(batches), 1024)
            gbytes = weight_bytes(talker) / 1e9
            for B in batches:
                args = step_inputs(B, talker.cfg.hidden_size, a.position)
                h0 = state.h[:B].clone()
                with torch.inference_mode():
                    tm = time_replays(runner, B, args, a.iters)
                    state.h[:B] = h0
                    pr = profile_eager(runner, B, args)
                    state.h[:B] = h0
                    rp = profile_replays(runner, B, args) if STEP_VARIANTS[variant] is not None else {}
                    state.h[:B] = h0
                    # Teacher-forced agreement: the same h through each variant's cb0 logits.
                    lg = talker.logits(h0).float()
                    codes = runner.step(*args)
                logits.setdefault(B, {})[variant] = (lg.cpu(), codes)
                row = {
                    "variant": variant,
                    "batch": B,
                    **tm,
                    "weights_gb": round(gbytes, 2),
                    "tb_per_s": round(gbytes / tm["replay_ms"], 2),
                    **{k: v for k, v in pr.items() if k not in ("top", "by_category")},
                    "by_category": pr["by_category"],
                    **rp,
                    "graphs": runner.num_graphs,
                    "setup_s": round(time.perf_counter() - t0, 1),
                }
                rows.append(row)
                print(json.dumps(row), "\n  top kernels:", json.dumps(pr["top"]), flush=True)
                print("  by category (kernels, device ms):", json.dumps(pr["by_category"]), flush=True)
                if rp:
                    print("  graph replay, per replay: top kernels", json.dumps(rp["replay_top"]), flush=True)
                    print("  graph replay by category:", json.dumps(rp["replay_by_category"]), flush=True)
            del model, talker, state, cache, runner
            torch.cuda.empty_cache()
        agree = {}
        for B, v in logits.items():
            for name in [n for n in v if n != "eager" and "eager" in v]:
                (le, ce), (lf, cf) = v["eager"], v[name]
                agree.setdefault(B, {})[name] = {
                    "logits_max_abs_diff": round((le - lf).abs().max().item(), 4),
                    "logits_scale": round(le.abs().max().item(), 2),
                    "codes_equal_fraction": round((ce == cf).float().mean().item(), 4),
                }
        results["agreement"] = agree
        results["steps"] = rows
        codec_batches = [int(x) for x in a.codec_batches.split(",") if x]
        results["codec"] = codec_variants(path, codec_batches, 12, 6, a.codec_variants.split(","))
    Path(a.out).write_text(json.dumps(results, indent=2))
    print("\nagreement with eager:", json.dumps(agree))
    cols = ["variant", "batch", "replay_ms", "step_call_ms", "tb_per_s", "kernels", "kernel_device_ms",
            "replay_kernels", "replay_kernel_ms", "replay_gap_ms", "code_predictor_device_ms", "talker_device_ms",
            "setup_s"]  # fmt: skip
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    cc = ["batch", "variant", "ms_per_chunk", "peak_extra_gib", "max_abs_diff_dbfs", "max_join_jump_dbfs"]
    print("| " + " | ".join(cc) + " |\n|" + "---|" * len(cc))
    for r in results["codec"]:
        print("| " + " | ".join(str(r[c]) for c in cc) + " |")


if __name__ == "__main__":
    main()
