"""The native engine's streaming Code2Wav: slot-indexed state, batched chunks, CUDA graphs, a thread of its own.

`SlotDecoder` keeps every slot's exact streaming state (`Code2WavStream`) in one batched stream with a row per KV
slot (plus a scratch row for padding). A chunk of n rows gathers their state by slot index, decodes, and scatters
the new state back: two kernels per state tensor whatever n (per-row `cat`/`split` copies were 38 x n kernels),
and a fixed (batch bucket, chunk length) shape, so on CUDA each bucket is one CUDA-graph replay instead of ~1,000
launches. A row that starts a request is marked fresh: its gathered state is zero (the causal zero padding)
whatever its slot held before. Chunks shorter than their bucket are padded with code 0 at the end and trimmed:
the decoder is causal, so the real frames' samples do not see the padding (only the final chunk of a request is
ever short, and a finished request's state is never read again). An ICL request starts instead from the state after
its voice's reference codes (`start_from`: decoded once per voice, then copied into the slot), so its audio is the
decode of reference + generated codes with the reference part cut, and its first chunk waits for no reference.

`DecodeWorker` runs the chunks in order on a thread (and CUDA stream) of its own, beside the frame steps: the
engine loop hands a chunk over and goes on stepping; the worker delivers the audio. A request's chunks run in
submission order. First chunks go ahead of later ones (they decide time to first audio, and a first chunk never
has an earlier chunk of its own request queued), and queued chunks of the same shape are merged into one batch
when the worker gets to them, so a worker that falls behind decodes bigger batches instead of more of them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qwen_tts.model.codec_decoder import Code2Wav, Code2WavStream

from .frame_step import batch_buckets, bucket, capture_graph, capture_stream

log = logging.getLogger("qwen_tts.decoder")

DecodeMode = str  # "exact" | "padded" | "graphs"


@contextlib.contextmanager
def _tf32_matmuls(on: bool):
    """cuBLAS's float32 matmuls in TF32 inside the block (when `on`), as they were after it."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = before or on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _state_tensors(s: Code2WavStream) -> list[Tensor]:
    return [s.position, *s.conv_history, *s.tconv_overlap, *s.keys, *s.values]


def _stream_of(ts: list[Tensor], like: Code2WavStream) -> Code2WavStream:
    a, b, c = len(like.conv_history), len(like.tconv_overlap), len(like.keys)
    return Code2WavStream(
        position=ts[0],
        conv_history=ts[1 : 1 + a],
        tconv_overlap=ts[1 + a : 1 + a + b],
        keys=ts[1 + a + b : 1 + a + b + c],
        values=ts[1 + a + b + c :],
    )


class SlotDecoder:
    """Streaming Code2Wav over slot-indexed state for `max_slots` slots (slot `max_slots` is scratch).

    mode "exact": eager at each chunk's own shape (the CPU default). "padded": eager, padded to the (batch, chunk
    length) buckets (tests the padding on CPU). "graphs": the padded chunk replayed from a CUDA graph per bucket.
    `chunk_lens` are the chunk lengths the engine asks for; a shorter chunk is padded to the next one. A call
    decodes at most `max_batch` rows (default: max_slots). `tf32_matmul`: the graphs' float32 matmuls (the
    pre-transformer's) run in TF32, as the convolutions do with cuDNN's TF32; cuBLAS's switch is process-wide, so
    it is on only while a graph is captured (the graph keeps the kernels it captured), never for the talker's or an
    encoder's matmuls.
    """

    def __init__(
        self,
        code2wav: Code2Wav,
        max_slots: int,
        chunk_lens: list[int],
        mode: DecodeMode,
        max_batch: int = 0,
        tf32_matmul: bool = False,
    ):
        if mode not in ("exact", "padded", "graphs"):
            raise ValueError(f"decode mode must be exact, padded or graphs, not {mode!r}")
        self.c2w = code2wav
        self.mode = mode
        self.tf32_matmul = tf32_matmul
        self.scratch = max_slots
        self.device = next(code2wav.parameters()).device
        self.num_quantizers = code2wav.cfg.num_quantizers
        self.upsample = code2wav.total_upsample
        self.batch_buckets = batch_buckets(max_batch or max_slots)
        self.chunk_lens = sorted(set(chunk_lens))
        self.state = code2wav.new_stream(max_slots + 1)
        self._tensors = _state_tensors(self.state)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict[str, Tensor]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if mode == "graphs" else None
        self._side = capture_stream(self.device) if mode == "graphs" else None
        self.references_decoded = 0  # ICL voices whose reference codes this decoder has run (`decode_reference`)
        # Pinned host buffers of the largest bucket for the graphs' inputs and audio (views of them serve smaller
        # buckets), so the copy back does not block the engine loop.
        self._host: dict[str, Tensor] = self._pinned_buffers() if mode == "graphs" else {}

    def _pinned_buffers(self) -> dict[str, Tensor]:
        B, T = self.batch_buckets[-1], max(self.chunk_lens)
        pin = dict(pin_memory=True)
        return {
            "idx": torch.zeros(B, dtype=torch.long, **pin),
            "fresh": torch.zeros(B, dtype=torch.bool, **pin),
            "codes": torch.zeros(B * self.num_quantizers * T, dtype=torch.long, **pin),
            "wav": torch.zeros(B * T * self.upsample, dtype=torch.float32, **pin),
        }

    def padded_len(self, t: int) -> int:
        """The chunk length a chunk of t frames is decoded at."""
        return t if self.mode == "exact" else bucket(t, self.chunk_lens)

    def decode_reference(self, voice: Any) -> None:
        """Decode `voice`'s reference codes (an `icl_cache.IclVoice`) once, keeping Code2Wav's state after them on
        the voice."""
        if voice.decoder_state is None:
            stream = self.c2w.new_stream(1)
            self.c2w.decode_chunk(voice.codes.T[None].to(self.device), stream)
            voice.decoder_state = _state_tensors(stream)
            self.references_decoded += 1

    def start_from(self, slot: int, voice: Any) -> None:
        """Set `slot`'s state to Code2Wav's after `voice`'s reference codes (`decode_reference`); decode the slot's
        next chunk as not fresh."""
        self.decode_reference(voice)
        idx = torch.tensor([slot], device=self.device)
        for t, s in zip(self._tensors, voice.decoder_state, strict=True):
            t.index_copy_(0, idx, s)

    def _chunk(self, idx: Tensor, fresh: Tensor, codes: Tensor) -> Tensor:
        """Gather rows `idx` (fresh ones as zeros), decode `codes` (B, Q, T), scatter the state back."""
        keep = ~fresh
        sub = []
        for t in self._tensors:
            g = t.index_select(0, idx)
            sub.append(torch.where(keep.view(-1, *([1] * (g.dim() - 1))), g, 0))
        stream = _stream_of(sub, self.state)
        wav = self.c2w.decode_chunk(codes, stream)
        for t, s in zip(self._tensors, _state_tensors(stream), strict=True):
            t.index_copy_(0, idx, s)
        return wav

    def decode(self, slots: list[int], fresh: list[bool], codes: Tensor) -> Tensor:
        """Decode the next chunk of each row: codes (n, Q, T) (T = `padded_len` of the chunk) -> (n, T * upsample)
        float32 on the CPU. Rows of one call must be distinct slots."""
        n, _, T = codes.shape
        if self.mode == "exact":
            idx = torch.tensor(slots, device=self.device)
            fr = torch.tensor(fresh, device=self.device)
            return self._chunk(idx, fr, codes.to(self.device)).float().cpu()
        B = bucket(n, self.batch_buckets)
        pad = B - n
        idx = torch.tensor(slots + [self.scratch] * pad)
        fr = torch.tensor(fresh + [True] * pad)
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, *codes.shape[1:])])
        if self.mode == "padded":
            wav = self._chunk(idx.to(self.device), fr.to(self.device), codes.to(self.device))
            return wav[:n].float().cpu()
        graph, buf = self._graphs.get((B, T)) or self._capture(B, T)
        h = self._host
        h["idx"][:B].copy_(idx)
        h["fresh"][:B].copy_(fr)
        h_codes = h["codes"][: codes.numel()].view(codes.shape)
        h_codes.copy_(codes)
        # Pinned, so each upload is an async copy (a pageable one syncs the stream first) and the host buffers are
        # free again once `done` has passed, which this call waits for.
        buf["idx"].copy_(h["idx"][:B], non_blocking=True)
        buf["fresh"].copy_(h["fresh"][:B], non_blocking=True)
        buf["codes"].copy_(h_codes, non_blocking=True)
        graph.replay()
        wav = buf["wav"][:n]
        wav = wav if wav.dtype == torch.float32 else wav.float()
        out = h["wav"][: wav.numel()].view(wav.shape)
        out.copy_(wav, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        # Waiting on an event lets the engine thread run meanwhile; a blocking copy to pageable memory held it up
        # for as long as the chunk took on the GPU (docs/history/benchmarks-diary.md, twenty-seventh round).
        done.synchronize()
        return out.clone()  # the pinned buffer is the next call's

    def _capture(self, B: int, T: int) -> tuple[torch.cuda.CUDAGraph, dict[str, Tensor]]:
        dev = self.device
        buf = {
            "idx": torch.full((B,), self.scratch, dtype=torch.long, device=dev),
            "fresh": torch.ones(B, dtype=torch.bool, device=dev),
            "codes": torch.zeros(B, self.num_quantizers, T, dtype=torch.long, device=dev),
        }
        # Two warm-up calls (cuDNN plans, lazy init) touch the scratch row only.
        with _tf32_matmuls(self.tf32_matmul):
            graph, buf["wav"] = capture_graph(
                lambda: self._chunk(buf["idx"], buf["fresh"], buf["codes"]), self._side, self._pool, dev, warmups=2
            )
        self._graphs[(B, T)] = (graph, buf)
        return graph, buf

    def capture_all(self) -> None:
        """Capture every (batch bucket, chunk length) graph now, largest first (they share one memory pool)."""
        if self.mode != "graphs":
            return
        t0 = time.perf_counter()
        for T in sorted(self.chunk_lens, reverse=True):
            for B in reversed(self.batch_buckets):
                if (B, T) not in self._graphs:
                    self._capture(B, T)
        torch.cuda.synchronize(self.device)
        log.info("%d Code2Wav graphs ready in %.1fs", len(self._graphs), time.perf_counter() - t0)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)


@dataclass(eq=False)
class DecodeJob:
    """The next chunk of each of `rows` (distinct requests): codes (n, Q, T) on the CPU, each row's real length."""

    rows: list[Any]  # the engine's RequestState, one per row
    slots: list[int]
    lengths: list[int]
    codes: Tensor
    first: bool  # every row's first chunk
    fresh: list[bool]  # rows whose state starts at zero (a request's first chunk)
    key: tuple  # jobs of equal key may be merged into one batch
    # Per row, an ICL request's first chunk: its voice (icl_cache.IclVoice), whose reference state the row starts
    # from instead of zero; None otherwise (or no list: none).
    starts: list[Any] | None = None
    reference: Any = None  # a job with no rows that decodes this ICL voice's reference ahead of its first chunk


class DecodeWorker:
    """Runs `DecodeJob`s through a `SlotDecoder`, on a thread and CUDA stream of its own (threaded) or inline.

    deliver(row, codes (Q, t), wav (t * upsample,)) is called for each row of a finished job, fail(row, message)
    for each row of a job that failed, both on the worker thread; then `cv` is notified (the engine loop waits on
    it). `inflight(row)` counts a row's jobs not yet finished; `backlog` the jobs not yet started.
    """

    def __init__(
        self,
        decoder: SlotDecoder,
        deliver: Callable[[Any, Tensor, Tensor], None],
        fail: Callable[[Any, str], None],
        cv: threading.Condition,
        threaded: bool,
        max_batch: int,
        timings: dict[str, float],
        gpu_guard: AbstractContextManager | None = None,
    ):
        self.decoder = decoder
        # Held around each decode call: the engine's lock while graphs are captured lazily (runner.py), else none.
        self._gpu_guard = gpu_guard if gpu_guard is not None else contextlib.nullcontext()
        self._deliver, self._fail, self._cv = deliver, fail, cv
        self.threaded = threaded
        self.max_batch = max_batch
        self._timings = timings
        self._queue: list[DecodeJob] = []  # guarded by _qcv (the worker sleeps on it)
        self._qcv = threading.Condition()
        self._inflight: dict[int, int] = {}  # id(row) -> jobs not finished; guarded by cv
        self.completed = 0  # jobs finished; guarded by cv
        self._closing = False
        self._cuda_stream = None
        self._thread: threading.Thread | None = None
        if threaded:
            if decoder.device.type == "cuda":
                self._cuda_stream = torch.cuda.Stream(decoder.device)
                self._cuda_stream.wait_stream(torch.cuda.current_stream(decoder.device))  # the zeroed state
            self._thread = threading.Thread(target=self._loop, name="qwen-tts-decoder", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ engine side
    def submit(self, job: DecodeJob) -> None:
        with self._cv:
            for lv in job.rows:
                self._inflight[id(lv)] = self._inflight.get(id(lv), 0) + 1
        if self.threaded:
            with self._qcv:
                self._queue.append(job)
                self._qcv.notify()
        else:
            self._run_batch([job])

    def decode_reference(self, voice: Any) -> None:
        """Decode an ICL voice's reference on the worker now (at admission), so the first chunk of its request
        does not wait for it."""
        codes = torch.zeros(0, self.decoder.num_quantizers, 0, dtype=torch.long)
        self.submit(DecodeJob([], [], [], codes, first=True, fresh=[], key=("reference", id(voice)), reference=voice))

    def inflight(self, row: Any) -> int:
        return self._inflight.get(id(row), 0)

    @property
    def busy(self) -> bool:
        return bool(self._inflight)

    @property
    def backlog(self) -> int:
        return len(self._queue)

    def close(self, timeout: float = 30.0) -> None:
        with self._qcv:
            self._closing = True
            self._qcv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ------------------------------------------------------------------ worker side
    def _take(self) -> list[DecodeJob]:
        """Pop the next batch (_qcv held): the oldest first-chunk job, else the oldest job, with every later queued
        job of the same key whose rows neither overlap the batch nor wait behind a job left in the queue."""
        q = self._queue
        head = next((j for j in q if j.first), q[0])
        taken, rows, blocked = [head], {id(lv) for lv in head.rows}, set()
        n = len(head.rows)
        for j in q:
            if j is head:
                continue
            ids = {id(lv) for lv in j.rows}
            if j.key == head.key and n + len(j.rows) <= self.max_batch and not ids & (rows | blocked):
                taken.append(j)
                rows |= ids
                n += len(j.rows)
            else:
                blocked |= ids
        for j in taken:
            q.remove(j)
        return taken

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self._cuda_stream is not None:
            torch.cuda.set_device(self.decoder.device)
        while True:
            with self._qcv:
                while not self._queue and not self._closing:
                    self._qcv.wait()
                if not self._queue:
                    return
                batch = self._take()
            try:
                if self._cuda_stream is not None:
                    with torch.cuda.stream(self._cuda_stream):
                        self._run_batch(batch)
                else:
                    self._run_batch(batch)
            except Exception:  # a bug here must not leave the engine waiting for audio that never comes
                log.exception("decode worker failed")
                for job in batch:
                    self._finish(job, "decode failed: internal error")

    def _run_batch(self, jobs: list[DecodeJob]) -> None:
        t0 = time.perf_counter()
        for job in jobs:
            if job.reference is not None:
                try:
                    with torch.inference_mode(), self._gpu_guard:
                        self.decoder.decode_reference(job.reference)
                except Exception:  # the request's first chunk tries again and fails its row
                    log.exception("decoding an ICL reference failed")
        rows = [(job, i) for job in jobs for i in range(len(job.rows))]
        live = [(job, i) for job, i in rows if not job.rows[i].cancelled]
        live = [(job, i) for job, i in live if self._start(job, i)]
        if live:
            codes = torch.cat([job.codes[i : i + 1] for job, i in live])
            try:
                with torch.inference_mode(), self._gpu_guard:
                    wav = self.decoder.decode(
                        [job.slots[i] for job, i in live], [job.fresh[i] for job, i in live], codes
                    )
            except Exception:
                log.exception("batched decode failed; retrying rows one by one")
                for job, i in live:
                    try:
                        with torch.inference_mode(), self._gpu_guard:
                            wav = self.decoder.decode([job.slots[i]], [job.fresh[i]], job.codes[i : i + 1])
                    except Exception as e:
                        self._fail(job.rows[i], f"decode failed: {type(e).__name__}")
                    else:
                        self._emit([(job, i)], job.codes[i : i + 1], wav)
            else:
                self._emit(live, codes, wav)
        self._timings["decode_s"] += time.perf_counter() - t0
        self._timings["decode_chunks"] += bool(rows)  # (a reference job has no rows: no chunk)
        self._timings["decode_rows"] += len(live)
        for job in jobs:
            self._finish(job)

    def _start(self, job: DecodeJob, i: int) -> bool:
        """Row i of `job` starts from its ICL voice's reference state, if it has one; False: that failed (the row
        is failed)."""
        voice = job.starts[i] if job.starts is not None else None
        if voice is None:
            return True
        try:
            with torch.inference_mode(), self._gpu_guard:
                self.decoder.start_from(job.slots[i], voice)
        except Exception as e:
            log.exception("decoding an ICL reference failed")
            self._fail(job.rows[i], f"decode failed: {type(e).__name__}")
            return False
        job.starts[i] = None  # started: a retry of this chunk continues from the slot's state
        job.fresh[i] = False
        return True

    def _emit(self, items: list[tuple[DecodeJob, int]], codes: Tensor, wav: Tensor) -> None:
        up = self.decoder.upsample
        for k, (job, i) in enumerate(items):
            t = job.lengths[i]
            try:
                self._deliver(job.rows[i], codes[k, :, :t], wav[k, : t * up])
            except Exception as e:  # the state already moved on: never decode this chunk again
                log.exception("delivering a decoded chunk failed")
                self._fail(job.rows[i], f"decode failed: {type(e).__name__}")

    def _finish(self, job: DecodeJob, error: str | None = None) -> None:
        with self._cv:
            for lv in job.rows:
                if error is not None:
                    self._fail(lv, error)
                left = self._inflight.get(id(lv), 0) - 1
                if left > 0:
                    self._inflight[id(lv)] = left
                else:
                    self._inflight.pop(id(lv), None)
            self.completed += 1
            self._cv.notify_all()
