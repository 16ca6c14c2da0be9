"""Native engine: continuous batching of Qwen3-TTS requests with streaming Code2Wav, on CPU or CUDA.

One worker thread owns the model. Each iteration it
  1. admits waiting requests into free KV-cache slots (prefill, one request at a time),
  2. runs ONE batched talker step + code-predictor pass for every live request,
  3. decodes the frames that are due (a small first chunk, then larger ones) with the stateful, exact
     streaming Code2Wav, batching requests whose chunks have the same length,
and pushes float32 PCM chunks to each request's handle. Finished and cancelled requests leave at once and
free their slot; no request waits for another to finish.

Per-request state that the batched step needs lives in slot-indexed device tensors (sampling settings, seeds,
the repetition-penalty mask, the last hidden state), so a step gathers by slot index instead of rebuilding
Python lists. Sampling noise is counter based (seed, frame, codebook), so a request's output never depends on
what else is in the batch.

On CUDA (with `cuda_graphs`, the default) step 2 replays a CUDA graph of the whole batched frame step
(cuda_graph.py); on CPU it runs eagerly.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .cuda_graph import FrameStepRunner, SlotState, frame_step
from .engine_api import (
    Engine,
    EngineNotReadyError,
    FinishReason,
    QueueFullError,
    RequestHandle,
    SynthesisRequest,
)
from .loading import Qwen3TTS, load_model
from .prompt import Prompt, build_prompt, normalize_language
from .sampling import suppress_mask

log = logging.getLogger("qwen_tts.engine")

# Frame budget from the text length: ~3 frames per text token is normal speech; allow well over twice that.
BUDGET_BASE_FRAMES = 25
BUDGET_FRAMES_PER_TOKEN = 8
# Padded tokens per batched prefill forward (bounds memory when many requests arrive at once).
PREFILL_TOKENS_PER_BATCH = 4096


@dataclass
class EngineConfig:
    """Settings of the native engine (the server maps TTS_* variables onto these)."""

    model_path: str
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA (Code2Wav always float32)
    max_slots: int = 16  # requests decoding at once
    max_queue: int = 64  # requests waiting for a slot; beyond that, QueueFullError
    max_frames: int = 2048  # hard cap per request (frames of 80 ms)
    max_text_tokens: int = 1024  # longest accepted text, in tokens (sizes the KV cache)
    first_chunk_frames: int = 3  # small first chunk: the first audio comes fast
    chunk_frames: int = 12  # later chunks: fewer, larger decodes
    warmup: bool = True
    # When the engine is idle, wait this long after the first arrival so a burst shares one batched prefill.
    admission_window_s: float = 0.002
    # TF32 cuDNN convolutions make the float32 Code2Wav ~2x faster on Hopper but break exact streaming
    # (stream vs whole decode differ by ~2e-3 instead of ~1e-5). Exact by default.
    decoder_tf32: bool = False
    # On CUDA, replay the batched frame step from CUDA graphs (one per batch and kv-length bucket, captured at
    # start when warmup is on, else on first use); ~10x fewer launches than eager. Ignored on CPU.
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        for name in ("max_slots", "max_frames", "max_text_tokens", "first_chunk_frames", "chunk_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} requested but CUDA is not available")
    return dev


def resolve_dtype(spec: str | None, device: torch.device) -> torch.dtype:
    if spec is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if spec not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {spec!r}")
    return table[spec]


@dataclass(eq=False)
class _Live:
    """A request that holds a KV-cache slot."""

    handle: RequestHandle
    slot: int
    prompt: Prompt
    budget: int
    pos: int = 0  # next cache position to write
    frames: int = 0  # frames emitted so far
    pending: list[torch.Tensor] = field(default_factory=list)  # (16,) frames not yet decoded
    stream: object = None  # Code2WavStream
    decoded: int = 0  # frames already turned into audio
    done: FinishReason | None = None
    error: str | None = None

    @property
    def cancelled(self) -> bool:
        return getattr(self.handle, "_cancel_requested", False)


class NativeEngine(Engine):
    """The default engine: our PyTorch model with continuous batching and streaming decode."""

    def __init__(self, config: EngineConfig, model: Qwen3TTS | None = None):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self._model = model
        self._pending: collections.deque[RequestHandle] = collections.deque()
        self._live: dict[int, _Live] = {}
        self._free_slots: list[int] = list(range(config.max_slots))[::-1]
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._runner: FrameStepRunner | None = None
        # Tests set this to run the graph runner's padded, bucketed step eagerly on CPU.
        self._static_step_eager = False
        # Worker-thread wall time by phase (host clock; the step and decode end in a host sync, prefill does not).
        self.timings = {"steps": 0, "step_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0}
        self._running = False
        self._accepting = False
        self._ready = False
        self._dead: str | None = None
        self.model_info: dict = {}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="qwen-tts-engine", daemon=True)
        self._thread.start()
        self._accepting = True
        if self.config.warmup:
            await self._warmup()
        self._ready = True

    def _load(self) -> None:
        if self.device.type == "cuda":
            if self.device.index is not None:  # graph capture and replay use the current device's streams
                torch.cuda.set_device(self.device)
            torch.backends.cudnn.allow_tf32 = self.config.decoder_tf32
        if self._model is None:
            self._model = load_model(self.config.model_path, device=self.device, dtype=self.dtype)
        m = self._model
        cfg = m.config
        t = cfg.talker
        self._cfg = cfg
        self._talker = m.talker.eval()
        self._code2wav = m.code2wav.eval()
        self._tokenizer = m.tokenizer
        self._role_ids = self._tokenizer.chat_ids("")[:3]
        self._max_len = self.config.max_text_tokens + 16 + self.config.max_frames
        S = self.config.max_slots
        # One slot more than requests: the scratch slot (index S) that padding rows of a graphed step write to.
        self._cache = self._talker.new_cache(S + 1, self._max_len, device=self.device, dtype=self.dtype)
        self._state = SlotState.zeros(S + 1, t.hidden_size, t.vocab_size, self.device, self.dtype)
        # Control ids (>= codebook size) are never sampled for codebook 0, except end-of-speech.
        self._suppress = suppress_mask(t.vocab_size, t.codebook_size, t.codec_eos_token_id, self.device)
        self._eos = t.codec_eos_token_id
        self._codebook_size = t.codebook_size
        graphs = self.device.type == "cuda" and self.config.cuda_graphs
        if graphs or self._static_step_eager:
            self._runner = FrameStepRunner(
                self._talker, self._state, self._cache, self._suppress, self._eos, S, scratch=S, use_graphs=graphs
            )
            if graphs and self.config.warmup:
                with torch.inference_mode():
                    self._runner.capture_all()
        self.model_info = {
            "path": str(m.path),
            "size": cfg.tts_model_size,
            "xvector_dim": cfg.xvector_dim,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_slots": self.config.max_slots,
            "cuda_graphs": self._runner is not None and self._runner.use_graphs,
        }
        log.info("engine initialised: %s", self.model_info)

    async def _warmup(self) -> None:
        x = torch.randn(self.xvector_dim, generator=torch.Generator().manual_seed(0))
        req = SynthesisRequest(text="Warm up.", xvector=x, greedy=True, max_frames=self.config.first_chunk_frames + 1)
        await self.submit(req).collect()

    async def stop(self, drain_timeout: float = 0.0) -> None:
        self._accepting = False
        self._ready = False
        deadline = time.monotonic() + drain_timeout
        while (self._live or self._pending) and time.monotonic() < deadline and self._thread is not None:
            await asyncio.sleep(0.02)
        with self._cv:
            for h in list(self._pending):
                h._cancel_requested = True
            for lv in self._live.values():
                lv.handle._cancel_requested = True
            self._running = False
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    # ------------------------------------------------------------------ interface
    @property
    def ready(self) -> bool:
        return self._ready and self._dead is None

    @property
    def xvector_dim(self) -> int:
        return self._cfg.xvector_dim

    @property
    def languages(self) -> list[str]:
        return self._cfg.languages

    @property
    def num_running(self) -> int:
        return len(self._live)

    @property
    def num_waiting(self) -> int:
        return len(self._pending)

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        if not self._accepting or self._dead is not None:
            raise EngineNotReadyError(self._dead or "engine is not accepting requests")
        language = normalize_language(self._cfg, request.language)
        x = request.xvector
        if x.dim() != 1 or x.shape[0] != self.xvector_dim:
            raise ValueError(f"xvector must have shape ({self.xvector_dim},), got {tuple(x.shape)}")
        if not torch.isfinite(x).all():
            raise ValueError("xvector contains NaN or Inf")
        if not request.text.strip():
            raise ValueError("text is empty")
        text_ids = self._tokenizer.text_ids(request.text)
        if len(text_ids) > self.config.max_text_tokens:
            raise ValueError(f"text is {len(text_ids)} tokens, the limit is {self.config.max_text_tokens}")
        handle = RequestHandle(request)
        handle._text_ids = text_ids
        handle._language = language
        handle._cancel_requested = False
        if request.seed is None:
            request.seed = random.getrandbits(62)
        cap = self.config.max_frames if request.max_frames is None else min(request.max_frames, self.config.max_frames)
        handle.stats.frame_budget = max(1, min(cap, BUDGET_BASE_FRAMES + BUDGET_FRAMES_PER_TOKEN * len(text_ids)))
        with self._cv:
            if len(self._pending) >= self.config.max_queue + len(self._free_slots):
                raise QueueFullError(f"{len(self._pending)} requests waiting (limit {self.config.max_queue})")
            self._pending.append(handle)
            self._cv.notify()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        handle._cancel_requested = True
        with self._cv:
            # A request still waiting leaves the queue at once, so cancelled work never holds queue places.
            try:
                self._pending.remove(handle)
            except ValueError:
                pass
            else:
                handle.stats.started_at = time.monotonic()
                handle.finish_threadsafe(FinishReason.CANCELLED)
            self._cv.notify()

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        try:
            while True:
                with self._cv:
                    idle = not self._live
                    while self._running and not self._pending and not self._live:
                        self._cv.wait()
                    if not self._running and not self._live and not self._pending:
                        return
                if idle and self.config.admission_window_s > 0:
                    # Woken from idle by the first of a burst: let the rest arrive so they share one prefill.
                    time.sleep(self.config.admission_window_s)
                with self._cv:
                    admit = []
                    while self._pending and self._free_slots:
                        admit.append((self._pending.popleft(), self._free_slots.pop()))
                    stopping = not self._running
                if admit:
                    self._admit(admit)
                if stopping:
                    for lv in list(self._live.values()):
                        lv.done = FinishReason.CANCELLED
                    self._retire()
                    continue
                if self._live:
                    with torch.inference_mode():
                        self._step()
        except Exception as e:  # a bug in the loop itself: fail everything, mark the engine dead
            log.exception("engine loop died")
            self._dead = f"engine loop died: {type(e).__name__}"
            for lv in list(self._live.values()):
                self._finish(lv, FinishReason.ERROR, self._dead)
            with self._cv:
                while self._pending:
                    self._pending.popleft().finish_threadsafe(FinishReason.ERROR, self._dead)

    def _admit(self, admissions: list[tuple[RequestHandle, int]]) -> None:
        """Build prompts and prefill newly admitted requests, batched (padded at the end) to spare launches."""
        t0 = time.perf_counter()
        ready: list[tuple[RequestHandle, int, Prompt]] = []
        for handle, slot in admissions:
            handle.stats.started_at = time.monotonic()
            if handle._cancel_requested:
                self._release(slot)
                handle.finish_threadsafe(FinishReason.CANCELLED)
                continue
            try:
                with torch.inference_mode():
                    ready.append((handle, slot, self._build_prompt(handle)))
            except Exception as e:
                self._fail_admission(handle, slot, e)
        # Short prompts first, in groups of bounded padded size.
        ready.sort(key=lambda r: r[2].prefill.shape[0])
        group: list[tuple[RequestHandle, int, Prompt]] = []
        for item in ready:
            longest = item[2].prefill.shape[0]
            if group and longest * (len(group) + 1) > PREFILL_TOKENS_PER_BATCH:
                self._prefill(group)
                group = []
            group.append(item)
        if group:
            self._prefill(group)
        self.timings["prefill_s"] += time.perf_counter() - t0

    def _build_prompt(self, handle: RequestHandle) -> Prompt:
        req = handle.request
        x = req.xvector.to(self.device, self.dtype)
        return build_prompt(
            self._cfg, self._talker, handle._text_ids, self._role_ids, x, handle._language, req.non_streaming_text
        )

    def _prefill(self, group: list[tuple[RequestHandle, int, Prompt]]) -> None:
        """One talker forward over several prompts. Padding sits after each prompt at later positions, so causal
        masking keeps it invisible to the real tokens, and the first decode steps overwrite its K/V."""
        try:
            with torch.inference_mode():
                lens = [p.prefill.shape[0] for _, _, p in group]
                T = max(lens)
                embeds = torch.zeros(len(group), T, group[0][2].prefill.shape[1], device=self.device, dtype=self.dtype)
                for i, (_, _, p) in enumerate(group):
                    embeds[i, : lens[i]] = p.prefill
                pos = torch.arange(T, device=self.device).expand(len(group), T)
                slots = torch.tensor([slot for _, slot, _ in group], device=self.device)
                hidden = self._talker(embeds, pos, self._cache, slots, T)
                last = hidden[torch.arange(len(group), device=self.device), torch.tensor(lens, device=self.device) - 1]
                self._state.h[slots] = last
                for handle, slot, _ in group:
                    self._set_slot_params(slot, handle.request)
                streams = [self._code2wav.new_stream(1) for _ in group]
        except Exception as e:
            if len(group) > 1:  # find the culprit: prefill each request on its own
                for item in group:
                    self._prefill([item])
                return
            self._fail_admission(group[0][0], group[0][1], e)
            return
        for (handle, slot, prompt), n, stream in zip(group, lens, streams, strict=True):
            self._live[slot] = _Live(handle, slot, prompt, handle.stats.frame_budget, pos=n, stream=stream)

    def _fail_admission(self, handle: RequestHandle, slot: int, e: Exception) -> None:
        log.error("request %s failed in prefill: %r", handle.request_id, e)
        self._release(slot)
        handle.finish_threadsafe(FinishReason.ERROR, f"prefill failed: {type(e).__name__}")

    def _set_slot_params(self, slot: int, req: SynthesisRequest) -> None:
        st = self._state
        st.seen[slot] = False
        st.temp[slot] = max(req.temperature, 1e-5)
        st.top_k[slot] = req.top_k
        st.top_p[slot] = req.top_p
        st.rep[slot] = req.repetition_penalty
        st.greedy[slot] = req.greedy
        st.cp_temp[slot] = max(req.cp_temperature, 1e-5)
        st.cp_top_k[slot] = req.cp_top_k
        st.cp_top_p[slot] = req.cp_top_p
        st.cp_greedy[slot] = req.greedy
        st.seed[slot] = req.seed & ((1 << 62) - 1)

    def _release(self, slot: int) -> None:
        with self._cv:
            self._free_slots.append(slot)

    def _step(self) -> None:
        # Requests that were cancelled or ran out of budget leave before any work is done for them.
        for lv in self._live.values():
            if lv.cancelled:
                lv.done = FinishReason.CANCELLED
            elif lv.frames >= lv.budget:
                lv.done = FinishReason.BUDGET
        rows = [lv for lv in self._live.values() if lv.done is None]
        t0 = time.perf_counter()
        if rows:
            try:
                self._generate(rows)
            except Exception:
                log.exception("batched step failed; retrying rows one by one to isolate the failure")
                for lv in rows:
                    if lv.done is None:
                        try:
                            self._generate([lv])
                        except Exception as e:
                            lv.done = FinishReason.ERROR
                            lv.error = f"generation failed: {type(e).__name__}"
        t1 = time.perf_counter()
        self._decode_due()
        tm = self.timings
        tm["steps"] += bool(rows)
        tm["step_s"] += t1 - t0
        tm["decode_s"] += time.perf_counter() - t1
        self._retire()

    def _generate(self, rows: list[_Live]) -> None:
        """One frame for `rows` (each at its own position): the fixed-shape step (a CUDA graph replay on CUDA) or,
        on CPU, the same `frame_step` eagerly at exact shapes. Rows that hit EOS were stepped too (see cuda_graph)."""
        args = (
            [lv.slot for lv in rows],
            [lv.frames for lv in rows],
            [lv.handle.request.min_frames for lv in rows],
            [lv.pos for lv in rows],
            [
                lv.prompt.trailing[lv.frames] if lv.frames < lv.prompt.trailing.shape[0] else lv.prompt.pad
                for lv in rows
            ],
        )
        codes = self._runner.step(*args) if self._runner is not None else self._step_eager(*args)  # (n, 16), host
        bad = self._out_of_codebook(codes)
        for i, (lv, cb0, frame) in enumerate(zip(rows, codes[:, 0].tolist(), codes, strict=True)):
            if cb0 == self._eos:
                lv.done = FinishReason.EOS
                continue
            if i in bad:  # never let such a code reach the decoder: end this request, the others go on
                log.error("request %s: %s", lv.handle.request_id, bad[i])
                lv.done = FinishReason.ERROR
                lv.error = bad[i]
                continue
            lv.pending.append(frame)
            lv.pos += 1
            lv.frames += 1

    def _out_of_codebook(self, codes: torch.Tensor) -> dict[int, str]:
        """Rows of `codes` (n, 16) holding an id the decoder cannot take, with a message naming it.

        Sampling never picks a suppressed or filtered id; this guards against a fault (NaN logits, a kernel bug)
        turning into an index error inside a batched decode. cb0 may be EOS; every other id must be < codebook size.
        """
        size = self._codebook_size
        ok = (codes >= 0) & (codes < size)
        ok[:, 0] |= codes[:, 0] == self._eos
        if bool(ok.all()):
            return {}
        out = {}
        for i, j in (~ok).nonzero().tolist():
            if i not in out:
                out[i] = (
                    f"generation produced code {int(codes[i, j])} for codebook {j}, outside the codebook (size {size})"
                )
        return out

    def _step_eager(
        self, slots: list[int], frames: list[int], min_frames: list[int], positions: list[int], text: list[torch.Tensor]
    ) -> torch.Tensor:
        dev = self.device
        ints = torch.tensor([slots, frames, min_frames, positions], device=dev)
        codes = frame_step(
            self._talker,
            self._state,
            self._cache,
            self._suppress,
            self._eos,
            *ints,
            torch.stack(text),
            max(positions) + 1,
        )
        return codes.cpu()  # the one host sync per step: who stopped

    def _decode_due(self) -> None:
        """Decode pending frames of rows whose next chunk is due (or that finished), batched by chunk length."""
        groups: dict[int, list[_Live]] = collections.defaultdict(list)
        for lv in self._live.values():
            if not lv.pending or lv.done in (FinishReason.CANCELLED, FinishReason.ERROR):
                continue
            target = self.config.first_chunk_frames if lv.decoded == 0 else self.config.chunk_frames
            if len(lv.pending) >= target or lv.done is not None:
                groups[min(len(lv.pending), target)].append(lv)
        for t, rows in groups.items():
            try:
                self._decode_rows(rows, t)
            except Exception:
                log.exception("batched decode failed; retrying rows one by one")
                for lv in rows:
                    try:
                        self._decode_rows([lv], t)
                    except Exception as e:
                        lv.done = FinishReason.ERROR
                        lv.error = f"decode failed: {type(e).__name__}"
        # A finished row may still hold more than one chunk: keep flushing until empty.
        if any(lv.pending and lv.done in (FinishReason.EOS, FinishReason.BUDGET) for lv in self._live.values()):
            self._decode_due()

    def _decode_rows(self, rows: list[_Live], t: int) -> None:
        codes = torch.stack([torch.stack(lv.pending[:t]) for lv in rows]).transpose(1, 2)  # (B, 16, t)
        codes = codes.to(self.device)
        if len(rows) == 1:
            wav = self._code2wav.decode_chunk(codes, rows[0].stream)
        else:
            stream = type(rows[0].stream).cat([lv.stream for lv in rows])
            wav = self._code2wav.decode_chunk(codes, stream)
            for lv, s in zip(rows, stream.split(), strict=True):
                lv.stream = s
        wav = wav.float().cpu().numpy()
        now = time.monotonic()
        for i, (lv, w) in enumerate(zip(rows, wav, strict=True)):
            if lv.handle.request.return_codes:
                lv.handle.codes.append(codes[i].T.cpu())
            del lv.pending[:t]
            lv.decoded += t
            st = lv.handle.stats
            if st.first_audio_at is None:
                st.first_audio_at = now
            st.frames = lv.decoded
            st.samples += w.shape[0]
            lv.handle.put_threadsafe(np.ascontiguousarray(w, dtype=np.float32))

    def _retire(self) -> None:
        for slot, lv in list(self._live.items()):
            if lv.done is None:
                continue
            if lv.done in (FinishReason.EOS, FinishReason.BUDGET) and lv.pending:
                continue  # flushed by the next _decode_due
            del self._live[slot]
            self._release(slot)
            self._finish(lv, lv.done, lv.error)

    def _finish(self, lv: _Live, reason: FinishReason, error: str | None = None) -> None:
        lv.handle.finish_threadsafe(reason, error)


def create_engine(config: EngineConfig, backend: str = "native") -> Engine:
    """The engine for `backend`; only the native one exists in this build."""
    if backend == "native":
        return NativeEngine(config)
    raise ValueError(f"backend {backend!r} is not available in this build (available: native)")
