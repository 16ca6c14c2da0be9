"""Native engine loop: continuous batching of Qwen3-TTS requests with streaming Code2Wav, on CPU or CUDA.

One worker thread owns the model. Each iteration it
  1. admits waiting requests into free KV-cache slots (scheduler.py) and prefills them, batched,
  2. runs ONE batched frame step (frame_step.py: talker step + code-predictor pass) for every live request,
  3. hands the frames that are due (a small first chunk, then larger ones) to the decoder (decoder.py): the
     stateful, exact streaming Code2Wav over slot-indexed state, batching requests whose chunks have the same
     length, on a thread and CUDA stream of its own (CUDA graphs per batch and chunk bucket on CUDA), which
     pushes float32 PCM chunks to each request's handle while the loop goes on stepping.
Finished and cancelled requests leave as soon as their audio is out and free their slot; no request waits for
another to finish. A request whose decoder is `decode_lookahead` chunks behind skips steps until it catches up,
so the frame steps never run far ahead of the audio.

Per-request state that the batched step needs lives in slot-indexed device tensors (sampling settings, seeds,
the repetition-penalty mask, the last hidden state), so a step gathers by slot index instead of rebuilding
Python lists. Sampling noise is counter based (seed, frame, codebook), so a request's output never depends on
what else is in the batch.

On CUDA (frame_step "auto" or "graphs") step 2 replays a CUDA graph of the whole batched frame step; on CPU it
runs eagerly at exact shapes. On CUDA the step is also launched one iteration ahead (`overlap_steps`): step N+1
is queued before step N's codes are read, for every row that step N will not have taken past its budget, so the
GPU steps while the host reads codes, ends requests and hands chunks to the decoder. A row that step N ends was
stepped once more for nothing; its codes are dropped (its slot's state is reset on reuse, as after any
end-of-speech step, and the step runs before any later prefill: one stream, in order).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.profiler import record_function

from qwen_tts.engine_api import (
    Engine,
    EngineNotReadyError,
    EngineSettings,
    EngineSettingsError,
    FinishReason,
    RequestHandle,
    SynthesisRequest,
    chunk_schedule,
)
from qwen_tts.fastpath import fused, sample_kernel, small_m_gemm, snake_kernel
from qwen_tts.fastpath.stack import stack_cuda, stack_kernel
from qwen_tts.model.config import ConfigError, ModelConfig
from qwen_tts.model.layers import upload
from qwen_tts.model.loading import Qwen3TTS, load_model, resolve_device, resolve_dtype
from qwen_tts.model.model_paths import DEMO, ModelPathError, resolve_model_path
from qwen_tts.model.prompt import Prompt, build_prompt, normalize_language
from qwen_tts.model.sampling import suppress_mask

from .decoder import DecodeJob, DecodeWorker, SlotDecoder
from .frame_step import EagerFrameStep, FrameStepRunner, SlotState, StepCodes, one_row_steps
from .prefill import PrefillRunner
from .scheduler import RequestState, Scheduler, frame_budget

log = logging.getLogger("qwen_tts.engine")

# Padded tokens per batched prefill forward (bounds memory when many requests arrive at once).
PREFILL_TOKENS_PER_BATCH = 4096
PREFILL_MAX_BATCH = 16  # prompts per prefill forward
PROMPT_EXTRA_TOKENS = 16  # prompt tokens beyond the text's (role, control and codec prefix)


class NativeEngine(Engine):
    """The default engine: our PyTorch model with continuous batching and streaming decode.

    The checkpoint's config is read at construction (model path resolved, the demo checkpoint written if asked),
    so the model's facts are known before `start` loads the weights. `model` (tests, benchmarks) is an already
    loaded model to serve instead of loading `settings.model_path`.
    """

    def __init__(self, settings: EngineSettings, model: Qwen3TTS | None = None):
        self.config = settings
        try:
            self._device = resolve_device(settings.device)
        except ValueError as e:
            raise EngineSettingsError("device", str(e)) from None
        try:
            self.dtype = resolve_dtype(settings.dtype, self._device)
        except ValueError as e:
            raise EngineSettingsError("dtype", str(e)) from None
        if settings.frame_step == "graphs" and self._device.type != "cuda":
            raise EngineSettingsError("frame_step", "frame_step 'graphs' needs a CUDA device")
        self._model = model
        if model is not None:
            self._model_dir, self._cfg = model.path, model.config
        else:
            try:
                self._model_dir = resolve_model_path(settings.model_path, demo_dir=settings.demo_dir)
                self._cfg = ModelConfig.from_pretrained(self._model_dir)
            except (ModelPathError, ConfigError, OSError) as e:
                raise EngineSettingsError("model_path", str(e)) from None
        self._scheduler = Scheduler(settings.max_slots, settings.max_queue)
        self._cv = self._scheduler.cv
        self._live = self._scheduler.running  # slot -> state of the admitted requests (worker thread only)
        self._thread: threading.Thread | None = None
        self._runner: EagerFrameStep | FrameStepRunner | None = None
        # The launched frame step whose codes are not read yet (overlap_steps): its rows and codes.
        self._ahead: tuple[list[RequestState], StepCodes] | None = None
        # Worker-thread wall time by phase (host clock; the step and decode end in a host sync, prefill does not).
        # decode_s is the decoder's busy time (its own thread when decode_thread), decode_chunks its batches.
        self._timings = {
            "steps": 0,
            "step_s": 0.0,
            "prefill_s": 0.0,
            "decode_s": 0.0,
            "decode_chunks": 0,
            "decode_rows": 0,
            "admissions_held": 0,  # loop turns that left a waiting request queued (admission_step_budget_ms)
            "decoder_wait_s": 0.0,  # the loop waiting for the decoder with no row to step (decode_lookahead)
        }
        # Seconds between frame steps while requests run: a moving average (admission_step_budget_ms).
        self._step_interval: float | None = None
        self._last_step_at: float | None = None
        self._decoder: DecodeWorker | None = None
        self._running = False
        self._accepting = False
        self._ready = False
        self._dead: str | None = None
        self.fault: BaseException | None = None  # what killed the loop, for the server's supervisor
        # Fault injection (tests only): called at the top of every busy loop iteration; may raise, as a CUDA
        # error or an out-of-memory inside the step would. None in normal operation.
        self.fault_hook: Callable[[], None] | None = None
        name = DEMO if settings.model_path == DEMO else self._model_dir.name
        self._model_info: dict[str, Any] = {
            "name": name,
            "path": str(self._model_dir),
            "size": self._cfg.tts_model_size,
            "xvector_dim": self._cfg.xvector_dim,
            "device": str(self._device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_slots": settings.max_slots,
            "cuda_graphs": self._uses_graphs,
        }

    @property
    def _uses_graphs(self) -> bool:
        mode = self.config.frame_step
        return mode == "graphs" or (mode == "auto" and self.device.type == "cuda")

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
            torch.backends.cuda.preferred_blas_library("cublas")  # the frame step's matmuls (process-wide)
        if self._model is None:
            self._model = load_model(self._model_dir, device=self.device, dtype=self.dtype)
        m = self._model
        cfg = m.config
        t = cfg.talker
        self._cfg = cfg
        self._talker = m.talker.eval()
        self._code2wav = m.code2wav.eval()
        if self.device.type == "cuda" and self.config.decoder_fp16:
            self._code2wav.set_decoder_dtype(torch.float16)
        polyphase = self.config.decoder_polyphase_dilation if self.device.type == "cuda" else 0  # CUDA only
        self._code2wav.set_polyphase_dilation(polyphase)
        self._model_info["decoder_polyphase_dilation"] = polyphase  # what runs, as kernel_sampler and the rest
        self._model_info["decoder_dtype"] = str(self._code2wav.decoder_dtype).removeprefix("torch.")
        self._tokenizer = m.tokenizer
        self._role_ids = self._tokenizer.chat_ids("")[:3]
        self._max_len = talker_cache_len(self.config)
        S = self.config.max_slots
        # One slot more than requests: the scratch slot (index S) that padding rows of a graphed step write to.
        self._cache = self._talker.new_cache(S + 1, self._max_len, device=self.device, dtype=self.dtype)
        self._state = SlotState.zeros(S + 1, t.hidden_size, t.vocab_size, self.device, self.dtype)
        # Control ids (>= codebook size) are never sampled for codebook 0, except end-of-speech.
        self._suppress = suppress_mask(t.vocab_size, t.codebook_size, t.codec_eos_token_id, self.device)
        self._eos = t.codec_eos_token_id
        self._codebook_size = t.codebook_size
        enable_fast_path(self._talker, self.config, self.device)
        self._model_info["fused_kernels"] = fused.is_enabled(self._talker)
        self._model_info["fused_emulate_casts"] = bool(self._model_info["fused_kernels"] and fused.emulate_casts())
        self._model_info["fused_deterministic"] = bool(self._model_info["fused_kernels"] and fused.deterministic())
        self._model_info["kernel_sampler"] = self._talker.kernel_sampler
        feeds = self._talker.code_predictor.next_input_is_a_row()
        self._model_info["cp_fused_feed"] = self._model_info["fused_kernels"] and self._talker.cp_fused_feed and feeds
        self._model_info["small_m_heads"] = self._talker.head_linear is not None
        self._model_info["cp_input_tables"] = self._talker.code_predictor.input_tables is not None
        self._model_info["cp_prompt_one_pass"] = self._talker.code_predictor.prompt_one_pass
        self._model_info["cp_stack_kernel"] = self._talker.code_predictor.model.stack_kernel or "off"
        self._model_info["talker_stack_kernel"] = self._talker.model.stack_kernel or "off"
        self._model_info["one_row_steps"] = one_row_steps(self._talker)
        self._model_info["stack_blocks"] = stack_blocks(self._talker, self.config, self.device)
        blocks = self._model_info["stack_blocks"]
        self._model_info["stack_exact_rows"] = self.config.stack_exact_rows if blocks else 0
        if self.device.type == "cuda" and self.config.fused_decoder and fused.HAVE_TRITON:
            fused.enable_decoder(self._code2wav)
        self._model_info["fused_decoder"] = any(getattr(m, "fast", None) for m in self._code2wav.modules())
        if self.device.type == "cuda" and self.config.decoder_snake_kernel and fused.HAVE_TRITON:
            self._code2wav.set_snake_kernel(snake_kernel.snake, channels_last=self.config.decoder_channels_last)
        self._model_info["decoder_snake_kernel"] = self._code2wav.snake_kernel is not None
        self._model_info["decoder_channels_last"] = self._code2wav.channels_last
        graphs = self._uses_graphs
        if graphs or self.config.frame_step == "padded":
            self._runner = FrameStepRunner(
                self._talker, self._state, self._cache, self._suppress, self._eos, S, scratch=S, use_graphs=graphs
            )
            if graphs and self.config.warmup:
                with torch.inference_mode():
                    self._runner.capture_all()
        else:
            self._runner = EagerFrameStep(self._talker, self._state, self._cache, self._suppress, self._eos)
        self._model_info["overlap_steps"] = self._overlap
        # Prefill: graphed with graphed frame steps; padded to the same buckets on CUDA otherwise, so an eager
        # engine prefills at the graphed one's shapes; at exact shapes on CPU.
        if graphs:
            prefill_mode = "graphs"
        elif self.device.type == "cuda" or self.config.frame_step == "padded":
            prefill_mode = "padded"
        else:
            prefill_mode = "exact"
        with torch.inference_mode():
            self._prefiller = PrefillRunner(
                self._talker,
                self._cache,
                scratch=S,
                max_batch=min(S, PREFILL_MAX_BATCH),
                max_len=self.config.max_text_tokens + PROMPT_EXTRA_TOKENS,
                max_tokens=PREFILL_TOKENS_PER_BATCH,
                mode=prefill_mode,
            )
            if self.config.warmup:
                self._prefiller.capture_all()
        self._model_info["prefill_graphs"] = self._prefiller.num_graphs
        self._decode_batch = min(S, self.config.decode_max_batch)
        c = self.config
        self._chunk_sizes = chunk_schedule(c.first_chunk_frames, c.chunk_frames, c.chunk_growth)
        if graphs and self.config.decode_graphs:
            mode = "graphs"
        else:
            mode = "padded" if self.config.frame_step == "padded" else "exact"
        with torch.inference_mode():
            slot_decoder = SlotDecoder(
                self._code2wav,
                S,
                self._chunk_sizes,
                mode,
                max_batch=self._decode_batch,
            )
            slot_decoder.set_pinned_io(self.config.decode_pinned_io)
            if self.config.warmup:
                slot_decoder.capture_all()
        self._model_info["decode_graphs"] = mode == "graphs"
        self._model_info["decode_thread"] = self.config.decode_thread
        # Without warm-up, graphs are captured on first use, by the engine loop and by the decoder thread. A
        # capture must not overlap the other thread's CUDA calls (torch.cuda.graph synchronises the device and
        # empties the allocator's cache on entry; seen on an H200: "capturing stream has unjoined work"), so the
        # two threads then take turns around their GPU work. With warm-up every graph exists before either thread
        # starts and they run side by side.
        # Without graphs on CUDA both threads call torch.compile'd functions (the fused kernels, SnakeBeta) on every
        # step, and may compile them: while one thread traces, torch.fx patches nn.Module.__call__ process-wide and
        # the other thread's compiled call fails ("using FX to symbolically trace a dynamo-optimized function",
        # seen on an H200). They take turns then too; the eager CUDA path is for debugging, not throughput.
        lazy = graphs and not self.config.warmup  # graphed prefill and Code2Wav come only with graphed steps
        compiles = not graphs and (self._model_info["fused_kernels"] or self._model_info["fused_decoder"])
        self._capture_guard = threading.Lock() if lazy or compiles else contextlib.nullcontext()
        self._decoder = DecodeWorker(
            slot_decoder,
            self._deliver,
            self._decode_failed,
            self._cv,
            self.config.decode_thread,
            self._decode_batch,
            self._timings,
            gpu_guard=self._capture_guard,
        )
        log.info("engine initialised: %s", self._model_info)

    async def _warmup(self) -> None:
        x = torch.randn(self.xvector_dim, generator=torch.Generator().manual_seed(0))
        req = SynthesisRequest(text="Warm up.", xvector=x, greedy=True, max_frames=self.config.first_chunk_frames + 1)
        await self.submit(req).collect()

    async def stop(self, drain_timeout: float = 0.0) -> None:
        self._accepting = False
        self._ready = False
        deadline = time.monotonic() + drain_timeout
        while self._scheduler.has_work and time.monotonic() < deadline and self._thread is not None:
            await asyncio.sleep(0.02)
        with self._cv:
            self._scheduler.cancel_all()
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
    def device(self) -> torch.device:
        return self._device

    @property
    def model_info(self) -> dict[str, Any]:
        return dict(self._model_info)

    @property
    def timings(self) -> dict[str, float]:
        return self._timings

    @property
    def num_running(self) -> int:
        return len(self._live)

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

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
        if request.seed is None:
            request.seed = random.getrandbits(62)
        budget = frame_budget(request, len(text_ids), self.config.max_frames)
        handle.stats.frame_budget = budget
        self._scheduler.enqueue(RequestState(handle, text_ids, language, budget))
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        # A request still waiting leaves the queue at once, so cancelled work never holds queue places.
        if self._scheduler.cancel(handle) is not None:
            handle.stats.started_at = time.monotonic()
            handle.finish_threadsafe(FinishReason.CANCELLED)

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        if self.device.type == "cuda" and self.config.step_stream_priority:
            # Negative is higher; graph replays take the priority of the stream they are launched into.
            stream = torch.cuda.Stream(self.device, priority=-1)
            stream.wait_stream(torch.cuda.current_stream(self.device))  # what _load and the warm-up wrote
            with torch.cuda.stream(stream):
                self._loop()
        else:
            self._loop()

    def _loop(self) -> None:
        sched = self._scheduler
        try:
            while True:
                with self._cv:
                    idle = not self._live
                    if idle:  # the pause before the next request is no frame step; measure afresh
                        self._last_step_at = self._step_interval = None
                    while self._running and not sched.has_work:
                        self._cv.wait()
                    if not self._running and not sched.has_work:
                        self._decoder.close()
                        return
                if idle and self.config.admission_window_s > 0:
                    # Woken from idle by the first of a burst: let the rest arrive so they share one prefill.
                    time.sleep(self.config.admission_window_s)
                with self._cv:
                    held = self._admission_held()
                    admit = [] if held else sched.take_admissions()
                    stopping = not self._running
                    if held and sched.waiting:
                        self._timings["admissions_held"] += 1
                if admit:
                    self._admit(admit)
                if stopping:
                    self._drain_step()
                    for lv in list(self._live.values()):
                        lv.done = FinishReason.CANCELLED
                    self._retire()
                    if self._live:  # their last chunks are still in the decoder
                        self._wait_for_decoder()
                    continue
                if self._live:
                    if self.fault_hook is not None:  # fault injection (tests only)
                        self.fault_hook()
                    with torch.inference_mode():
                        self._step()
        except Exception as e:  # a bug in the loop itself: fail everything, mark the engine dead
            log.exception("engine loop died")
            self._dead = f"engine loop died: {type(e).__name__}"
            self.fault = e
            for lv in list(self._live.values()):
                self._finish(lv, FinishReason.ERROR, self._dead)
            for lv in sched.drain_waiting():
                lv.handle.finish_threadsafe(FinishReason.ERROR, self._dead)
            if self._decoder is not None:
                self._decoder.close(timeout=5)

    def _admit(self, admitted: list[RequestState]) -> None:
        """Build prompts and prefill newly admitted requests, batched (padded at the end) to spare launches."""
        t0 = time.perf_counter()
        ready: list[RequestState] = []
        for lv in admitted:
            lv.handle.stats.started_at = time.monotonic()
            if lv.cancelled:
                self._finish(lv, FinishReason.CANCELLED)
                continue
            try:
                with torch.inference_mode(), record_function("prefill.prompt"):
                    lv.prompt = self._build_prompt(lv)
                ready.append(lv)
            except Exception as e:
                self._fail_admission(lv, e)
        # Short prompts first, in groups of bounded padded size.
        ready.sort(key=lambda lv: lv.prompt.prefill.shape[0])
        group: list[RequestState] = []
        for lv in ready:
            longest = lv.prompt.prefill.shape[0]
            if group and not self._prefiller.fits(len(group) + 1, longest):
                self._prefill(group)
                group = []
            group.append(lv)
        if group:
            self._prefill(group)
        self.timings["prefill_s"] += time.perf_counter() - t0

    def _build_prompt(self, lv: RequestState) -> Prompt:
        req = lv.request
        x = upload(req.xvector, self.dtype, self.device)
        return build_prompt(
            self._cfg, self._talker, lv.text_ids, self._role_ids, x, lv.language, req.non_streaming_text
        )

    def _prefill(self, group: list[RequestState]) -> None:
        """One talker forward over several prompts. Padding sits after each prompt at later positions, so causal
        masking keeps it invisible to the real tokens, and the first decode steps overwrite its K/V."""
        try:
            with torch.inference_mode():
                lens = [lv.prompt.prefill.shape[0] for lv in group]
                with record_function("prefill.talker"), self._capture_guard:
                    last = self._prefiller.run([lv.prompt.prefill for lv in group], [lv.slot for lv in group])
                slots = upload([lv.slot for lv in group], torch.long, self.device)
                self._state.h[slots] = last
                with record_function("prefill.slots"):
                    self._set_slot_params(slots, [lv.request for lv in group])
        except Exception as e:
            if len(group) > 1:  # find the culprit: prefill each request on its own
                for lv in group:
                    self._prefill([lv])
                return
            self._fail_admission(group[0], e)
            return
        for lv, n in zip(group, lens, strict=True):
            lv.pos = n
            self._live[lv.slot] = lv

    def _fail_admission(self, lv: RequestState, e: Exception) -> None:
        log.error("request %s failed in prefill: %r", lv.handle.request_id, e)
        self._finish(lv, FinishReason.ERROR, f"prefill failed: {type(e).__name__}")

    def _set_slot_params(self, slots: Tensor, reqs: list[SynthesisRequest]) -> None:
        """Each request's sampling settings into its slot (`slots` on the device, one per request): one upload per
        setting for the whole group, none of them a host sync (a scalar written into a CUDA tensor is one)."""
        st = self._state
        st.seen.index_fill_(0, slots, False)
        packs = (
            (st.floats, [[r.repetition_penalty, max(r.temperature, 1e-5), r.top_p,
                          max(r.cp_temperature, 1e-5), r.cp_top_p] for r in reqs]),
            (st.ints, [[r.top_k, r.cp_top_k, r.seed & ((1 << 62) - 1)] for r in reqs]),
            (st.flags, [[r.greedy, r.greedy] for r in reqs]),
        )  # fmt: skip
        for t, rows in packs:  # rows (n, settings) -> the packs' (settings, n) columns of these slots
            t.index_copy_(1, slots, upload(rows, t.dtype, t.device).T)

    @property
    def _overlap(self) -> bool:
        """overlap_steps; None: where a launch returns before the step has run (CUDA, not the eager step, which
        reads its codes back as it launches)."""
        on = self.config.overlap_steps
        if on is None:
            return self.device.type == "cuda" and not isinstance(self._runner, EagerFrameStep)
        return on

    def _step(self) -> None:
        # Requests that were cancelled, failed in the decoder or ran out of budget leave before any work is done.
        for lv in self._live.values():
            if lv.cancelled:
                lv.done = FinishReason.CANCELLED
            elif lv.decode_error is not None:
                lv.done, lv.error = FinishReason.ERROR, lv.decode_error
                lv.pending.clear()
            elif lv.done is None and lv.frames >= lv.budget:
                lv.done = FinishReason.BUDGET
        lookahead = self.config.decode_lookahead
        dec = self._decoder
        ahead = self._ahead
        stepping = {id(lv) for lv in ahead[0]} if ahead is not None else set()  # one frame more once read
        rows = [
            lv
            for lv in self._live.values()
            if lv.done is None and dec.inflight(lv) < lookahead and lv.frames + (id(lv) in stepping) < lv.budget
        ]
        if not rows and ahead is None and dec.busy:  # nothing to step until the decoder catches up
            w0 = time.perf_counter()
            self._wait_for_decoder()
            self.timings["decoder_wait_s"] += time.perf_counter() - w0
        t0 = time.perf_counter()
        launched: StepCodes | None = None
        failed = False
        if rows:
            self._note_step(t0)
            try:
                launched = self._launch(rows, stepping)
                if not self._overlap:
                    self._read(rows, launched)
                    launched = None
            except Exception:
                log.exception("batched step failed; retrying rows one by one to isolate the failure")
                launched, failed = None, True
        if ahead is not None:  # the step launched before: the GPU runs the one just launched meanwhile
            self._ahead = None
            try:
                self._read(*ahead)
            except Exception as e:
                log.exception("reading a frame step failed")
                self._fail_rows(ahead[0], e)
        if failed:
            for lv in rows:  # now at their frames: the step ahead (if any) is read
                if lv.done is None:
                    try:
                        self._read([lv], self._launch([lv], set()))
                    except Exception as e:
                        self._fail_rows([lv], e)
        elif launched is not None:
            self._ahead = (rows, launched)
        t1 = time.perf_counter()
        self._decode_due()
        tm = self.timings
        tm["steps"] += bool(rows)
        tm["step_s"] += t1 - t0
        tm["decode_s"] += time.perf_counter() - t1
        self._retire()

    def _note_step(self, now: float) -> None:
        """A frame step starts: fold the time since the last one into the moving average (worker thread)."""
        if self._last_step_at is not None:
            dt = now - self._last_step_at
            self._step_interval = (
                dt if self._step_interval is None else self._step_interval + 0.25 * (dt - self._step_interval)
            )
        self._last_step_at = now

    def _admission_held(self) -> bool:
        """Whether waiting requests stay queued: requests run and get their frames slower than the budget."""
        budget = self.config.admission_step_budget_ms
        if not budget or not self._live:
            return False
        return self._step_interval is not None and self._step_interval * 1e3 > budget

    def _fail_rows(self, rows: list[RequestState], e: Exception) -> None:
        for lv in rows:
            if lv.done is None:
                lv.done = FinishReason.ERROR
                lv.error = f"generation failed: {type(e).__name__}"

    def _drain_step(self) -> None:
        """Read the step launched ahead, if any (before the loop waits, stops or leaves)."""
        if self._ahead is not None:
            rows, step = self._ahead
            self._ahead = None
            try:
                self._read(rows, step)
            except Exception as e:
                self._fail_rows(rows, e)

    def _launch(self, rows: list[RequestState], stepping: set[int]) -> StepCodes:
        """Launch one frame for `rows` (each at its own position): the fixed-shape step (a CUDA graph replay on
        CUDA) or, on CPU, the same `frame_step` eagerly at exact shapes. Rows in `stepping` (ids) are in the step
        launched before, not read yet: this one is their next frame, if that step does not end them. Rows that hit
        EOS were stepped too (see frame_step.py)."""
        frames = [lv.frames + (id(lv) in stepping) for lv in rows]
        args = (
            [lv.slot for lv in rows],
            frames,
            [lv.handle.request.min_frames for lv in rows],
            [lv.pos + (id(lv) in stepping) for lv in rows],
            [
                lv.prompt.trailing[f] if f < lv.prompt.trailing.shape[0] else lv.prompt.pad
                for lv, f in zip(rows, frames, strict=True)
            ],
        )
        with self._capture_guard:
            return self._runner.launch(*args)

    def _read(self, rows: list[RequestState], step: StepCodes) -> None:
        """The codes of a launched step: each row's next frame, or its end. A row that ended before (at the step
        launched ahead of this one) was stepped for nothing: its codes are dropped."""
        with self._capture_guard:  # (a sync: not while the decoder thread captures a graph lazily)
            codes = step.result()  # (n, 16), host
        bad = self._out_of_codebook(codes)
        for i, (lv, cb0, frame) in enumerate(zip(rows, codes[:, 0].tolist(), codes, strict=True)):
            if lv.done is not None:
                continue
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

    def _next_chunk(self, queued: int) -> int:
        """Frames of the chunk that starts after `queued` frames: the schedule's sizes in turn, then its last."""
        start = 0
        for size in self._chunk_sizes[:-1]:
            if queued <= start:
                return size
            start += size
        return self._chunk_sizes[-1]

    def _decode_due(self) -> None:
        """Hand the decoder the pending frames of rows whose next chunk is due (or that finished), one job per
        chunk shape; a finished row that still holds more than a chunk gets several jobs, in order."""
        cfg, dec = self.config, self._decoder.decoder
        while True:
            groups: dict[tuple, list[tuple[RequestState, int]]] = collections.defaultdict(list)
            for lv in self._live.values():
                if not lv.pending or lv.done in (FinishReason.CANCELLED, FinishReason.ERROR):
                    continue
                first = lv.queued == 0
                target = self._next_chunk(lv.queued)
                if len(lv.pending) >= target or lv.done is not None:
                    t = min(len(lv.pending), target)
                    alone = lv.slot if cfg.batch_invariant_decode else -1  # a group of its own
                    groups[(dec.padded_len(t), first, alone)].append((lv, t))
            if not groups:
                return
            jobs = [
                (key, items[i : i + self._decode_batch])
                for key, items in groups.items()
                for i in range(0, len(items), self._decode_batch)
            ]
            for key, items in jobs:
                T = key[0]
                codes = torch.zeros(len(items), dec.num_quantizers, T, dtype=torch.long)
                for i, (lv, t) in enumerate(items):
                    codes[i, :, :t] = torch.stack(lv.pending[:t]).T
                    del lv.pending[:t]
                    lv.queued += t
                rows = [lv for lv, _ in items]
                self._decoder.submit(
                    DecodeJob(
                        rows=rows,
                        slots=[lv.slot for lv in rows],
                        lengths=[t for _, t in items],
                        codes=codes,
                        first=key[1],
                        fresh=[key[1]] * len(rows),
                        key=key,
                    )
                )

    def _deliver(self, lv: RequestState, codes: torch.Tensor, wav: torch.Tensor) -> None:
        """A decoded chunk of `lv` (decoder thread): codes (16, t), wav (t * upsample,) float32 on the CPU."""
        if lv.handle.request.return_codes:
            lv.handle.codes.append(codes.T.clone())
        lv.decoded += codes.shape[1]
        st = lv.handle.stats
        if st.first_audio_at is None:
            st.first_audio_at = time.monotonic()
        st.frames = lv.decoded
        st.samples += wav.shape[0]
        lv.handle.put_threadsafe(np.ascontiguousarray(wav.numpy(), dtype=np.float32))

    def _decode_failed(self, lv: RequestState, message: str) -> None:
        """A chunk of `lv` failed in the decoder (decoder thread): the engine loop ends the request."""
        if lv.decode_error is None:
            lv.decode_error = message

    def _wait_for_decoder(self) -> None:
        """Block until the decoder finishes a chunk, a request can be admitted or the engine stops (short timeout).
        A request waiting for a slot does not end the wait (it would spin the loop): slots free up as the decoder
        delivers the last chunks of finished requests, or within the timeout after a cancel."""
        with self._cv:
            mark, running = self._decoder.completed, self._running
            self._cv.wait_for(
                lambda: (
                    self._decoder.completed != mark
                    or (self._running and self._scheduler.can_admit and not self._admission_held())
                    or self._running != running
                ),
                timeout=0.1,
            )

    def _retire(self) -> None:
        for lv in list(self._live.values()):
            if lv.decode_error is not None and lv.done not in (FinishReason.CANCELLED, FinishReason.ERROR):
                lv.done, lv.error = FinishReason.ERROR, lv.decode_error
                lv.pending.clear()
            if lv.done is None:
                continue
            if lv.done in (FinishReason.EOS, FinishReason.BUDGET) and lv.pending:
                continue  # flushed by the next _decode_due
            if self._decoder.inflight(lv):
                continue  # its audio is still in the decoder
            self._finish(lv, lv.done, lv.error)

    def _finish(self, lv: RequestState, reason: FinishReason, error: str | None = None) -> None:
        """The request is over: its slot is free and the consumer sees the end (once)."""
        self._scheduler.release(lv)
        lv.handle.finish_threadsafe(reason, error)


def talker_cache_len(config: EngineSettings) -> int:
    """The talker cache's positions: the longest prompt and the most frames."""
    return config.max_text_tokens + PROMPT_EXTRA_TOKENS + config.max_frames


def stack_blocks(talker, config: EngineSettings, device: torch.device) -> dict[str, int]:
    """The blocks (SMs) each stack on the CUDA kernel launches: every SM, or fewer with stack_lean_grid."""
    if device.type != "cuda":
        return {}
    out = {}
    for name, stack, max_len in (
        ("code_predictor", talker.code_predictor.model, talker.code_predictor.num_residual + 1),
        ("talker", talker.model, talker_cache_len(config)),
    ):
        if stack.stack_kernel == "cuda":
            out[name] = stack_cuda.blocks(stack.stack_weights, max_len, device)
    return out


def enable_fast_path(talker, config: EngineSettings, device: torch.device) -> bool:
    """Turn on the CUDA fast path (qwen_tts/fastpath/fused.py and the kernels around it) for a talker and its code
    predictor as `config` asks; returns whether it is on. The engine's own set-up, a function of its own so that a
    check outside the engine (tests/reference/make_fixture.py's teacher-forced agreement) runs the same path."""
    if not (device.type == "cuda" and config.fused_kernels and fused.supported(talker)):
        return False
    fused.set_emulate_casts(config.fused_emulate_casts)  # read when the regions compile: before the first step
    fused.set_deterministic(config.fused_deterministic)
    fused.enable(talker, split_attention=config.split_attention, small_m_gemm=config.small_m_gemm)
    # Process-wide, read when each graph is captured; its counters exist before capture.
    small_m_gemm.set_max_split_k(config.small_m_split_k)
    small_m_gemm.prepare(device)
    talker.code_predictor.prompt_one_pass = config.cp_prompt_one_pass
    fused.set_small_m_heads(talker, config.small_m_gemm and config.small_m_heads)
    talker.code_predictor.input_tables = None
    if config.cp_input_tables:
        n = talker.code_predictor.build_input_tables()
        log.info("code predictor input tables: %.1f MB", n / 1e6)
    # process-wide, read when a pass is compiled or captured
    stack_cuda.set_options(
        lean_grid=config.stack_lean_grid,
        evict_first=config.stack_evict_first,
        threads=config.cp_stack_threads,
        long_threads=config.talker_stack_threads,
        stage=config.talker_stack_stage,
        chunk=config.talker_stack_chunk,
        split=config.talker_stack_split,
        exact_rows=config.stack_exact_rows,
    )
    stack_kernel.enable(talker.code_predictor.model, config.cp_stack_kernel)
    if config.cp_stack_kernel != "off":
        stack_kernel.prepare(device)  # its counters, before any graph capture
    if config.cp_stack_kernel == "cuda":  # compiled and loaded now, not inside a capture; else the fused path's kernels
        cp = talker.code_predictor
        reason = stack_cuda.prepare(cp.model.stack_weights, cp.num_residual + 1, device)
        if reason:
            log.warning("cp_stack_kernel=cuda cannot run here (%s): the fused path's kernels run instead", reason)
            stack_kernel.enable(cp.model, "off")
    stack_kernel.enable(talker.model, config.talker_stack_kernel)
    if config.talker_stack_kernel == "cuda":  # the same kernel over the talker's cache (attention in chunks)
        stack_kernel.prepare(device)
        reason = stack_cuda.prepare(talker.model.stack_weights, talker_cache_len(config), device)
        if reason:
            log.warning("talker_stack_kernel=cuda cannot run here (%s): the fused path's kernels run instead", reason)
            stack_kernel.enable(talker.model, "off")
    talker.kernel_sampler = config.kernel_sampler
    talker.cp_fused_feed = config.kernel_sampler and config.cp_fused_feed
    sample_kernel.set_warp_elements(config.kernel_sampler_warp_elements)  # read at capture
    return True
