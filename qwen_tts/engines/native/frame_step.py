"""The native engine's frame step: one batched decode step as a fixed-shape function, and its two runners.

`frame_step` advances every row by one codec frame. `EagerFrameStep` calls it at exact shapes (the CPU path);
`FrameStepRunner` pads rows to fixed (batch, kv-length) buckets and replays a CUDA graph per bucket (or runs the
same padded step eagerly, to test its padding on CPU). Both share the slot-indexed `SlotState` and the KV cache.

Our own code (no official counterpart): the batched equivalent of one iteration of qwen-tts 0.1.1 MQ
`Qwen3TTSForConditionalGeneration.generate`'s talker loop (talker logits -> HF logits processors -> sample cb0 ->
`code_predictor.generate` for the 15 residual codes -> next input embedding -> one talker step), written so that
every shape is fixed and nothing syncs with the host.

Capture strategy. Eager, one frame step is ~3000 small kernels (28 talker layers, 15 code-predictor steps of 5
layers, sampling) and launch/Python bound. `frame_step` is captured once per (batch bucket, kv bucket):
- rows are gathered from slot-indexed state by a static slot-index buffer; a batch smaller than its bucket is
  padded with rows that point at a scratch slot (the last one: the cache and state hold max_slots + 1 slots),
  so padding never touches a live request's cache;
- kv_len is the kv bucket (powers of two from 256, then the cache length); rows attend only to their own
  positions <= their query position, so a longer kv_len only adds masked keys;
- inputs (slot, frame index, min frames, cache position per row, and the (B, H) text-track rows) are copied into
  static buffers before a replay; the codes (B, 16) land in a static buffer, read back with the step's one sync.
Rows that sample end-of-speech in a step also get their code predictor and talker step computed (the graph cannot
branch on the sample): harmless, their slot is freed and fully reset (prefill, sampling state) on reuse.
Graphs share one memory pool: they are replayed one at a time and their outputs are copied to static buffers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from qwen_tts.fastpath import sample_kernel
from qwen_tts.fastpath.step import FastStep
from qwen_tts.model.layers import KVCache
from qwen_tts.model.sampling import apply_repetition_penalty, mask_eos, sample, suppress
from qwen_tts.model.talker import Talker

log = logging.getLogger("qwen_tts.frame_step")

# Codebook positions per frame in the sampling counter (cb0 + 15 residual codebooks).
COUNTER_STRIDE = 16
MIN_KV_BUCKET = 256


@dataclass
class SlotState:
    """Per-slot device state of the batched step (slots: the first dim of h and seen, the last of the packed
    settings); the engine keeps one slot as scratch.

    The sampling settings live in three packed tensors, one row a setting, so a step gathers its rows' settings in
    three index kernels instead of eleven; the named properties are views of their rows (writes go to the packs)."""

    h: Tensor  # (S, H) last talker hidden state, the input of the next step's logits
    seen: Tensor  # (S, V) bool: ids generated so far (repetition penalty)
    floats: Tensor  # (5, S) float32: rep, temp, top_p, cp_temp, cp_top_p
    ints: Tensor  # (3, S) int64: top_k, cp_top_k, seed
    flags: Tensor  # (2, S) bool: greedy, cp_greedy

    @classmethod
    def zeros(cls, slots: int, hidden: int, vocab: int, device: torch.device, dtype: torch.dtype) -> SlotState:
        floats = torch.ones(5, slots, device=device, dtype=torch.float32)
        return cls(
            h=torch.zeros(slots, hidden, device=device, dtype=dtype),
            seen=torch.zeros(slots, vocab, device=device, dtype=torch.bool),
            floats=floats,
            ints=torch.zeros(3, slots, device=device, dtype=torch.long),
            flags=torch.zeros(2, slots, device=device, dtype=torch.bool),
        )

    rep = property(lambda self: self.floats[0])  # (S,) float32 repetition penalty
    temp = property(lambda self: self.floats[1])
    top_p = property(lambda self: self.floats[2])
    cp_temp = property(lambda self: self.floats[3])
    cp_top_p = property(lambda self: self.floats[4])
    top_k = property(lambda self: self.ints[0])  # (S,) int64
    cp_top_k = property(lambda self: self.ints[1])
    seed = property(lambda self: self.ints[2])
    greedy = property(lambda self: self.flags[0])  # (S,) bool
    cp_greedy = property(lambda self: self.flags[1])

    def settings(self, slots: Tensor) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...], Tensor]:
        """The rows' sampling settings, gathered in three kernels: (temp, top_k, top_p, greedy, seed) for cb0, the
        same for the residual codes, and the repetition penalty; each a contiguous (B,) tensor."""
        rep, temp, top_p, cp_temp, cp_top_p = self.floats[:, slots].unbind(0)
        top_k, cp_top_k, seed = self.ints[:, slots].unbind(0)
        greedy, cp_greedy = self.flags[:, slots].unbind(0)
        return (temp, top_k, top_p, greedy, seed), (cp_temp, cp_top_k, cp_top_p, cp_greedy, seed), rep


def fast_step(talker: Talker) -> FastStep | None:
    """The fast path the talker was handed (`qwen_tts.fastpath.build`), or None (its own modules)."""
    return talker.kernels if isinstance(talker.kernels, FastStep) else None


def frame_step(
    talker: Talker,
    state: SlotState,
    cache: KVCache,
    suppressed: Tensor,
    eos_id: int,
    slots: Tensor,
    frames: Tensor,
    min_frames: Tensor,
    positions: Tensor,
    text: Tensor,
    kv_len: int,
) -> Tensor:
    """One frame for every row: codes (B, 16) = [cb0, 15 residual codes]; advances h, seen and the KV cache.

    slots, frames (frames generated so far), min_frames, positions (next cache position) are (B,) int64; text (B, H)
    is the text-track row added to each next input. Fixed shapes, no host sync: safe to capture.
    """
    h = state.h[slots]
    tk, cp, rep = state.settings(slots)
    fast = fast_step(talker)  # qwen_tts/fastpath: the same function in fewer kernels
    if fast is not None:
        logits = fast.compiled("talker_logits")(
            talker.logits(h), state.seen[slots], rep, suppressed, eos_id, frames < min_frames
        )
    else:
        logits = talker.logits(h).float()
        logits = apply_repetition_penalty(logits, state.seen[slots], rep)
        logits = suppress(logits, suppressed)
        logits = mask_eos(logits, eos_id, frames < min_frames)
    counters = frames * COUNTER_STRIDE
    feed = None
    if fast is not None and fast.kernel_sampler:  # one Triton launch per draw, no sort (sample_kernel.py)
        we = fast.warp_elements
        cb0 = sample_kernel.sample(logits, *tk, counters, warp_elements=we)

        def sample_residual(j: int, cp_logits: Tensor) -> Tensor:
            return sample_kernel.sample(cp_logits, *cp, counters, j + 1, warp_elements=we)

        if fast.cp_fused_feed:

            def feed(j: int, cp_logits: Tensor, codes: Tensor, table_e: Tensor, codec_sum: Tensor, table_x, x) -> None:
                sample_kernel.sample_feed(
                    cp_logits, *cp, counters, j + 1, codes, table_e, codec_sum, table_x, x, warp_elements=we
                )

    else:
        sampler = fast.compiled("sample") if fast is not None else sample
        cb0 = sampler(logits, *tk, counters)

        def sample_residual(j: int, cp_logits: Tensor) -> Tensor:
            return sampler(cp_logits.float(), *cp, counters + (j + 1))

    cb0_emb = talker.embed_codec(cb0)
    with record_function("code_predictor"):  # profiler ranges (host side only: free inside a graph)
        residual, codec_sum = talker.residual_codes(h, cb0_emb, sample_residual, feed)
    # A tensor value, not a Python scalar: index_put_ of a host scalar is not capturable.
    state.seen[slots, cb0] = torch.ones((), dtype=torch.bool, device=slots.device)
    nxt = (codec_sum + text.to(codec_sum.dtype))[:, None]
    with record_function("talker"):
        out = talker(nxt, positions[:, None], cache, slots, kv_len)
    state.h[slots] = out[:, 0]
    return torch.cat([cb0[:, None], residual], dim=1)


class StepCodes:
    """The codes (n, 16) of a launched frame step, on their way to the host: `result()` waits for them."""

    def __init__(self, host: Tensor, done: torch.cuda.Event | None) -> None:
        self._host, self._done = host, done

    def result(self) -> Tensor:
        """The codes as a new CPU tensor (blocks until the step and its copy have run)."""
        if self._done is not None:
            self._done.synchronize()
        return self._host.clone()


class EagerFrameStep:
    """Runs `frame_step` eagerly at the exact shapes of each step (no padding, no buckets)."""

    use_graphs = False

    def __init__(self, talker: Talker, state: SlotState, cache: KVCache, suppressed: Tensor, eos_id: int) -> None:
        self._fixed = (talker, state, cache, suppressed, eos_id)  # frame_step's leading arguments
        self._device = state.h.device

    def launch(
        self, slots: list[int], frames: list[int], min_frames: list[int], positions: list[int], text: list[Tensor]
    ) -> StepCodes:
        """One frame for each row, computed now (eager); `result()` returns the codes (n, 16) on the CPU."""
        rows = torch.tensor([slots, frames, min_frames, positions], device=self._device)
        return StepCodes(frame_step(*self._fixed, *rows, torch.stack(text), max(positions) + 1).cpu(), None)

    def step(self, *rows) -> Tensor:
        """`launch(...).result()`: the codes (n, 16) on the CPU (the step's one host sync)."""
        return self.launch(*rows).result()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream a runner warms up and captures all its graphs on. cuBLAS keeps a workspace (32 MiB on
    Hopper) for every stream it ran on, for the life of the process: a new side stream for each capture left one
    behind per graph, 0.82 GiB of the 0.6B engine's 3.08 GiB on an H100 (docs/history/benchmarks-diary.md, twenty-sixth round).
    The warm-up and the capture on the same stream also give the capture the workspace made outside it."""
    return torch.cuda.Stream(device)


def capture_graph(
    run: Callable[[], Any], side: torch.cuda.Stream, pool, device: torch.device | None = None, warmups: int = 1
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm `run` up on the runner's side stream (`warmups` calls, so library handles, plans and workspaces are made
    outside the capture), then capture one call of it into a graph on that stream and the memory pool `pool`;
    returns the graph and what the captured call returned (its output buffers)."""
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
        out = run()
    return graph, out


def batch_buckets(max_rows: int) -> list[int]:
    """Powers of two below max_rows, then max_rows."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    return [*out, max_rows]


def kv_buckets(max_len: int, smallest: int = MIN_KV_BUCKET) -> list[int]:
    """Powers of two from `smallest` below max_len, then max_len."""
    out, k = [], smallest
    while k < max_len:
        out.append(k)
        k *= 2
    return [*out, max_len]


def bucket(value: int, buckets: list[int]) -> int:
    """The smallest bucket >= value."""
    for b in buckets:
        if value <= b:
            return b
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")


def one_row_steps(talker: Talker) -> bool:
    """Whether a lone row's frame step can run as one row and still get the bits it gets beside others
    (`FastStep.one_row_steps`: both decoder stacks by the CUDA stack kernel and the heads by the few-row kernel).
    Then one stream's steps skip the padding row: its passes are one row, not two (docs/performance.md)."""
    fast = fast_step(talker)
    return fast is not None and fast.one_row_steps()


class FrameStepRunner:
    """Runs `frame_step` for up to `max_rows` rows, padded to a batch bucket, from CUDA graphs or eagerly.

    `scratch` is the slot padding rows use. With `use_graphs=False` the same padded, bucketed computation runs
    eagerly (CPU tests of the padding and bucketing logic use this).
    """

    def __init__(
        self,
        talker: Talker,
        state: SlotState,
        cache: KVCache,
        suppressed: Tensor,
        eos_id: int,
        max_rows: int,
        scratch: int,
        use_graphs: bool,
    ) -> None:
        if not 0 <= scratch < cache.slots:
            raise ValueError(f"scratch slot {scratch} is outside the cache's {cache.slots} slots")
        self.talker, self.state, self.cache = talker, state, cache
        self.suppressed, self.eos_id, self.scratch = suppressed, eos_id, scratch
        self.use_graphs = use_graphs
        self.batch_buckets = batch_buckets(max_rows)
        fast = fast_step(talker) is not None
        if fast and self.batch_buckets[0] == 1 and max_rows > 1 and not one_row_steps(talker):
            # The fused path runs a lone row as two copies (fused.compiled); a graph padded to two rows with the
            # scratch slot gets the same bits without the copies.
            self.batch_buckets = self.batch_buckets[1:]
        # The fused path attends over each row's own positions whatever kv_len: one kv bucket is enough.
        self.kv_buckets = [cache.max_len] if fast else kv_buckets(cache.max_len, MIN_KV_BUCKET)
        dev = state.h.device
        B = self.batch_buckets[-1]
        # Rows: slot, frames, min_frames, position. Pinned, so the per-step upload is one async copy. Two of each
        # host buffer, used in turn: a step may be launched while the one before still runs (`launch`).
        pin = dev.type == "cuda"
        self._host = [torch.zeros(4, B, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._host_codes = [torch.zeros(B, COUNTER_STRIDE, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self._inputs = torch.zeros(4, B, dtype=torch.long, device=dev)
        self._text = torch.zeros(B, state.h.shape[1], dtype=state.h.dtype, device=dev)
        self._codes = torch.zeros(B, COUNTER_STRIDE, dtype=torch.long, device=dev)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self._side = capture_stream(dev) if use_graphs else None
        # The code predictor's scratch cache must exist before capture, at the largest batch.
        talker.code_predictor.reserve(B, dev, state.h.dtype)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _run(self, B: int, kv_len: int) -> None:
        slots, frames, min_frames, positions = self._inputs[:, :B]
        codes = frame_step(
            self.talker,
            self.state,
            self.cache,
            self.suppressed,
            self.eos_id,
            slots,
            frames,
            min_frames,
            positions,
            self._text[:B],
            kv_len,
        )
        self._codes[:B].copy_(codes)

    def _capture(self, B: int, kv_len: int) -> torch.cuda.CUDAGraph:
        t0 = time.perf_counter()
        # Every row on the scratch slot: the warm-up run and the capture touch no live request.
        self._inputs[:, :B].zero_()
        self._inputs[0, :B].fill_(self.scratch)
        graph, _ = capture_graph(lambda: self._run(B, kv_len), self._side, self._pool)
        self._graphs[(B, kv_len)] = graph
        log.info("captured the frame step for batch %d, kv_len %d in %.2fs", B, kv_len, time.perf_counter() - t0)
        return graph

    def capture_all(self) -> None:
        """Capture every (batch bucket, kv bucket) graph now rather than on first use."""
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        for kv_len in self.kv_buckets:
            for B in self.batch_buckets:
                if (B, kv_len) not in self._graphs:
                    self._capture(B, kv_len)
        log.info("%d frame-step graphs ready in %.1fs", len(self._graphs), time.perf_counter() - t0)

    def launch(
        self, slots: list[int], frames: list[int], min_frames: list[int], positions: list[int], text: list[Tensor]
    ) -> StepCodes:
        """Queue one frame for each row (all lists of length n) and the copy of its codes to the host; returns at
        once on CUDA. `result()` waits for the codes (n, 16): the step's one host sync.

        At most two launched steps may be unread: the caller reads a step's codes before launching the step after
        next (the two host buffers are used in turn). Steps run in launch order on the current stream.
        """
        n = len(slots)
        B = bucket(n, self.batch_buckets)
        kv_len = bucket(max(positions) + 1, self.kv_buckets)
        graph = None
        if self.use_graphs:
            graph = self._graphs.get((B, kv_len)) or self._capture(B, kv_len)
        host, out = self._host[self._turn], self._host_codes[self._turn]
        self._turn ^= 1
        host[:, :n] = torch.tensor([slots, frames, min_frames, positions], dtype=torch.long)
        host[0, n:B] = self.scratch
        host[1:, n:B] = 0
        # This pinned buffer is refilled two launches from now, once this step's codes were read: its copy is done.
        self._inputs[:, :B].copy_(host[:, :B], non_blocking=True)
        self._text[:n].copy_(torch.stack(text))
        if graph is not None:
            graph.replay()
        else:
            self._run(B, kv_len)
        out[:n].copy_(self._codes[:n], non_blocking=True)
        done = None
        if self._codes.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return StepCodes(out[:n], done)

    def step(self, *rows) -> Tensor:
        """`launch(...).result()`: one frame for each row, the codes (n, 16) as a new CPU tensor."""
        return self.launch(*rows).result()
