"""Native engine loop: continuous batching of Qwen3-TTS requests with streaming Code2Wav, on CPU or CUDA.

Three parts, as vLLM divides its engine: this loop (lifecycle, submit and cancel, the worker thread, delivery of
audio and ends to the handles), the scheduler (scheduler.py: the queue and slots, and every decision of a turn,
returned as a plain plan) and the model runner (runner.py: builds the model, fast path, graphs, prefill and
decoder, and executes the plans). The loop asks, the runner executes, the loop delivers.

One worker thread owns the model. Each iteration it
  1. admits waiting requests into free KV-cache slots and prefills them, batched,
  2. runs ONE batched frame step (frame_step.py: talker step + code-predictor pass) for every live request,
  3. hands the frames that are due (a small first chunk, then larger ones) to the decoder (decoder.py): the
     stateful, exact streaming Code2Wav over slot-indexed state, batching requests whose chunks have the same
     length, on a thread and CUDA stream of its own (CUDA graphs per batch and chunk bucket on CUDA), which
     pushes float32 PCM chunks to each request's handle while the loop goes on stepping.
Finished and cancelled requests leave as soon as their audio is out and free their slot; no request waits for
another to finish. A request whose decoder is `decode_lookahead` chunks behind skips steps until it catches up,
so the frame steps never run far ahead of the audio.

Streamed text (a request with a `text_stream`, streaming-text mode only; text_feed.py): the request waits in the
queue, without a slot, until the text its prefill holds is committed (the first token; for an ICL prompt the
first frames + 1 - transcript tokens: icl_cache.stream_prefill_ids) or its text ends, and a running row whose next
token has not arrived is held out of the step the same way (its audio so far is handed to the decoder, in chunks
the decoder takes unpadded), so its codes are those of the whole text. The stream's listener wakes the loop
(`Scheduler.wake`); while every row is held the loop waits for that, a cancel, a submission or the decoder, instead
of turning.

ICL requests (`request.icl`) are rows like the others: their prompt holds the reference transcript and code block
(qwen_tts/model/icl_prompt.py) and their decoder starts from Code2Wav's state after the reference codes, both
computed once per voice (icl_cache.py), so a batch mixes ICL and x-vector rows freely. Their frame budget counts the
target text only (the reference is not spoken again); the prompt, reference included, must fit the prefill and the
KV cache's prompt room (max_text_tokens plus the fixed rows), checked at submit. With a text_stream the ICL prompt's
T[:T2] rows hold the reference transcript and the first target tokens, the rest trails one token per step, so a
streamed ICL row is fed and held as an x-vector one is, its codes those of the whole text.

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
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from qwen_tts.engine_api import (
    EngineNotReadyError,
    EngineSettings,
    EngineSettingsError,
    FinishReason,
    RequestHandle,
    SynthesisRequest,
    draw_seed,
)
from qwen_tts.engines.checkpoint import CheckpointEngine, FiniteCheck
from qwen_tts.fastpath.options import FastPath
from qwen_tts.model.config import ConfigError, ModelConfig
from qwen_tts.model.loading import Qwen3TTS, resolve_device, resolve_dtype
from qwen_tts.model.model_paths import DEMO, ModelPathError, resolve_model_path
from qwen_tts.model.prompt import normalize_language

from .icl_cache import check_icl_request, stream_prefill_ids
from .runner import ModelRunner, max_prompt_len, talker_cache_len, uses_graphs
from .scheduler import RequestState, Scheduler, frame_budget
from .text_feed import TextFeed

log = logging.getLogger("qwen_tts.engine")

# talker_cache_len is importable from here too (benchmarks, tests/reference/make_fixture.py).
__all__ = ["NativeEngine", "talker_cache_len"]


class NativeEngine(CheckpointEngine):
    """The default engine: our PyTorch model with continuous batching and streaming decode.

    The checkpoint's config is read at construction (model path resolved, the demo checkpoint written if asked),
    so the model's facts are known before `start` loads the weights. `model` (tests, benchmarks) is an already
    loaded model to serve instead of loading `settings.model_path`. `fast_path` (benchmarks, tests) replaces the
    options of the preset `settings.fast_path` names. `fault_hook` (fault injection, tests only:
    tts_server/faults.py) is called at the top of every busy loop turn and may raise, as a CUDA error or an
    out-of-memory inside the step would.
    """

    def __init__(
        self,
        settings: EngineSettings,
        model: Qwen3TTS | None = None,
        fast_path: FastPath | None = None,
        *,
        fault_hook: Callable[[], None] | None = None,
    ):
        self.config = settings
        self.fast = fast_path if fast_path is not None else FastPath.preset(settings.fast_path)
        try:
            self._device = resolve_device(settings.device)
        except ValueError as e:
            raise EngineSettingsError("device", str(e)) from None
        try:
            self.dtype = resolve_dtype(settings.dtype, self._device)
        except ValueError as e:
            raise EngineSettingsError("dtype", str(e)) from None
        if self.fast.frame_step == "graphs" and self._device.type != "cuda":
            raise EngineSettingsError("frame_step", "frame_step 'graphs' needs a CUDA device")
        if model is not None:
            self._model_dir, self._cfg = model.path, model.config
        else:
            try:
                self._model_dir = resolve_model_path(settings.model_path, demo_dir=settings.demo_dir)
                self._cfg = ModelConfig.from_pretrained(self._model_dir)
            except (ModelPathError, ConfigError, OSError) as e:
                raise EngineSettingsError("model_path", str(e)) from None
        self._scheduler = Scheduler(
            settings.max_slots,
            settings.max_queue,
            decode_lookahead=settings.decode_lookahead,
            step_budget_ms=settings.admission_step_budget_ms,
            max_frames=settings.max_frames,
        )
        self._cv = self._scheduler.cv
        self._finite = FiniteCheck()  # x-vectors found finite (submit)
        self._live = self._scheduler.running  # slot -> state of the admitted requests (worker thread only)
        self._thread: threading.Thread | None = None
        # Worker-thread wall time by phase (host clock; the step and decode end in a host sync, prefill does not).
        # decode_s is the decoder's busy time (its own thread when decode_thread), decode_chunks its batches.
        self._timings = {
            "steps": 0,
            "step_s": 0.0,
            "prefill_s": 0.0,  # admission, of which:
            "prefill_prompt_s": 0.0,  # building the prompts
            "prefill_talker_s": 0.0,  # the talker's prefill forwards (the host time of their launches)
            "prefill_slots_s": 0.0,  # the slots' sampling settings
            "decode_s": 0.0,
            "decode_chunks": 0,
            "decode_rows": 0,
            "admissions_held": 0,  # loop turns that left a waiting request queued (admission_step_budget_ms)
            "decoder_wait_s": 0.0,  # the loop waiting for the decoder with no row to step (decode_lookahead)
        }
        self._running = False
        self._accepting = False
        self._ready = False
        self._dead: str | None = None
        self.fault: BaseException | None = None  # what killed the loop, for the server's supervisor
        self._fault_hook = fault_hook
        name = DEMO if settings.model_path == DEMO else self._model_dir.name
        self._model_info: dict[str, Any] = {
            "name": name,
            "path": str(self._model_dir),
            "size": self._cfg.tts_model_size,
            "xvector_dim": self._cfg.xvector_dim,
            "device": str(self._device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_slots": settings.max_slots,
            "cuda_graphs": uses_graphs(self.fast, self._device),
        }
        self._runner = ModelRunner(
            settings,
            self.fast,
            self._device,
            self.dtype,
            model,
            self._model_dir,
            self._cfg,
            self._model_info,
            self._timings,
            self._cv,
            deliver=self._deliver,
            decode_failed=self._decode_failed,
            finish=self._finish,
            start=self._scheduler.start,
        )

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
        self._runner.load()
        self._cfg = self._runner.cfg

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
    def device(self) -> torch.device:
        return self._device

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
        if not self._finite(x):
            raise ValueError("xvector contains NaN or Inf")
        stream, feed = request.text_stream, None
        if stream is not None:
            if request.non_streaming_text:
                raise ValueError("a text_stream needs non_streaming_text=False (the talker reads one token per frame)")
            if not stream.snapshot().text.startswith(request.text):
                raise ValueError("text must be what the text_stream held when the request was submitted")
            feed = TextFeed(stream, self._runner.tokenizer, self.config.max_text_tokens)
            stream.add_listener(self._scheduler.wake)  # before the first read: no text is missed
            try:
                feed.poll()  # TextTooLongError is a ValueError
            except ValueError:
                stream.remove_listener(self._scheduler.wake)
                raise
            text_ids = feed.ids
        elif not request.text.strip():
            raise ValueError("text is empty")
        else:
            text_ids = self._runner.tokenizer.text_ids(request.text)
        if len(text_ids) > self.config.max_text_tokens:
            raise ValueError(f"text is {len(text_ids)} tokens, the limit is {self.config.max_text_tokens}")
        ref_ids = None
        if request.icl is not None:
            ref_ids = check_icl_request(
                request, self._runner.tokenizer, language, len(text_ids), max_prompt_len(self.config),
                self._cfg.talker.codebook_size,
            )  # fmt: skip
        handle = RequestHandle(request)
        if request.seed is None:
            request.seed = draw_seed()
        budget = frame_budget(request, len(text_ids), self.config.max_frames)
        handle.stats.frame_budget = budget
        state = RequestState(handle, text_ids, language, budget, feed=feed, ref_ids=ref_ids)
        state.prefill_ids = stream_prefill_ids(request, ref_ids)
        if feed is not None and feed.ended and not feed.ids:  # the stream ended with no text: nothing to say
            self._end_waiting(state, FinishReason.EOS)
            return handle
        try:
            self._scheduler.enqueue(state)
        except Exception:
            if stream is not None:
                stream.remove_listener(self._scheduler.wake)
            raise
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        # A request still waiting leaves the queue at once, so cancelled work never holds queue places.
        state = self._scheduler.cancel(handle)
        if state is not None:
            self._end_waiting(state, FinishReason.CANCELLED)

    def _end_waiting(self, state: RequestState, reason: FinishReason, error: str | None = None) -> None:
        """A request that never got a slot is over (cancelled, its text stream ended empty or too long)."""
        if state.feed is not None:
            state.feed.stream.remove_listener(self._scheduler.wake)
        state.handle.stats.started_at = time.monotonic()
        state.handle.finish_threadsafe(reason, error)

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        if self.device.type == "cuda":
            # A high-priority stream, so Code2Wav's kernels fill the SMs a step leaves. Negative is higher; graph
            # replays take the priority of the stream they are launched into.
            stream = torch.cuda.Stream(self.device, priority=-1)
            stream.wait_stream(torch.cuda.current_stream(self.device))  # what _load and the warm-up wrote
            with torch.cuda.stream(stream):
                self._loop()
        else:
            self._loop()

    def _loop(self) -> None:
        sched, runner = self._scheduler, self._runner
        try:
            while True:
                with self._cv:
                    idle = not self._live
                    if idle:  # the pause before the next request is no frame step; measure afresh
                        sched.idle()
                    while self._running and not sched.has_work:
                        self._cv.wait()
                    if not self._running and not sched.has_work:
                        runner.decoder.close()
                        return
                if idle and self.config.admission_window_s > 0:
                    # Woken from idle by the first of a burst: let the rest arrive so they share one prefill.
                    time.sleep(self.config.admission_window_s)
                for r in sched.poll_waiting():  # streamed text: first tokens committed, or texts ended empty
                    self._end_waiting(r.state, r.reason, r.error)
                with self._cv:
                    admission = sched.admit()
                    stopping = not self._running
                    if admission.held:
                        self._timings["admissions_held"] += 1
                if admission.admitted:
                    runner.admit(admission.admitted)
                if stopping:
                    runner.drain()
                    sched.cancel_running()
                    self._retire()
                    if self._live:  # their last chunks are still in the decoder
                        self._wait_for_decoder()
                    continue
                if self._live:
                    if self._fault_hook is not None:  # fault injection (tests only)
                        self._fault_hook()
                    with torch.inference_mode():
                        self._step()
        except Exception as e:  # a bug in the loop itself: fail everything, mark the engine dead
            log.exception("engine loop died")
            self._dead = f"engine loop died: {type(e).__name__}"
            self.fault = e
            for lv in list(self._live.values()):
                self._finish(lv, FinishReason.ERROR, self._dead)
            for lv in sched.drain_waiting():
                self._end_waiting(lv, FinishReason.ERROR, self._dead)
            if runner.decoder is not None:
                runner.decoder.close(timeout=5)

    def _step(self) -> None:
        """One turn with live requests: the scheduler's plan, the runner's frame step and chunk hand-off, then the
        rows that leave."""
        sched, runner = self._scheduler, self._runner
        mark = sched.events  # before the streams are read: text arriving after this ends a wait below
        runner.extend_text(sched.poll_running())
        plan = sched.schedule(runner.ahead, runner.decoder)
        if plan.wait_for_decoder or plan.wait_for_text:  # no row can step: hand out held rows' audio, then wait
            runner.decode_due(self._live)
            self._retire()
            w0 = time.perf_counter()
            self._wait_for_decoder(mark)
            if plan.wait_for_decoder:
                self._timings["decoder_wait_s"] += time.perf_counter() - w0
            return
        t0 = time.perf_counter()
        if plan.rows:
            sched.note_step(t0)
        runner.step(plan)
        t1 = time.perf_counter()
        runner.decode_due(self._live)
        tm = self._timings
        tm["steps"] += bool(plan.rows)
        tm["step_s"] += t1 - t0
        tm["decode_s"] += time.perf_counter() - t1
        self._retire()

    def _wait_for_decoder(self, events: int | None = None) -> None:
        """Block until the decoder finishes a chunk, a request can be admitted, the engine stops, or (with `events`,
        the scheduler's count when the turn began) text arrives, a request is submitted or cancelled (short
        timeout). A request waiting for a slot does not end the wait (it would spin the loop): slots free up as the
        decoder delivers the last chunks of finished requests, or within the timeout after a cancel."""
        decoder, sched = self._runner.decoder, self._scheduler
        with self._cv:
            mark, running = decoder.completed, self._running
            self._cv.wait_for(
                lambda: (
                    decoder.completed != mark
                    or (self._running and sched.can_admit and not sched.admission_held())
                    or self._running != running
                    or (events is not None and sched.events != events)
                ),
                timeout=0.1,
            )

    def _retire(self) -> None:
        for r in self._scheduler.retire(self._runner.decoder):
            self._finish(r.state, r.reason, r.error)

    # ------------------------------------------------------------------ delivery (decoder thread and loop)
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

    def _finish(self, lv: RequestState, reason: FinishReason, error: str | None = None) -> None:
        """The request is over: its slot is free and the consumer sees the end (once)."""
        if lv.feed is not None:
            lv.feed.stream.remove_listener(self._scheduler.wake)
        self._scheduler.release(lv)
        lv.handle.finish_threadsafe(reason, error)
