"""The native engine's prefill: one talker forward over a group of prompts, from CUDA graphs on CUDA.

Eager, a prefill is ~1,600 small launches whatever its size (28 layers of norms, projections, RoPE, cache writes,
attention): on an H200 37 ms of host time for 5 ms of device work, which was most of a lone request's time to
first audio and saturated the engine loop at 20 arrivals per second. `PrefillRunner` pads a group to a (batch,
length) bucket and replays the graph captured for it.

Padding: rows are padded with zeros after their prompt, at later positions, so causal masking keeps the padding
invisible to the real tokens; its K/V lands in the row's cache after the prompt and is overwritten by the first
decode steps before any query can see it. Padding rows write to the scratch slot. Each row's hidden state at its
last prompt position is gathered inside the graph.

Modes: "exact" (eager at the group's own shape: the CPU default), "padded" (eager at the bucket shape; the CUDA
path when frame steps are eager, so eager and graphed engines prefill at the same shapes), "graphs".
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from qwen_tts.model.layers import KVCache, upload
from qwen_tts.model.talker import Talker

from .frame_step import batch_buckets, bucket, capture_graph, capture_stream, kv_buckets

log = logging.getLogger("qwen_tts.prefill")

MIN_LEN_BUCKET = 32


def len_buckets(max_len: int) -> list[int]:
    """Prompt-length buckets: powers of two from MIN_LEN_BUCKET below max_len, then max_len."""
    return kv_buckets(max_len, MIN_LEN_BUCKET)


class PrefillRunner:
    """Prefill groups of up to `max_batch` prompts of up to `max_len` tokens; a group's padded size (batch bucket x
    length bucket) stays within `max_tokens` unless it is a single prompt."""

    def __init__(
        self,
        talker: Talker,
        cache: KVCache,
        scratch: int,
        max_batch: int,
        max_len: int,
        max_tokens: int,
        mode: str,
    ):
        if mode not in ("exact", "padded", "graphs"):
            raise ValueError(f"prefill mode must be exact, padded or graphs, not {mode!r}")
        self.talker, self.cache, self.scratch, self.mode = talker, cache, scratch, mode
        self.max_tokens = max_tokens
        self.len_buckets = len_buckets(min(max_len, cache.max_len))
        self.batch_buckets = batch_buckets(max_batch)
        w = talker.codec_head.weight
        self.device, self.dtype, self.hidden = w.device, w.dtype, w.shape[1]
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict[str, Tensor]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if mode == "graphs" else None
        self._side = capture_stream(self.device) if mode == "graphs" else None

    def shape(self, n: int, longest: int) -> tuple[int, int]:
        """The (batch, length) a group of n prompts whose longest has `longest` tokens runs at."""
        if self.mode == "exact":
            return n, longest
        return bucket(n, self.batch_buckets), bucket(longest, self.len_buckets)

    def fits(self, n: int, longest: int) -> bool:
        """Whether n prompts (the longest `longest` tokens) may share one prefill."""
        if n == 1:
            return True
        if n > self.batch_buckets[-1]:
            return False
        B, T = self.shape(n, longest)
        return self.max_tokens >= B * T

    def _forward(self, embeds: Tensor, slots: Tensor, last: Tensor) -> Tensor:
        B, T, _ = embeds.shape
        pos = torch.arange(T, device=embeds.device).expand(B, T)
        hidden = self.talker(embeds, pos, self.cache, slots, T)
        return hidden[torch.arange(B, device=embeds.device), last]

    def run(self, prompts: list[Tensor], slots: list[int]) -> Tensor:
        """Prefill `prompts` ((L_i, H) each) into `slots`; returns each row's last hidden state (n, H)."""
        n = len(prompts)
        lens = [p.shape[0] for p in prompts]
        B, T = self.shape(n, max(lens))
        key = (B, T)
        if self.mode == "graphs" and key not in self._graphs:
            self._capture(B, T)
        if key in self._graphs:
            _, buf = self._graphs[key]
            embeds = buf["embeds"]
            embeds.zero_()
        else:
            embeds = torch.zeros(B, T, self.hidden, device=self.device, dtype=self.dtype)
        if n > 1:  # the group's prompts copied into its input in one launch, not one each
            rows = [i * T + t for i, n_ in enumerate(lens) for t in range(n_)]
            embeds.view(B * T, -1).index_copy_(0, upload(rows, torch.long, self.device), torch.cat(prompts))
        else:
            embeds[0, : lens[0]] = prompts[0]
        slot_t = upload(slots + [self.scratch] * (B - n), torch.long, self.device)
        last_t = upload([n_ - 1 for n_ in lens] + [0] * (B - n), torch.long, self.device)
        if key in self._graphs:
            graph, buf = self._graphs[key]
            buf["slots"].copy_(slot_t)
            buf["last"].copy_(last_t)
            graph.replay()
            return buf["out"][:n].clone()
        return self._forward(embeds, slot_t, last_t)[:n]

    def _capture(self, B: int, T: int) -> None:
        dev = self.device
        buf = {
            "embeds": torch.zeros(B, T, self.hidden, device=dev, dtype=self.dtype),
            "slots": torch.full((B,), self.scratch, dtype=torch.long, device=dev),
            "last": torch.zeros(B, dtype=torch.long, device=dev),
        }
        try:  # two warm-up calls (library plans, lazy init) write the scratch slot only
            graph, buf["out"] = capture_graph(
                lambda: self._forward(buf["embeds"], buf["slots"], buf["last"]), self._side, self._pool, dev, warmups=2
            )
        except RuntimeError as e:  # prefill eagerly rather than not at all
            log.warning("prefill graph (%d, %d) not captured; uncaptured buckets run eagerly: %s", B, T, e)
            torch.cuda.synchronize(dev)
            self.mode = "padded"  # the graphs captured so far are still replayed
            return
        self._graphs[(B, T)] = (graph, buf)

    def capture_all(self) -> None:
        """Capture every bucket a group can run at, longest first (the graphs share one memory pool)."""
        if self.mode != "graphs":
            return
        t0 = time.perf_counter()
        for T in reversed(self.len_buckets):
            for B in reversed(self.batch_buckets):
                if (B == 1 or self.max_tokens >= B * T) and (B, T) not in self._graphs:
                    self._capture(B, T)
                    if self.mode != "graphs":
                        return
        torch.cuda.synchronize(self.device)
        log.info("%d prefill graphs ready in %.1fs", len(self._graphs), time.perf_counter() - t0)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)
