"""The whole GPU benchmark in one process run: our engine, through our HTTP server, and the baselines.

For each size (--sizes, default 1.7b,0.6b) it writes a full-size random checkpoint on this machine and, at a fixed
length (--frames, default 100 = 8 s of audio per request, end-of-speech held off), measures:
  engine   closed loop at each --concurrency level (n requests at once): x real time per stream, audio-s/s,
           first audio (TTFA) p50/p95, playback continuity, peak GPU memory, the engine's worker timings per step;
  poisson  open-loop Poisson arrivals at each --poisson-rates rate: TTFA p50/p95 and continuity;
  http     our server (inference_server.py in a subprocess, uvicorn) with --http-clients streaming h11 clients
           on /synthesize/stream: TTFA and continuity measured at the client; once per --api-processes value
           (0,2: in one process, then the engine in its own process and 2 HTTP front-ends); then, at each
           --http-poisson-rates rate, clients arriving open-loop, each connecting when it arrives;
  icl      (--icl-levels) ICL voices (a --icl-ref-frames reference of random codes and a transcript, 4 voices, each
           warmed once so their per-voice cache holds them) against x-vector voices on the same engine, level by
           level: x-vector only, then ICL only at one stream and half ICL, half x-vector beside it;
  profile  (--profile) for --profile-batches: kernels per frame step (total, top-10 by name prefix), GPU kernel
           time by record_function range (the engine's own ranges if it has any, else the outermost nn.Module
           class), elapsed time per module from CUDA events, and graph launch (host) vs kernel time; with CUDA
           graphs and, with --profile-eager, the eager engine too.
and, once, the side-by-side baselines in their own processes and Python paths (1.7B, the same architecture,
fixed length, random weights of their own), after our parts, before them (--baselines-first) or beside them on
another GPU (--baseline-gpu):
  reference  the official implementation at batch 1 and 32 (--reference-script, --reference-site), through
             reference_full_length.py: rows the official generate cuts at a sampled end-of-speech are padded
             back to the length generated, so a batch stacks and its frames are all counted;
  peer       faster-qwen3-tts at one stream (--peer-script, --peer-site), and the official code's transformers-5
             build at batch 1 and 16, through the same wrapper.

Continuity: each stream's chunk arrival times are replayed against a player that starts at its first chunk;
a chunk that arrives after the audio before it has played out stalls the player for the difference. Reported:
p95 of the per-stream total stall and the share of streams with no stall at all.

Prints one compact table last (JSON lines of each measurement before it) and writes everything to --out.

    python benchmarks/e2e/bench_gpu.py --sizes tiny --concurrency 1,4 --poisson-count 6 --http-clients 1,2 --profile
    bash benchmarks/gpu/gpu_bench.sh          # on the GPU machine: installs the carried wheels, runs everything
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import h11
import numpy as np
import torch

# --- The engine's public pieces: the one place to update when the package moves. -------------------------------
from qwen_tts.engine_api import SAMPLE_RATE, EngineSettings, QueueFullError, SynthesisRequest
from qwen_tts.engines import create_engine, release_device_memory
from qwen_tts.fastpath.options import FastPath
from qwen_tts.icl import NUM_CODEBOOKS, IclReference
from qwen_tts.model.random_checkpoint import write_random_checkpoint
from qwen_tts.voices import VoiceProfile, save_profile
from tts_server.heap import freeze_startup_heap, thaw_and_collect

# ----------------------------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello world, this is a test of speech synthesis for "
    "many voices. The quick brown fox jumps over the lazy dog."
)
FRAME_S = 0.08  # one codec frame = 80 ms of audio
GIB = 1024**3
PARTS = ("engine", "poisson", "http", "profile", "icl", "reference", "peer")
# Engines compared in the same run (--engine-variants): "" is the default engine. Each variant is EngineSettings
# fields and FastPath fields (qwen_tts/fastpath/options.py) over the defaults; the ideas measured before these are in
# docs/performance.md's ledger, each with the commit that can bring it back.
VARIANTS: dict[str, dict] = {
    "": {},
    "one-stream": {"fast_path": "one-stream"},  # the one-stream preset: both stack kernels, the few-row heads
    "eager": {"fast_path": "eager"},  # the eager preset: the model's own PyTorch, no CUDA graphs
    "fp32-decoder": {"decoder_fp16": False},  # Code2Wav in float32 (TF32 convolutions)
    "no-deterministic": {"fused_deterministic": False},  # reduction configs timed per process, not by rule
    "batch-invariant-decode": {"batch_invariant_decode": True},  # each request's chunks decoded on their own
    "admission-64ms": {"admission_step_budget_ms": 64.0},  # queue new requests while steps exceed 64 ms
    "chunk-24": {"chunk_frames": 24},  # later chunks up to 24 frames (3, 6, 12, 24, 24, ...)
    "first-chunk-2": {"first_chunk_frames": 2},  # a first chunk of 2 frames (2, 4, 8, 12, 12, ...)
    "decode-batch-64": {"decode_max_batch": 64},  # Code2Wav calls of up to 64 rows (the default before 128)
}
SIZE_PARTS = {"engine", "poisson", "http", "profile", "icl"}  # the parts that need our checkpoints


def variant_settings(name: str) -> dict:
    """The fields of a variant: a name of VARIANTS, or several joined by '+' (their fields together)."""
    out: dict = {}
    for part in filter(None, name.split("+")):
        if part not in VARIANTS:
            raise ValueError(f"unknown engine variant {part!r}: choose from {', '.join(v for v in VARIANTS if v)}")
        out.update(VARIANTS[part])
    return out


def variant_engine(name: str, **settings) -> tuple[EngineSettings, FastPath]:
    """A variant's engine: its EngineSettings (`settings` under the variant's fields) and the FastPath handed to
    the engine (the variant's fields over the preset its settings name)."""
    fields = {**settings, **variant_settings(name)}
    preset = FastPath.preset(fields.get("fast_path", EngineSettings.fast_path))
    fast, rest = FastPath.split(fields, base=preset)
    return EngineSettings(**rest), fast


def engine_variants(text: str) -> list[str]:
    """--engine-variants: comma-separated variants, each checked now rather than after the engines before it ran."""
    names = [v for v in text.split(",") if v]
    for v in names:
        try:
            variant_settings(v)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def emit(record: dict) -> None:
    """One measurement as a JSON line on stdout (the table comes last)."""
    print(json.dumps(record, default=str), flush=True)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def r1(x: float | None, k: float = 1.0, nd: int = 1) -> float | None:
    return None if x is None else round(x * k, nd)


def ms_stats(name: str, seconds: list[float], quantiles: tuple[float, ...] = (0.5, 0.95), top: bool = True) -> dict:
    """`<name>_p50_ms`, `<name>_p95_ms` (per quantile) and `<name>_max_ms` of durations given in seconds."""
    out = {f"{name}_p{round(q * 100)}_ms": r1(pct(seconds, q), 1000) for q in quantiles}
    if top:
        out[f"{name}_max_ms"] = r1(max(seconds, default=None), 1000)
    return out


# ---------------------------------------------------------------------------------------------------- continuity
def stall_seconds(arrivals: list[tuple[float, float]]) -> float:
    """Total stall of a player that starts at the first chunk: `arrivals` is (arrival time, audio seconds) per
    chunk in order. A chunk arriving after everything before it has played pauses the player until it arrives."""
    if not arrivals:
        return 0.0
    t0, d0 = arrivals[0]
    played_out = t0 + d0  # when the player runs dry without more audio
    stall = 0.0
    for t, d in arrivals[1:]:
        if t > played_out:
            stall += t - played_out
            played_out = t
        played_out += d
    return stall


class Stream:
    """Client-side record of one streamed request."""

    __slots__ = ("arrivals", "error", "sent", "status")

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.arrivals: list[tuple[float, float]] = []
        self.error: str | None = None
        self.status: int | None = None

    def chunk(self, seconds: float) -> None:
        if seconds > 0:
            self.arrivals.append((time.perf_counter(), seconds))

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.arrivals)

    @property
    def ttfa(self) -> float:
        return self.arrivals[0][0] - self.sent

    @property
    def audio_s(self) -> float:
        return sum(d for _, d in self.arrivals)

    @property
    def xrt(self) -> float:
        return self.audio_s / max(1e-9, self.arrivals[-1][0] - self.sent)


def stream_stats(streams: list[Stream], wall: float) -> dict:
    ok = [s for s in streams if s.ok]
    stalls = [stall_seconds(s.arrivals) for s in ok]
    ttfa = [s.ttfa for s in ok]
    audio = sum(s.audio_s for s in ok)
    errors = Counter(s.error for s in streams if s.error)
    return {
        "requests": len(streams),
        "ok": len(ok),
        "errors": dict(errors),
        "wall_s": round(wall, 3),
        "audio_s": round(audio, 2),
        "audio_s_per_s": round(audio / wall, 2) if wall > 0 else None,
        "xrt_per_stream_median": r1(statistics.median([s.xrt for s in ok]) if ok else None, nd=3),
        "xrt_per_stream_min": r1(min((s.xrt for s in ok), default=None), nd=3),
        **ms_stats("ttfa", ttfa),
        **ms_stats("stall", stalls, (0.95,)),
        "zero_stall_share": round(sum(s == 0.0 for s in stalls) / len(stalls), 4) if stalls else None,
        "chunks_per_stream": round(statistics.mean(len(s.arrivals) for s in ok), 1) if ok else None,
    }


# ---------------------------------------------------------------------------------------------------- engine runs
def cuda() -> bool:
    return torch.cuda.is_available()


def reset_peak() -> None:
    if cuda():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> dict:
    if not cuda():
        return {"peak_alloc_gib": None, "peak_reserved_gib": None}
    torch.cuda.synchronize()
    return {
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / GIB, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2),
    }


def make_request(i: int, frames: int, dim: int, greedy: bool, seed_base: int = 0) -> SynthesisRequest:
    return SynthesisRequest(
        text=TEXT,
        xvector=torch.randn(dim, generator=torch.Generator().manual_seed(seed_base + i)),
        seed=seed_base + i,
        greedy=greedy,
        max_frames=frames,
        min_frames=frames + 1,  # end-of-speech masked throughout: every request does the same work
    )


REF_TEXT = "This is the reference clip, spoken once at enrolment in the voice that every request clones."
ICL_VOICES = 4


def icl_reference(voice: int, frames: int) -> IclReference:
    """A benchmark ICL voice: `frames` random codes (codebook size 2048) and a transcript, keyed per voice."""
    codes = torch.randint(0, 2048, (frames, NUM_CODEBOOKS), generator=torch.Generator().manual_seed(1000 + voice))
    return IclReference(codes=codes, text=REF_TEXT, key=f"bench-voice-{voice}-{frames}")


async def consume(engine, req: SynthesisRequest, st: Stream, on_handle=None) -> None:
    try:
        handle = engine.submit(req)
    except QueueFullError:
        st.error = "queue_full"
        return
    if on_handle is not None:
        on_handle(handle)
    try:
        async for chunk in handle:
            st.chunk(chunk.shape[0] / SAMPLE_RATE)
    except Exception as e:
        st.error = type(e).__name__


def timing_delta(before: dict, after: dict, n: int) -> dict:
    """The engine's worker timings (engine.timings) over a run: per step, and prefill per request, in ms."""
    d = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}
    steps = max(1, d.get("steps", 0))
    out = {"engine_steps": d.get("steps")}
    for k, v in d.items():
        if k.endswith("_s"):
            name = k[:-2]
            per_req = name.startswith("prefill")  # admission's timings: per request
            out[f"{name}_ms_per_req" if per_req else f"{name}_ms_per_step"] = round(
                1000 * v / (n if per_req else steps), 2
            )
    if d.get("decode_chunks"):
        out["decode_rows_per_chunk"] = round(d["decode_rows"] / d["decode_chunks"], 1)
    return out


async def closed_level(engine, n: int, frames: int, greedy: bool, icl: list[IclReference] | None = None) -> dict:
    """n requests at once; with `icl`, the first len(icl) of them clone those ICL voices."""
    dim = engine.xvector_dim
    reset_peak()
    before = dict(engine.timings)
    reqs = [make_request(i, frames, dim, greedy) for i in range(n)]
    for req, ref in zip(reqs, icl or [], strict=False):
        req.icl = ref
    streams = [Stream() for _ in reqs]
    t0 = time.perf_counter()
    for s in streams:
        s.sent = t0
    await asyncio.gather(*(consume(engine, r, s) for r, s in zip(reqs, streams, strict=True)))
    wall = time.perf_counter() - t0
    out = {"concurrency": n, "frames": frames, **stream_stats(streams, wall)}
    out["wall_ms_per_frame"] = round(1000 * wall / frames, 2)
    if n <= 2 and streams[0].arrivals:  # where a lone stream's time goes: each chunk's arrival (ms) and audio (s)
        out["first_stream_chunks"] = [[round(1000 * (t - t0), 1), round(d, 3)] for t, d in streams[0].arrivals]
    out.update(timing_delta(before, engine.timings, n))
    out.update(peak_memory())
    return out


def poisson_offsets(rate: float, count: int, seed: int) -> list[float]:
    """The arrival times (s from the start) of `count` requests with exponential gaps at `rate` per second."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(count):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


async def open_loop(
    offsets: list[float], serve: Callable[[int, Stream], Awaitable[None]]
) -> tuple[list[Stream], float, dict]:
    """Arrival i at offsets[i] s from now, its stream timed from the arrival and run by serve(i, stream); returns
    the streams, the wall time and the arrivals' span and most in flight at once."""
    streams = [Stream() for _ in offsets]
    running = [0, 0]  # now, max

    async def one(i: int, off: float, st: Stream) -> None:
        await asyncio.sleep(max(0.0, t0 + off - time.perf_counter()))
        st.sent = time.perf_counter()
        running[0] += 1
        running[1] = max(running[1], running[0])
        try:
            await serve(i, st)
        finally:
            running[0] -= 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, o, s) for i, (o, s) in enumerate(zip(offsets, streams, strict=True))))
    wall = time.perf_counter() - t0
    return streams, wall, {"arrival_span_s": round(offsets[-1], 2), "max_in_flight": running[1]}


async def poisson_run(engine, rate: float, count: int, frames: int, greedy: bool, seed: int = 0) -> dict:
    """Open loop: `count` requests with exponential gaps at `rate` per second, each streamed to the end."""
    reqs = [make_request(i, frames, engine.xvector_dim, greedy, seed_base=1000) for i in range(count)]
    reset_peak()
    before = dict(engine.timings)
    streams, wall, arrivals = await open_loop(
        poisson_offsets(rate, count, seed), lambda i, st: consume(engine, reqs[i], st)
    )
    out = {"rate_per_s": rate, "frames": frames, **stream_stats(streams, wall), **arrivals}
    out.update(timing_delta(before, engine.timings, count))
    out.update(peak_memory())
    return out


# ---------------------------------------------------------------------------------------------------- profile
def kernel_prefix(name: str) -> str:
    """A kernel's family: template arguments and parameters dropped, the last two namespace parts kept."""
    n = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    n = re.split(r"[<(\[ ]", n, maxsplit=1)[0]
    n = "::".join(n.split("::")[-2:])
    return n[:56] or name[:56]


def caller() -> str:
    """The function that called the module being entered (the first frame outside torch.nn and this file)."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename == __file__ or "torch/nn/modules" in f.f_code.co_filename):
        f = f.f_back
    return f.f_code.co_name if f is not None else "?"


class ModuleRanges:
    """Global nn.Module hooks: while `active`, the outermost module call on each thread opens a record_function
    range `module:<Class><-<calling function>` and is timed with CUDA events (host clock on CPU). Robust to the engine's internals:
    it needs no names from them. Module calls replayed inside a CUDA graph are invisible (nothing runs them)."""

    def __init__(self, use_cuda: bool):
        self.use_cuda = use_cuda
        self.active = False
        self.local = threading.local()
        self.events: list[tuple[str, object, object]] = []
        self._handles = []

    def __enter__(self) -> ModuleRanges:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, module, args) -> None:
        stack = self.local.__dict__.setdefault("stack", [])
        depth = len(stack)
        entry = None
        if self.active and depth < 2:
            # depth 0: the outermost module, named with its caller and timed; depth 1: its direct children
            name = f"module:{type(module).__name__}<-{caller()}" if depth == 0 else f"sub:{type(module).__name__}"
            rf = torch.profiler.record_function(name)
            rf.__enter__()
            start = None
            if depth == 0:
                if self.use_cuda:
                    start = torch.cuda.Event(enable_timing=True)
                    start.record()
                else:
                    start = time.perf_counter()
            entry = (name, rf, start)
        stack.append(entry)

    def _post(self, module, args, output) -> None:
        stack = self.local.__dict__.setdefault("stack", [])
        entry = stack.pop() if stack else None
        if entry is None:
            return
        name, rf, start = entry
        rf.__exit__(None, None, None)
        if start is None:
            return
        if self.use_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self.events.append((name.removeprefix("module:"), start, end))

    def elapsed_ms(self) -> dict[str, float]:
        if self.use_cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = defaultdict(float)
        for name, a, b in self.events:
            out[name] += a.elapsed_time(b) if self.use_cuda else 1000 * (b - a)
        return out


def profiler_activities() -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


class ProfileWindow:
    """torch.profiler over a window of `steps` engine steps, opened once the engine's step count reaches
    `start_after` and closed at the first tick `steps` steps later.

    torch.profiler records CPU ops and record_function ranges only on the thread that starts it (CUDA kernels and
    runtime calls it sees from every thread). Driver "worker" ticks from the handles' chunk callbacks, which the
    engine calls from its own thread, so that thread's ranges are recorded; driver "main" ticks from a poller on
    the benchmark's thread (kernels, launches and times only), the fallback if the first records no kernels."""

    def __init__(self, engine, steps: int, start_after: int, ranges: ModuleRanges | None, driver: str = "worker"):
        self.engine = engine
        self.steps = steps
        self.start_after = start_after
        self.ranges = ranges
        self.driver = driver
        self.prof = None
        self.done = False
        self.error: str | None = None
        self.window: dict = {}
        self.lock = threading.Lock()

    def wrap(self, handle) -> None:
        if self.driver != "worker":
            return
        put = handle.put_threadsafe

        def put_and_tick(chunk, _put=put):
            self.tick()
            _put(chunk)

        handle.put_threadsafe = put_and_tick

    async def poll(self) -> None:
        while self.driver == "main" and not self.done:
            self.tick()
            await asyncio.sleep(0.0005)

    def tick(self) -> None:
        with self.lock:
            if self.done:
                return
            try:
                steps = self.engine.timings["steps"]
                if self.prof is None and steps >= self.start_after:
                    if cuda():
                        torch.cuda.synchronize()
                    self.prof = torch.profiler.profile(activities=profiler_activities())
                    self.prof.__enter__()
                    self.window = {"t0": time.perf_counter(), "timings0": dict(self.engine.timings)}
                    if self.ranges is not None:
                        self.ranges.active = True
                elif self.prof is not None and steps - self.window["timings0"]["steps"] >= self.steps:
                    if cuda():
                        torch.cuda.synchronize()
                    if self.ranges is not None:
                        self.ranges.active = False
                    self.window["wall_s"] = time.perf_counter() - self.window["t0"]
                    self.window["timings1"] = dict(self.engine.timings)
                    self.prof.__exit__(None, None, None)
                    self.done = True
            except Exception as e:  # never break the engine's loop
                self.error = f"{type(e).__name__}: {e}"
                self.done = True


def union_us(spans: list[tuple[float, float]]) -> float:
    """The time covered by (start, end) spans, overlaps counted once."""
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def stream_times(trace: dict) -> dict:
    """Where a profile window's GPU time went by stream: each stream's kernels and the time they covered, the window
    from the first kernel's start to the last one's end, the time any kernel ran, and the time the busiest stream (the
    frame steps') sat idle while another stream ran (its kernels waited on, or shared the GPU with, the others)."""
    by_stream = defaultdict(list)
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            by_stream[e.get("args", {}).get("stream")].append((e["ts"], e["ts"] + e["dur"]))
    if not by_stream:
        return {}
    every = [sp for spans in by_stream.values() for sp in spans]
    span = max(b for _, b in every) - min(a for a, _ in every)
    busy = {k: union_us(v) for k, v in by_stream.items()}
    main = max(busy, key=busy.get)
    return {
        "span_us": span,
        "any_busy_us": union_us(every),
        "streams": {str(k): {"kernels": len(by_stream[k]), "busy_us": busy[k]} for k in by_stream},
        "main_stream": str(main),
        "main_idle_us": span - busy[main],
    }


def attribute(trace: dict, on_cuda: bool) -> dict:
    """Group a chrome trace's device work by enclosing record_function range.

    On CUDA the work items are kernels (matched through their correlation id to the host launch call, whose
    thread and time give the enclosing ranges); on CPU they are the outermost aten ops of each thread."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges = defaultdict(list)  # tid -> [(start, end, name)]
    for e in ev:
        if e.get("cat") == "user_annotation" and not e["name"].startswith("ProfilerStep"):
            ranges[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    runtime = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    by_corr = {e.get("args", {}).get("correlation"): e for e in runtime}
    items = []  # (tid, host ts, name, device us)
    if on_cuda:
        for e in ev:
            if e.get("cat") != "kernel":
                continue
            launch = by_corr.get(e.get("args", {}).get("correlation"))
            tid, ts = (launch["tid"], launch["ts"]) if launch else (None, None)
            graphed = launch is not None and "GraphLaunch" in launch["name"]
            items.append((tid, ts, e["name"], e["dur"], graphed))
    else:
        ops = defaultdict(list)
        for e in ev:
            if e.get("cat") == "cpu_op":
                ops[e["tid"]].append(e)
        for tid, lst in ops.items():
            lst.sort(key=lambda e: (e["ts"], -e["dur"]))
            end = -math.inf
            for e in lst:
                if e["ts"] >= end:  # not inside the previous outermost op
                    items.append((tid, e["ts"], e["name"], e["dur"], False))
                    end = e["ts"] + e["dur"]
    # Sweep each thread's ranges and items in time order, keeping the stack of open ranges.
    label = {}
    by_tid = defaultdict(list)
    for i, (tid, ts, *_) in enumerate(items):
        if tid is not None:
            by_tid[tid].append((ts, 1, i))
    for tid, rs in ranges.items():
        for a, b, name in rs:
            by_tid[tid].append((a, 0, (b, name)))
    for _tid, points in by_tid.items():
        points.sort(key=lambda p: (p[0], p[1]))
        stack: list[tuple[float, str]] = []
        for ts, kind, payload in points:
            while stack and stack[-1][0] <= ts:
                stack.pop()
            if kind == 0:
                stack.append(payload)
            else:
                engine_ranges = [n for _, n in stack if not n.startswith(("module:", "sub:"))]
                modules = [n for _, n in stack if n.startswith("module:")]
                subs = [n for _, n in stack if n.startswith("sub:")]
                if engine_ranges:
                    label[payload] = engine_ranges[-1]
                elif modules:  # the outermost module and which of its children (its own ops: outside them all)
                    label[payload] = f"{modules[0]}/{subs[0][4:] if subs else 'own ops'}"
    groups = defaultdict(lambda: [0, 0.0])
    names = defaultdict(lambda: [0, 0.0])
    for i, (_, _, name, dur, graphed) in enumerate(items):
        g = groups[label.get(i) or ("(cuda graph)" if graphed else "(no range)")]
        g[0] += 1
        g[1] += dur
        k = names[kernel_prefix(name)]
        k[0] += 1
        k[1] += dur
    api = defaultdict(lambda: [0, 0.0])
    for e in runtime:
        a = api[e["name"]]
        a[0] += 1
        a[1] += e["dur"]
    memcpy = [e for e in ev if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    return {"items": items, "groups": groups, "names": names, "api": api, "memcpy": memcpy}


async def profile_batch(
    engine, n: int, steps: int, chunk_frames: int, greedy: bool, module_ranges: bool, driver: str = "worker"
) -> dict:
    first = 3
    frames = first + steps + chunk_frames + 2  # chunks keep arriving after the window closes
    await closed_level(engine, n, min(frames, 8), greedy)  # warm this batch size
    with torch.profiler.profile(activities=profiler_activities()):
        pass  # the profiler's one-time set-up runs on this thread (it wants the thread that registered it)
    with ModuleRanges(cuda()) if module_ranges and driver == "worker" else contextlib.nullcontext() as ranges:
        # main: skip the prefill and first chunk, which the worker driver's first tick comes after
        before = engine.timings["steps"] + (first if driver == "main" else 0)
        prof = ProfileWindow(engine, steps, start_after=before, ranges=ranges, driver=driver)
        reqs = [make_request(i, frames, engine.xvector_dim, greedy) for i in range(n)]
        streams = [Stream() for _ in reqs]
        poller = asyncio.ensure_future(prof.poll())
        await asyncio.gather(*(consume(engine, r, s, on_handle=prof.wrap) for r, s in zip(reqs, streams, strict=True)))
        prof.done = True
        await poller
        cuda_event_ms = ranges.elapsed_ms() if ranges is not None else {}
    if prof.error or "timings1" not in prof.window:
        return {"batch": n, "driver": driver, "error": prof.error or "the profile window never closed"}
    w = prof.window
    nsteps = max(1, w["timings1"]["steps"] - w["timings0"]["steps"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    a = attribute(trace, cuda())
    st = stream_times(trace) if cuda() else {}
    if cuda() and not a["items"] and driver == "worker":
        log(f"bench: profile b={n}: no kernels recorded from the engine's thread; profiling from this one")
        return await profile_batch(engine, n, steps, chunk_frames, greedy, module_ranges, driver="main")
    total_us = sum(it[3] for it in a["items"])
    per = lambda v: round(v / nsteps, 3)  # noqa: E731
    top = sorted(a["names"].items(), key=lambda kv: -kv[1][0])[:10]
    out = {
        "batch": n,
        "graphs": engine.model_info.get("cuda_graphs"),
        "driver": driver,
        "steps": nsteps,
        "wall_ms_per_step": round(1000 * w["wall_s"] / nsteps, 3),
        # The engine's own generation time per step (its decode time in the window includes the profiler's start).
        "engine_step_ms": timing_delta(w["timings0"], w["timings1"], n).get("step_ms_per_step"),
        ("kernels_per_step" if cuda() else "top_ops_per_step"): per(len(a["items"])),
        "device_ms_per_step": round(total_us / 1000 / nsteps, 3),
        "by_range_ms_per_step": {
            k: round(v[1] / 1000 / nsteps, 3) for k, v in sorted(a["groups"].items(), key=lambda kv: -kv[1][1])
        },
        "by_range_kernels_per_step": {k: per(v[0]) for k, v in a["groups"].items()},
        "by_caller_ms_per_step": by_caller(a["groups"], nsteps),
        "by_module_ms_per_step": by_module(a["groups"], nsteps),
        "top10_prefix": [
            {"name": k, "per_step": per(c), "ms_per_step": round(us / 1000 / nsteps, 3)} for k, (c, us) in top
        ],
        "cuda_event_ms_per_step": {
            k: round(v / nsteps, 3) for k, v in sorted(cuda_event_ms.items(), key=lambda kv: -kv[1])
        },
        "host_api_per_step": {
            k: {"calls": per(c), "ms": round(us / 1000 / nsteps, 3)}
            for k, (c, us) in sorted(a["api"].items(), key=lambda kv: -kv[1][1])[:8]
        },
        "memcpy_per_step": per(len(a["memcpy"])),
    }
    if st:  # the frame steps' stream (the busiest) against the window: its idle time, and what ran on the others
        ms = lambda us: round(us / 1000 / nsteps, 3)  # noqa: E731
        out["gpu_span_ms_per_step"] = ms(st["span_us"])
        out["gpu_any_busy_ms_per_step"] = ms(st["any_busy_us"])
        out["main_stream_idle_ms_per_step"] = ms(st["main_idle_us"])
        out["streams_busy_ms_per_step"] = {
            k: {"kernels": per(v["kernels"]), "busy": ms(v["busy_us"]), "main": k == st["main_stream"]}
            for k, v in st["streams"].items()
        }
    launch = a["api"].get("cudaGraphLaunch")
    if launch:
        out["graph_launch_host_ms_per_step"] = round(launch[1] / 1000 / nsteps, 3)
    if cuda():  # host time spent launching work: graph replays plus single kernels
        launches = sum(us for k, (_, us) in a["api"].items() if "Launch" in k)
        out["launch_host_ms_per_step"] = round(launches / 1000 / nsteps, 3)
    return out


# ---------------------------------------------------------------------------------------------------- HTTP
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """Our server (inference_server.py) in a subprocess on a free local port, for one checkpoint."""

    def __init__(
        self, ckpt: Path, workdir: Path, slots: int, frames: int, a: argparse.Namespace, api_processes: int = 0
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        profiles = workdir / "profiles"
        dim = json.loads((ckpt / "config.json").read_text())["talker_config"]["hidden_size"]
        x = torch.randn(dim, generator=torch.Generator().manual_seed(7))
        save_profile(profiles / "bench.safetensors", VoiceProfile(x_vector=x, model=ckpt.name), overwrite=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_")}
        env.update(
            TTS_MODEL_PATH=str(ckpt),
            TTS_PROFILES_DIR=str(profiles),
            TTS_HOST="127.0.0.1",
            TTS_PORT=str(self.port),
            TTS_DEVICE=a.device,
            TTS_MAX_CONCURRENT=str(slots),
            TTS_MAX_QUEUE=str(slots),
            TTS_MAX_NEW_TOKENS=str(frames),
            TTS_FIRST_CHUNK_FRAMES=str(a.first_chunk),
            TTS_CHUNK_FRAMES=str(a.chunk),
            TTS_LOG_LEVEL="warning",
            # Every client of the benchmark comes from 127.0.0.1, as every client does behind a proxy
            # (docs/security.md): the per-client cap must not be what an HTTP level measures.
            TTS_MAX_CONNECTIONS_PER_CLIENT="1024",
            TTS_API_PROCESSES=str(api_processes),  # 0: one process; N: the engine's own process and N front-ends
        )
        if a.dtype:
            env["TTS_DTYPE"] = a.dtype
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "inference_server.py")], cwd=REPO, env=env, stdout=self.log, stderr=self.log
        )

    async def wait_ready(self, timeout: float) -> float:
        import httpx

        t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=5) as c:
            while time.perf_counter() - t0 < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}: {self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(self.url + "/ready")).status_code == 200:
                        return time.perf_counter() - t0
                await asyncio.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout:.0f} s: {self.tail()}")

    async def metrics(self) -> str:
        """The server's /metrics page ("" if it does not answer); under TTS_API_PROCESSES, one front-end's."""
        import httpx

        try:
            async with httpx.AsyncClient(timeout=10) as c:
                return (await c.get(self.url + "/metrics")).text
        except httpx.HTTPError:
            return ""

    def tail(self, n: int = 1500) -> str:
        self.log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


LOOP_LAG = "tts_event_loop_lag_seconds"
TIME_TO_ENGINE = "tts_time_to_engine_seconds"


def _buckets(text: str, name: str) -> dict[float, float]:
    """A histogram's cumulative buckets in a /metrics page: upper bound (s) -> count."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        float(s.labels["le"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name + "_bucket"
    }


def _histogram_delta(before: str, after: str, name: str) -> tuple[float, dict[float, float], Callable]:
    """A histogram's observations between two /metrics pages: their count, the cumulative bucket counts, and
    bound(q): the smallest bucket bound (ms) holding share q of them (None: beyond the last)."""
    b, a = _buckets(before, name), _buckets(after, name)
    bounds = sorted(k for k in a if k != math.inf)
    delta = {k: a[k] - b.get(k, 0.0) for k in a}
    n = delta.get(math.inf, 0.0)

    def bound(q: float) -> float | None:
        return next((k * 1e3 for k in bounds if delta[k] >= q * n), None)

    return n, delta, bound


def loop_lag(before: str, after: str) -> dict:
    """How late the server's event loop ran its 50 ms probe between two /metrics pages: the probes, the share late
    by more than 10 ms, and the bucket bounds (ms) that hold the 99th percentile and the latest probe."""
    n, delta, bound = _histogram_delta(before, after, LOOP_LAG)
    if not n:
        return {"probes": 0}
    return {
        "probes": int(n),
        "late_10ms_share": round(1 - delta.get(0.01, 0.0) / n, 3),
        "p99_ms_at_most": bound(0.99),
        "max_ms_at_most": bound(1.0),
    }


def time_to_engine(before: str, after: str) -> dict:
    """The server's own time from a request's arrival to the engine's submission, between two /metrics pages: the
    requests, and the bucket bounds (ms) that hold their median, 95th percentile and latest."""
    n, _, bound = _histogram_delta(before, after, TIME_TO_ENGINE)
    if not n:
        return {"requests": 0}
    return {
        "requests": int(n),
        "p50_ms_at_most": bound(0.5),
        "p95_ms_at_most": bound(0.95),
        "max_ms_at_most": bound(1.0),
    }


class HttpConn:
    """One HTTP/1.1 connection over asyncio streams, driven by h11: the HTTP level's client. A streamed response
    through httpx costs the client several times the CPU (fake engine on 2 cores, 256 streams of 100 frames:
    benchmarks/e2e/bench_http_waves.py --client httpx against --client h11), enough for one process of 256
    clients to set the pace instead of the server it measures."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self.reader, self.writer, self.host = reader, writer, host
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, url: str) -> HttpConn:
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer, f"{host}:{port}")

    async def post_stream(self, path: str, payload: dict) -> AsyncIterator[h11.Response | bytes]:
        """POST `payload` as JSON; yields the response head, then each piece of its body as it arrives.
        ConnectionError when the server closes the connection first."""
        if self.conn.our_state is h11.DONE:
            self.conn.start_next_cycle()
        data = json.dumps(payload).encode()
        headers = [("host", self.host), ("content-type", "application/json"), ("content-length", str(len(data)))]
        self.writer.write(self.conn.send(h11.Request(method="POST", target=path, headers=headers)))
        self.writer.write(self.conn.send(h11.Data(data=data)) + self.conn.send(h11.EndOfMessage()))
        await self.writer.drain()
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as e:
                raise ConnectionError(str(e)) from None
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.reader.read(65536))
            elif isinstance(event, h11.Response):
                yield event
            elif isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection")

    def close(self) -> None:
        self.writer.close()


def stream_body(i: int, frames: int, greedy: bool, voice: str = "bench") -> dict:
    """The body of the HTTP level's request `i`: `frames` frames exactly, raw float32 audio."""
    body = {
        "speaker_id": voice,
        "text": TEXT,
        "max_new_tokens": frames,
        "min_new_tokens": frames,
        "seed": i,
        "response_format": "f32le",
    }
    if greedy:
        body["temperature"] = 0.0
    return body


async def stream_over(
    conn: HttpConn, i: int, frames: int, greedy: bool, st: Stream, server_ttfa: list[float], sent: float | None = None
) -> None:
    """Request `i` streamed to its end over `conn`: its chunks' arrivals into `st`, timed from `sent` (default:
    now), the server's own first-audio time (X-Time-To-First-Audio) into `server_ttfa`."""
    st.sent = time.perf_counter() if sent is None else sent
    try:
        async for piece in conn.post_stream("/synthesize/stream", stream_body(i, frames, greedy)):
            if isinstance(piece, bytes):
                st.chunk(len(piece) / 4 / SAMPLE_RATE)  # f32le mono
                continue
            st.status = piece.status_code
            if piece.status_code != 200:
                st.error = f"http_{piece.status_code}"
                return
            with contextlib.suppress(ValueError):
                server_ttfa.append(float(dict(piece.headers).get(b"x-time-to-first-audio", b"")))
    except OSError as e:  # ConnectionError among them
        st.error = type(e).__name__


async def http_level(url: str, n: int, frames: int, greedy: bool) -> dict:
    """n clients at once, each streaming one request over a connection of its own (opened before the clock
    starts); the client process's CPU over the level beside the streams' figures."""
    streams = [Stream() for _ in range(n)]
    server_ttfa: list[float] = []
    conns = [await HttpConn.open(url) for _ in range(n)]
    try:
        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(
            *(
                stream_over(c, i, frames, greedy, s, server_ttfa)
                for i, (s, c) in enumerate(zip(streams, conns, strict=True))
            )
        )
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        for c in conns:
            c.close()
    server = ms_stats("server_ttfa", server_ttfa, top=False)
    return {"clients": n, "frames": frames, **stream_stats(streams, wall), **server, "client_cpu_s": round(cpu, 3)}


async def http_poisson(url: str, rate: float, count: int, frames: int, greedy: bool, seed: int = 0) -> dict:
    """Open loop over HTTP: `count` clients arriving with exponential gaps at `rate` per second, each connecting
    when it arrives (its first audio counts the connection) and streaming its request to the end."""
    server_ttfa: list[float] = []

    async def serve(i: int, st: Stream) -> None:
        try:
            conn = await HttpConn.open(url)
        except OSError as e:
            st.error = type(e).__name__
            return
        try:
            await stream_over(conn, 1000 + i, frames, greedy, st, server_ttfa, sent=st.sent)
        finally:
            conn.close()

    cpu0 = time.process_time()
    streams, wall, arrivals = await open_loop(poisson_offsets(rate, count, seed), serve)
    out = {"rate_per_s": rate, "frames": frames, **stream_stats(streams, wall), **arrivals}
    out["client_cpu_s"] = round(time.process_time() - cpu0, 3)
    return {**out, **ms_stats("server_ttfa", server_ttfa, top=False)}


# ---------------------------------------------------------------------------------------------------- baselines
def run_baseline(name: str, cmd: list[str], site: str | None, extra_env: dict, timeout: float) -> dict:
    """A baseline script in its own process with only its own wheel folder on PYTHONPATH (our `qwen_tts` and the
    official one share a name), run from a scratch directory; its JSON lines are the result."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if site:
        env["PYTHONPATH"] = site
    env.update(extra_env)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            return {"name": name, "error": f"timed out after {timeout:.0f} s", "rows": parse_json_lines(out)}
    rows = parse_json_lines(p.stdout)
    res = {"name": name, "rc": p.returncode, "wall_s": round(time.perf_counter() - t0, 1), "rows": rows}
    if p.returncode != 0 or not rows:
        res["error"] = (p.stderr or p.stdout)[-1500:]
    return res


def parse_json_lines(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    return rows


# ---------------------------------------------------------------------------------------------------- table
def fmt(x, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def pair(a, b, nd: int = 0) -> str:
    return "-" if a is None and b is None else f"{fmt(a, nd)}/{fmt(b, nd)}"


def table(results: dict) -> str:
    head = ["size", "run", "n", "xRT/stream", "audio-s/s", "ms/step gen+dec", "TTFA p50/p95 ms", "stall p95 ms",
            "zero-stall", "peak alloc/res GiB"]  # fmt: skip
    rows = []
    for size, res in results["sizes"].items():
        for r in res.get("engine", []):
            gen, dec = r.get("step_ms_per_step"), r.get("decode_ms_per_step")
            step = f"{fmt(gen)}+{fmt(dec)}" if gen is not None else "-"
            rows.append([size, f"engine {r['variant']}" if r.get("variant") else "engine", r["concurrency"], fmt(r["xrt_per_stream_median"], 2), fmt(r["audio_s_per_s"]),
                         step, pair(r["ttfa_p50_ms"], r["ttfa_p95_ms"]), fmt(r["stall_p95_ms"], 0),
                         share(r["zero_stall_share"]), pair(r["peak_alloc_gib"], r["peak_reserved_gib"], 1)])  # fmt: skip
        for r in res.get("poisson", []):
            gen, dec = r.get("step_ms_per_step"), r.get("decode_ms_per_step")
            step = f"{fmt(gen)}+{fmt(dec)}" if gen is not None else "-"
            run = " ".join(filter(None, ("poisson", r.get("variant"), f"{r['rate_per_s']:g}/s")))
            rows.append([size, run, f"{r['requests']} (max {r['max_in_flight']})",
                         fmt(r["xrt_per_stream_median"], 2), fmt(r["audio_s_per_s"]), step,
                         pair(r["ttfa_p50_ms"], r["ttfa_p95_ms"]), fmt(r["stall_p95_ms"], 0),
                         share(r["zero_stall_share"]), pair(r["peak_alloc_gib"], r["peak_reserved_gib"], 1)])  # fmt: skip
        for r in res.get("icl", []):
            gen, dec = r.get("step_ms_per_step"), r.get("decode_ms_per_step")
            step = f"{fmt(gen)}+{fmt(dec)}" if gen is not None else "-"
            run = f"icl {r['mode']} ({r['icl_streams']} ICL, ref {r['ref_frames']} frames)"
            rows.append([size, run, r["concurrency"], fmt(r["xrt_per_stream_median"], 2), fmt(r["audio_s_per_s"]),
                         step, pair(r["ttfa_p50_ms"], r["ttfa_p95_ms"]), fmt(r["stall_p95_ms"], 0),
                         share(r["zero_stall_share"]), pair(r["peak_alloc_gib"], r["peak_reserved_gib"], 1)])  # fmt: skip
        for r in res.get("http", []):
            if "error" in r and "clients" not in r:
                rows.append([size, "http", "-", "error", "-", "-", "-", "-", "-", "-"])
                continue
            run = f"http poisson {r['rate_per_s']:g}/s" if "rate_per_s" in r else "http stream"
            run += f" (TTS_API_PROCESSES={r['api_processes']})" if r.get("api_processes") else ""
            n = f"{r['requests']} (max {r['max_in_flight']})" if "rate_per_s" in r else r["clients"]
            rows.append([size, run, n, fmt(r["xrt_per_stream_median"], 2),
                         fmt(r["audio_s_per_s"]), "-", pair(r["ttfa_p50_ms"], r["ttfa_p95_ms"]),
                         fmt(r["stall_p95_ms"], 0), share(r["zero_stall_share"]), "-"])  # fmt: skip
    rows += baseline_rows(results)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def reference_size(results: dict) -> str:
    size = results.get("args", {}).get("reference_size", "full")
    return "1.7b" if size == "full" else size


def baseline_rows(results: dict) -> list[list]:
    """Rows of the baselines in the table's columns."""
    b = results.get("baselines", {})
    rows = []
    ref = b.get("reference")
    if ref:
        size = reference_size(results)
        measured = [r for r in ref.get("rows", []) if "batch" in r]  # not the note lines (the wrapper's)
        if not measured:
            rows.append([size, "official (HF generate)", "-", "error", "-", "-", "-", "-", "-", "-"])
        for r in measured:
            B = r["batch"]
            rows.append([size, "official (HF generate)", B, fmt(r["gen_xRT"] / B, 2), fmt(r["gen_xRT"], 1),
                         fmt(r["ms_per_step"]), "-", "-", "-", "-"])  # fmt: skip
    peer = b.get("peer")
    if peer:
        measured = [r for r in peer.get("rows", []) if "system" in r]  # not the note lines (the wrapper's)
        if not measured:
            rows.append(["1.7b", "faster-qwen3-tts", "-", "error", "-", "-", "-", "-", "-", "-"])
        best: dict[str, dict] = {}
        for r in measured:
            key = r.get("mode") or f"batch {r.get('batch')}"
            key = f"{r.get('system')}|{key}"
            speed = r.get("xRT") or r.get("audio_s_per_s") or 0
            if key not in best or speed > (best[key].get("xRT") or best[key].get("audio_s_per_s") or 0):
                best[key] = r
        for key, r in best.items():
            system, mode = key.split("|")
            short = "faster-qwen3-tts" if system == "faster-qwen3-tts" else "official tf5"
            n = r.get("batch", 1)
            xrt = r.get("xRT") or (r["audio_s_per_s"] / n if r.get("audio_s_per_s") else None)
            agg = r.get("audio_s_per_s") or r.get("xRT")
            ttfa = r.get("ttfa_ms")
            rows.append(["1.7b", f"{short} {mode}", n, fmt(xrt, 2), fmt(agg, 1), "-",
                         pair(ttfa, None) if ttfa else "-", "-", "-", "-"])  # fmt: skip
    return rows


def ratios(results: dict) -> dict:
    """Ours (1.7B engine) over the baselines measured in the same run."""
    ours = {r["concurrency"]: r for r in results["sizes"].get("1.7b", {}).get("engine", [])}
    out: dict[str, float] = {}
    if not ours:
        return out

    def at(n: int) -> dict | None:
        ks = sorted(ours)
        k = next((k for k in ks if k >= n), ks[-1])
        return ours[k]

    ref = results.get("baselines", {}).get("reference") or {}
    for r in ref.get("rows", []) if reference_size(results) == "1.7b" else []:
        if "batch" in r and r.get("gen_xRT"):
            o = at(r["batch"])
            out[f"engine c={o['concurrency']} / official b={r['batch']} (audio-s/s)"] = round(
                o["audio_s_per_s"] / r["gen_xRT"], 2
            )
    peer = results.get("baselines", {}).get("peer") or {}
    whole = [
        r["xRT"] for r in peer.get("rows", []) if r.get("system") == "faster-qwen3-tts" and r.get("mode") == "whole"
    ]
    if whole and 1 in ours:
        out["engine c=1 / faster-qwen3-tts whole (x real time)"] = round(
            ours[1]["xrt_per_stream_median"] / max(whole), 2
        )
    return out


def by_module(groups: dict, nsteps: int) -> dict[str, float]:
    """Module ranges summed over the outermost module's children."""
    out: dict[str, float] = defaultdict(float)
    for k, (_, us) in groups.items():
        out[k.split("/", 1)[0]] += us / 1000 / nsteps
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def by_caller(groups: dict, nsteps: int) -> dict[str, float]:
    """Module ranges summed by the function that called the outermost module (frame step, decode, prefill)."""
    out: dict[str, float] = defaultdict(float)
    for k, (_, us) in groups.items():
        out[k.split("/", 1)[0].rsplit("<-", 1)[1] if k.startswith("module:") else k] += us / 1000 / nsteps
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def compact(profile: dict) -> dict:
    """A profile record without its long breakdowns (those go to the JSON file)."""
    return {k: v for k, v in profile.items() if not isinstance(v, (dict, list))}


def top(d: dict, n: int, nd: int = 2) -> str:
    return ", ".join(f"{k.removeprefix('module:')} {v:.{nd}f}" for k, v in list(d.items())[:n])


def profile_lines(results: dict) -> list[str]:
    """Two lines per profiled batch (the JSON has everything)."""
    lines = []
    for size, res in results["sizes"].items():
        profiles = [(size, p) for p in res.get("profile", [])]
        profiles += [(f"{size} {v}", p) for v, ps in res.get("variant_profile", {}).items() for p in ps]
        for label, p in profiles:  # the size, and the engine variant if any
            if "error" in p:
                lines.append(f"profile {label} b={p['batch']}: {p['error']}")
                continue
            kernels = "kernels_per_step" in p
            k = p["kernels_per_step"] if kernels else p["top_ops_per_step"]
            graph, launch = p.get("graph_launch_host_ms_per_step"), p.get("launch_host_ms_per_step")
            lines.append(
                f"profile {label} {'graphs' if p.get('graphs') else 'eager'} b={p['batch']}: {k:g} "
                f"{'kernels' if kernels else 'top-level ops'}/step, device {p['device_ms_per_step']:.2f} ms/step, "
                f"wall {p['wall_ms_per_step']:.2f}"
                + (f", host launching {launch:.2f}" if launch is not None else "")
                + (f" (graphs {graph:.2f})" if graph is not None else "")
                + f" | by caller: {top(p.get('by_caller_ms_per_step', {}), 4)}"
                + f" | events: {top(p.get('cuda_event_ms_per_step', {}), 3)}"
            )
            kern = ", ".join(f"{t['name'][:36]} {t['per_step']:.0f}" for t in p["top10_prefix"][:6])
            lines.append(f"  ms/step: {top(p['by_range_ms_per_step'], 5)} | kernels/step: {kern}")
            if "gpu_span_ms_per_step" in p:
                streams = ", ".join(
                    f"{'steps' if v['main'] else 'stream ' + sid} {v['busy']:.2f} ({v['kernels']:g} kernels)"
                    for sid, v in p["streams_busy_ms_per_step"].items()
                )
                lines.append(
                    f"  GPU ms/step: span {p['gpu_span_ms_per_step']:.2f}, any kernel {p['gpu_any_busy_ms_per_step']:.2f}, "
                    f"steps' stream idle {p['main_stream_idle_ms_per_step']:.2f} | busy: {streams}"
                )
    return lines


# ---------------------------------------------------------------------------------------------------- main
class Run:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.t0 = time.perf_counter()
        self._save_lock = threading.Lock()
        self.results: dict = {
            "args": {**vars(a), "parts": sorted(a.parts)},
            "machine": machine(),
            "sizes": {},
            "baselines": {},
            "skipped": [],
            "timed_out": [],
        }

    def time_left(self, part: str) -> bool:
        if self.a.time_budget_s and time.perf_counter() - self.t0 > self.a.time_budget_s:
            self.results["skipped"].append(part)
            log(f"bench: skipping {part}: past the {self.a.time_budget_s:g} s budget")
            return False
        return True

    def baseline_timeout(self) -> float:
        """A baseline may run past the time budget by 80 s at most, so the table still prints in time."""
        t = self.a.baseline_timeout
        if self.a.time_budget_s:
            t = min(t, max(30.0, self.a.time_budget_s + 80 - (time.perf_counter() - self.t0)))
        return t

    def save(self) -> None:
        if self.a.out:
            with self._save_lock:  # the baselines' thread saves too (--baseline-gpu)
                text = json.dumps(self.results, indent=2, default=str)
                Path(self.a.out).parent.mkdir(parents=True, exist_ok=True)
                Path(self.a.out).write_text(text)

    def engine_config(
        self, ckpt: Path, slots: int, graphs: bool = True, variant: str = ""
    ) -> tuple[EngineSettings, FastPath]:
        a = self.a
        settings, fast = variant_engine(
            variant,
            first_chunk_frames=a.first_chunk,  # a variant may set these
            chunk_frames=a.chunk,
            model_path=str(ckpt),
            device=a.device,
            dtype=a.dtype,
            max_slots=slots,
            max_queue=100_000,
            max_frames=a.frames,
            max_text_tokens=256,
            decoder_tf32=not a.exact_decoder,
        )
        return settings, fast if graphs else dataclasses.replace(fast, frame_step="eager")

    async def start_engine(self, cfg: tuple[EngineSettings, FastPath]):
        t0 = time.perf_counter()
        engine = create_engine(*cfg)
        await engine.start()
        # As the server does after start-up (tts_server/heap.py): full collections then skip the engine's heap,
        # instead of stopping its loop for tens of ms.
        freeze_startup_heap()
        return engine, round(time.perf_counter() - t0, 1)

    async def _level(self, engine, n: int, greedy: bool) -> None:
        await closed_level(engine, n, min(self.a.frames, 8), greedy)  # warm this batch size
        self._last_level = await closed_level(engine, n, self.a.frames, greedy)

    async def poisson_levels(self, engine, size: str, out: list, variant: str = "") -> None:
        """The --poisson-rates levels on `engine` (open-loop arrivals; a variant's: --variant-poisson-rates), each
        appended to `out`."""
        a = self.a
        for rate in a.variant_poisson_rates if variant else a.poisson_rates:
            if not self.time_left(" ".join(filter(None, (size, "poisson", variant, f"{rate}/s")))):
                break
            count = a.poisson_count or max(1, round(rate * a.poisson_duration))
            r = await poisson_run(engine, rate, count, a.frames, not a.sampling)
            if variant:
                r = {"variant": variant, **r}
            emit({"size": size, "part": "poisson", **r})
            out.append(r)
            self.save()

    async def engine_levels(self, engine, size: str, levels: list[int], out: list, variant: str = "") -> None:
        """The closed-loop levels on one engine, each warmed first; rows appended to `out` as they end."""
        greedy = not self.a.sampling
        for n in levels:
            name = " ".join(filter(None, (size, "engine", variant, f"c={n}")))
            if not self.time_left(name):
                break
            t0 = time.perf_counter()
            log(f"bench: {name}: warm-up, then {self.a.frames} frames")
            try:
                await asyncio.wait_for(self._level(engine, n, greedy), self.a.level_timeout_s or None)
            except TimeoutError:
                # A level that never ends (a stuck or pathologically slow variant) is reported, and this engine's
                # later levels are not started: the run goes on to the next engine or part instead of its limit.
                self.results["timed_out"].append(name)
                log(f"bench: {name}: no result after {time.perf_counter() - t0:.0f} s (--level-timeout-s)")
                self.save()
                break
            r = self._last_level
            if variant:
                r = {"variant": variant, **r}
            emit({"size": size, "part": "engine", **r})
            out.append(r)
            self.save()

    async def icl_levels(self, engine, size: str, out: list) -> None:
        """Per --icl-levels level on one engine: x-vector streams only, then the same streams with ICL voices (all
        of them at one stream, half at more), each warmed first; the voices' cache is filled before the first."""
        a, greedy = self.a, not self.a.sampling
        voices = [icl_reference(v, a.icl_ref_frames) for v in range(ICL_VOICES)]
        await closed_level(engine, ICL_VOICES, 8, greedy, voices)  # each voice's reference decoded once
        for n in a.icl_levels:
            refs = [voices[i % ICL_VOICES] for i in range(max(1, n // 2) if n > 1 else 1)]
            for mode, icl in (("xvector", None), ("icl" if n == 1 else "mixed", refs)):
                if not self.time_left(f"{size} icl {mode} c={n}"):
                    return
                await closed_level(engine, n, min(a.frames, 8), greedy, icl)
                r = {"mode": mode, "ref_frames": a.icl_ref_frames, "icl_streams": len(icl or []),
                     **await closed_level(engine, n, a.frames, greedy, icl)}  # fmt: skip
                emit({"size": size, "part": "icl", **r})
                out.append(r)
                self.save()

    async def profile_levels(self, engine, size: str, out: list, timed: bool) -> None:
        """The profile windows at each --profile-batches size on one engine, rows appended to `out` as they end;
        timed: each batch first asks the time budget."""
        a = self.a
        for n in a.profile_batches:
            if timed and not self.time_left(f"{size} profile b={n}"):
                break
            r = await profile_batch(
                engine, n, a.profile_steps, a.chunk, not a.sampling, a.module_ranges, a.profile_driver
            )
            emit({"size": size, "part": "profile", **compact(r)})
            out.append(r)
            self.save()

    async def size(self, size: str, root: Path) -> None:
        a, parts = self.a, self.a.parts
        res: dict = self.results["sizes"].setdefault(size, {})
        t0 = time.perf_counter()
        ckpt = write_random_checkpoint(root / size, size=size, seed=0, tokenizer_dir=a.tokenizer_dir)
        res["write_s"] = round(time.perf_counter() - t0, 1)
        if "engine" in parts:
            res["engine"] = []
        # The default engine; --concurrency "" with --engine-variants runs the variants only.
        profile_default = "profile" in parts and not a.variant_profile
        if ("engine" in parts and a.concurrency) or "poisson" in parts or profile_default:
            slots = max([*a.concurrency, *(a.profile_batches if "profile" in parts else [])], default=1)
            engine, res["load_s"] = await self.start_engine(self.engine_config(ckpt, slots))
            res["info"] = engine.model_info
            log(f"bench {size}: write {res['write_s']} s, load+warm-up {res['load_s']} s, {engine.model_info}")
            try:
                if "engine" in parts:
                    await self.engine_levels(engine, size, a.concurrency, res["engine"])
                if "poisson" in parts:
                    res["poisson"] = []
                    await self.poisson_levels(engine, size, res["poisson"])
                if profile_default:
                    res["profile"] = []
                    await self.profile_levels(engine, size, res["profile"], timed=True)
            finally:
                await engine.stop()
                del engine
                free_memory()
        for variant in a.engine_variants if "engine" in parts or a.variant_poisson_rates else []:
            if not self.time_left(f"{size} engine {variant}"):
                break
            levels = (a.variant_concurrency or a.concurrency) if "engine" in parts else []
            profiled = a.profile_batches if a.variant_profile and "profile" in parts else []
            engine, load_s = await self.start_engine(
                self.engine_config(ckpt, max([*levels, *profiled]), variant=variant)
            )
            res.setdefault("variant_info", {})[variant] = {"load_s": load_s, **engine.model_info}
            try:
                await self.engine_levels(engine, size, levels, res.setdefault("engine", []), variant)
                if a.variant_poisson_rates:
                    await self.poisson_levels(engine, size, res.setdefault("poisson", []), variant)
                if profiled:
                    res.setdefault("variant_profile", {})[variant] = out = []
                    await self.profile_levels(engine, f"{size} {variant}", out, timed=True)
            finally:
                await engine.stop()
                del engine
                free_memory()
        if profile_default and a.profile_eager and cuda() and self.time_left(f"{size} profile eager"):
            engine, _ = await self.start_engine(self.engine_config(ckpt, max(a.profile_batches), graphs=False))
            try:
                await self.profile_levels(engine, size, res["profile"], timed=False)
            finally:
                await engine.stop()
                del engine
                free_memory()
        if "icl" in parts and a.icl_levels:
            engine, _ = await self.start_engine(self.engine_config(ckpt, max(a.icl_levels)))
            try:
                res["icl"] = []
                await self.icl_levels(engine, size, res["icl"])
            finally:
                await engine.stop()
                del engine
                free_memory()
        if "http" in parts and self.time_left(f"{size} http"):
            res["http"] = await self.http(ckpt, root / f"{size}-http")
            self.save()

    async def http(self, ckpt: Path, workdir: Path) -> list[dict]:
        a = self.a
        out: list[dict] = []
        for processes in a.api_processes:  # one server each, in this run: the A/B of TTS_API_PROCESSES
            where = workdir if processes == 0 else workdir.with_name(f"{workdir.name}-api{processes}")
            where.mkdir(parents=True, exist_ok=True)
            out += await self._http(ckpt, where, processes)
        return out

    async def _http(self, ckpt: Path, workdir: Path, processes: int) -> list[dict]:
        a = self.a
        server = Server(ckpt, workdir, max(a.http_clients, default=256), a.frames, a, processes)
        out = []
        try:
            ready_s = await server.wait_ready(a.server_timeout)
            log(f"bench: server ready in {ready_s:.1f} s (TTS_API_PROCESSES={processes})")
            for n in a.http_clients:
                await http_level(server.url, n, min(a.frames, 8), not a.sampling)  # warm
                before = await server.metrics()
                r = await http_level(server.url, n, a.frames, not a.sampling)
                after = await server.metrics()
                r["server_loop_lag"] = loop_lag(before, after)
                r["server_time_to_engine"] = time_to_engine(before, after)
                r["server_ready_s"] = round(ready_s, 1)
                r["api_processes"] = processes
                emit({"part": "http", **r})
                out.append(r)
                if r["errors"]:
                    log("bench: server log tail:", server.tail())
            for rate in a.http_poisson_rates:
                if not self.time_left(f"http poisson {rate}"):
                    break
                count = a.poisson_count or max(1, round(rate * a.poisson_duration))
                before = await server.metrics()
                r = await http_poisson(server.url, rate, count, a.frames, not a.sampling)
                after = await server.metrics()
                r["server_loop_lag"] = loop_lag(before, after)
                r["server_time_to_engine"] = time_to_engine(before, after)
                r["api_processes"] = processes
                emit({"part": "http", **r})
                out.append(r)
                if r["errors"]:
                    log("bench: server log tail:", server.tail())
        except Exception as e:
            out.append({"error": f"{type(e).__name__}: {e}", "api_processes": processes})
            log(f"bench: http failed: {e}")
        finally:
            server.stop()
        return out

    def baselines(self) -> None:
        a, b = self.a, self.results["baselines"]
        env = {} if a.baseline_gpu is None else {"CUDA_VISIBLE_DEVICES": str(a.baseline_gpu)}
        wrapper = [sys.executable, str(REPO / "benchmarks" / "baselines" / "reference_full_length.py")]
        if "reference" in a.parts and a.reference_script and self.time_left("reference"):
            batches = ",".join(map(str, a.reference_batches))
            # Through our wrapper: rows cut at a sampled end-of-speech padded back to the length generated.
            cmd = [*wrapper, str(Path(a.reference_script).resolve()), "--size", a.reference_size]
            cmd += ["--frames", str(a.frames), "--batches", batches, "--text-tokens", "40"]
            self._baseline("reference", cmd, a.reference_site, env)
        if "peer" in a.parts and a.peer_script and self.time_left("peer"):
            # Its official (transformers-5 build) rows come from the same generate, so through the same wrapper;
            # faster-qwen3-tts's own generation does not call it.
            cmd = [*wrapper, str(Path(a.peer_script).resolve())]
            self._baseline("peer", cmd, a.peer_site, {**env, "FRAMES": str(a.frames)})
        for k, v in b.items():
            if v.get("error"):
                log(f"bench: {k} baseline error: {v['error']}")

    def _baseline(self, part: str, cmd: list[str], site: str | None, env: dict[str, str]) -> None:
        """Run one baseline's command, keep its result under `part`, emit its rows and save."""
        log(f"bench: {part} baseline:", " ".join(cmd))
        res = run_baseline(part, cmd, site, env, self.baseline_timeout())
        b = self.results["baselines"]
        with self._save_lock:
            b[part] = res
        for r in b[part]["rows"]:
            emit({"part": part, **r})
        self.save()

    async def main(self) -> None:
        # With --baseline-gpu the baselines run on that GPU beside our engine's parts, in this same run; else after.
        # With --baselines-first they run before our parts (their fixed cost first: the device's call limit then
        # cuts our last parts, whose figures are saved as each ends, not the baselines).
        side = None
        if self.a.baseline_gpu is not None:
            side = threading.Thread(target=self.baselines, name="baselines", daemon=True)
            side.start()
        elif self.a.baselines_first:
            self.baselines()
        with tempfile.TemporaryDirectory(prefix="bench_gpu_", dir=self.a.workdir) as tmp:
            for size in self.a.sizes if SIZE_PARTS & self.a.parts else []:
                await self.size(size, Path(tmp))
        if side is None:
            if not self.a.baselines_first:
                self.baselines()
        else:
            side.join(max(0.0, self.baseline_timeout() + 30))
            if side.is_alive():
                self.results["timed_out"].append("baselines")
        self.results["ratios"] = ratios(self.results)
        self.results["total_s"] = round(time.perf_counter() - self.t0, 1)
        self.save()
        print(report(self.results), flush=True)


def report(results: dict) -> str:
    """The profile lines, the ratios, then the one table (last: the device tool returns the output's tail)."""
    lines = ["", *profile_lines(results)]
    lines += [f"ratio {k}: {v}" for k, v in results.get("ratios", {}).items()]
    if results.get("skipped"):
        lines.append("skipped (time budget): " + ", ".join(results["skipped"]))
    if results.get("timed_out"):
        lines.append("timed out (--level-timeout-s): " + ", ".join(results["timed_out"]))
    m, args = results["machine"], results["args"]
    lines.append(
        f"\n{m['device']} | torch {m['torch']} | {args['frames']} frames/request | "
        f"{'sampling' if args.get('sampling') else 'greedy'} | total {results.get('total_s')} s"
    )
    lines.append(table(results))
    return "\n".join(lines)


def merge(paths: list[str]) -> dict:
    """Several runs' JSON (say, one per size and one for the baselines) as one result."""
    out: dict | None = None
    for p in paths:
        r = json.loads(Path(p).read_text())
        if out is None:
            out = r
            continue
        for size, res in r["sizes"].items():
            dst = out["sizes"].setdefault(size, {})
            for k, v in res.items():
                if isinstance(v, list):
                    dst.setdefault(k, []).extend(v)
                else:
                    dst.setdefault(k, v)
        if r.get("baselines"):
            out["baselines"].update(r["baselines"])
            out["args"]["reference_size"] = r["args"].get("reference_size", "full")
        out["skipped"] = out.get("skipped", []) + r.get("skipped", [])
        out["total_s"] = round((out.get("total_s") or 0) + (r.get("total_s") or 0), 1)
    assert out is not None
    out["ratios"] = ratios(out)
    return out


def free_memory() -> None:
    thaw_and_collect()  # an engine's frozen reference cycles (which may hold device memory) go too
    release_device_memory()  # and the cuBLAS workspaces of its streams, as a server's engine restart does


def machine() -> dict:
    dev = torch.cuda.get_device_name() if cuda() else f"CPU ({os.cpu_count()} cores)"
    return {"device": dev, "torch": torch.__version__, "python": sys.version.split()[0], "numpy": np.__version__}


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=lambda s: s.split(","), default=["1.7b", "0.6b"], help="tiny, 0.6b, 1.7b")
    ap.add_argument("--parts", type=lambda s: set(s.split(",")), default=None,
                    help=f"comma list of {','.join(PARTS)} (default: all but profile; --profile adds it)")  # fmt: skip
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="talker dtype (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--frames", type=int, default=100, help="frames per request (12.5 per second of audio)")
    ap.add_argument("--first-chunk", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=12)
    ap.add_argument("--exact-decoder", action="store_true", help="float32 Code2Wav without TF32 (exact streaming)")
    ap.add_argument(
        "--engine-variants",
        type=engine_variants,
        default=[],
        help=f"also run the engine levels with these settings, in the same run (join with + to combine): "
        f"{', '.join(VARIANTS)[2:]}",
    )
    ap.add_argument("--variant-concurrency", type=ints, default=None, help="the variants' levels (default: all)")
    ap.add_argument("--variant-poisson-rates", type=floats, default=[],
                    help="Poisson rates (requests/s) run on each --engine-variants engine too (default: none)")  # fmt: skip
    ap.add_argument("--sampling", action="store_true", help="sample (default: greedy, as the baselines' figures)")
    ap.add_argument("--concurrency", type=ints, default=[1, 4, 16, 64, 128, 256])
    ap.add_argument("--poisson-rates", type=floats, default=[5.0, 20.0])
    ap.add_argument("--poisson-duration", type=float, default=20.0, help="seconds of arrivals per rate")
    ap.add_argument("--poisson-count", type=int, default=0, help="requests per rate (overrides the duration)")
    ap.add_argument("--http-clients", type=ints, default=[1, 64])
    ap.add_argument("--http-poisson-rates", type=floats, default=[],
                    help="the http part's open-loop levels: clients arriving at these rates (--poisson-duration); "
                         "the server's max_slots is the largest --http-clients (256 without)")  # fmt: skip
    ap.add_argument("--icl-levels", type=ints, default=[1, 64], help="the icl part's levels")
    ap.add_argument("--icl-ref-frames", type=int, default=125, help="ICL reference length (12.5 frames a second)")
    ap.add_argument("--api-processes", type=ints, default=[0],
                    help="the http part once per value: TTS_API_PROCESSES of the server (0: one process)")  # fmt: skip
    ap.add_argument("--server-timeout", type=float, default=600.0)
    ap.add_argument("--profile", action="store_true", help="add the profile part")
    ap.add_argument("--profile-batches", type=ints, default=[1, 64])
    ap.add_argument("--variant-profile", action="store_true",
                    help="with --profile: profile each --engine-variants engine instead of the default one")  # fmt: skip
    ap.add_argument("--profile-steps", type=int, default=12, help="engine steps in each profile window")
    ap.add_argument("--no-profile-eager", dest="profile_eager", action="store_false",
                    help="on CUDA, skip profiling the eager engine (the per-part breakdown needs it)")  # fmt: skip
    ap.add_argument("--profile-driver", choices=["worker", "main"], default="worker",
                    help="open the profile window from the engine's thread (its ranges recorded) or this one")  # fmt: skip
    ap.add_argument("--no-module-ranges", dest="module_ranges", action="store_false",
                    help="no record_function range per outermost nn.Module call while profiling")  # fmt: skip
    ap.add_argument("--reference-script", help="the official implementation's baseline script (reference_baseline.py)")
    ap.add_argument("--reference-site", help="PYTHONPATH for it (its wheels installed with --target)")
    ap.add_argument("--reference-batches", type=ints, default=[1, 32])
    ap.add_argument("--reference-size", default="full", help="full (1.7B) or tiny")
    ap.add_argument("--peer-script", help="faster-qwen3-tts baseline script (peer_baseline.py)")
    ap.add_argument("--peer-site", help="PYTHONPATH for it")
    ap.add_argument("--baseline-timeout", type=float, default=900.0)
    ap.add_argument("--baseline-gpu", type=int, default=None,
                    help="run the baselines on this GPU (its index) at the same time as our parts, not after")  # fmt: skip
    ap.add_argument("--baselines-first", action="store_true", help="run the baselines before our parts, not after")
    ap.add_argument("--tokenizer-dir", help="a real Qwen2 tokenizer for the full-size checkpoints")
    ap.add_argument("--workdir", help="where checkpoints are written (default: the system temp dir)")
    ap.add_argument("--time-budget-s", type=float, default=0.0, help="skip parts that would start after this")
    ap.add_argument("--level-timeout-s", type=float, default=0.0,
                    help="give up an engine level (and that engine's later levels) after this; 0: never")  # fmt: skip
    ap.add_argument("--out", default="bench_out/bench_gpu.json")
    ap.add_argument("--table-from", nargs="+", metavar="JSON",
                    help="(first argument only) print the merged table of earlier runs' JSON and exit")  # fmt: skip
    a = ap.parse_args(argv)
    if a.parts is None:
        a.parts = set(PARTS) - {"profile"}
    if a.profile:
        a.parts.add("profile")
    unknown = a.parts - set(PARTS)
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)} (known: {','.join(PARTS)})")
    return a


def main(argv: list[str] | None = None) -> dict:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--table-from"]:  # --table-from A.json B.json ...: print the merged table, run nothing
        results = merge(argv[1:])
        print(report(results))
        return results
    a = parse_args(argv)
    run = Run(a)
    asyncio.run(run.main())
    return run.results


if __name__ == "__main__":
    main()
