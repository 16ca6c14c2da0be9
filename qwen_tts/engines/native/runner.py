"""The native engine's model runner: it builds what runs and executes the scheduler's plans.

`load` builds the model (or takes the one given), the talker cache and slot state, the frame step (eager, padded,
or CUDA graphs), the batched prefill, the streaming decoder (decoder.py) and the CUDA fast path (`qwen_tts.fastpath.build`).
Then, on the engine's worker thread, it executes: `admit` builds the prompts of admitted requests and prefills them
in batches, `step` launches a frame step for the plan's rows and reads codes (the step launched one turn ahead
with overlap_steps, see engine.py), `decode_due` hands due chunks to the decoder. The runner decides nothing about
which request runs: that is scheduler.py's.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from qwen_tts import fastpath
from qwen_tts.engine_api import EngineSettings, FinishReason, SynthesisRequest
from qwen_tts.fastpath.options import FastPath
from qwen_tts.model.config import ModelConfig
from qwen_tts.model.icl_prompt import icl_trailing_ids, reference_block
from qwen_tts.model.layers import upload
from qwen_tts.model.loading import Qwen3TTS, load_model
from qwen_tts.model.prompt import HeadCache, IclRows, Prompt, TextTable, build_prompt, build_text_prompts
from qwen_tts.model.sampling import suppress_mask

from .decoder import DecodeJob, DecodeWorker, SlotDecoder
from .frame_step import EagerFrameStep, FrameStepRunner, SlotState, StepCodes
from .icl_cache import IclCache
from .prefill import PrefillRunner
from .scheduler import RequestState, StepPlan, chunk_schedule

log = logging.getLogger("qwen_tts.engine")

# Padded tokens per batched prefill forward (bounds memory when many requests arrive at once).
PREFILL_TOKENS_PER_BATCH = 4096
PREFILL_MAX_BATCH = 16  # prompts per prefill forward
PROMPT_EXTRA_TOKENS = 16  # prompt tokens beyond the text's (role, control and codec prefix)


def max_prompt_len(config: EngineSettings) -> int:
    """The longest prompt the prefill and the talker cache take (an ICL prompt's reference included)."""
    return config.max_text_tokens + PROMPT_EXTRA_TOKENS


def talker_cache_len(config: EngineSettings) -> int:
    """The talker cache's positions: the longest prompt and the most frames."""
    return max_prompt_len(config) + config.max_frames


def uses_graphs(fast: FastPath, device: torch.device) -> bool:
    """Whether the frame step replays CUDA graphs (frame_step "graphs", or "auto" on CUDA)."""
    mode = fast.frame_step
    return mode == "graphs" or (mode == "auto" and device.type == "cuda")


class ModelRunner:
    """The model and everything built around it for one engine (see the module docstring).

    `model_info` and `timings` are the engine's dicts, filled here; `cv` is the engine's condition (the decoder
    notifies it). The callbacks are the engine's: `deliver(state, codes, wav)` and `decode_failed(state, message)`
    from the decoder, `finish(state, reason, error)` for a request that fails or was cancelled at admission, and
    `start(state)` for a request prefilled into its slot.
    """

    def __init__(
        self,
        config: EngineSettings,
        fast: FastPath,
        device: torch.device,
        dtype: torch.dtype,
        model: Qwen3TTS | None,
        model_dir: Path,
        cfg: ModelConfig,
        model_info: dict[str, Any],
        timings: dict[str, Any],
        cv: threading.Condition,
        *,
        deliver: Callable[[RequestState, Tensor, Tensor], None],
        decode_failed: Callable[[RequestState, str], None],
        finish: Callable[[RequestState, FinishReason, str | None], None],
        start: Callable[[RequestState], None],
    ):
        self.config = config
        self.fast = fast
        self.device = device
        self.dtype = dtype
        self._model = model
        self._model_dir = model_dir
        self._cfg = cfg
        self._model_info = model_info
        self._timings = timings
        self._cv = cv
        self._deliver, self._decode_failed, self._finish, self._start = deliver, decode_failed, finish, start
        self._frame_step: EagerFrameStep | FrameStepRunner | None = None
        # The launched frame step whose codes are not read yet (overlap_steps): its rows and codes.
        self._ahead: tuple[list[RequestState], StepCodes] | None = None
        self._decoder: DecodeWorker | None = None
        self.icl = IclCache()  # ICL voices' code blocks and decoder starts (engine loop; icl_cache.py)
        self._heads = HeadCache()  # the prompts' role and control rows per language (engine loop)

    @property
    def _uses_graphs(self) -> bool:
        return uses_graphs(self.fast, self.device)

    @property
    def cfg(self) -> ModelConfig:
        return self._cfg

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def decoder(self) -> DecodeWorker:
        return self._decoder

    @property
    def ahead(self) -> list[RequestState] | None:
        """The rows of the frame step launched and not read yet (overlap_steps), or None."""
        return self._ahead[0] if self._ahead is not None else None

    # ------------------------------------------------------------------ set-up
    def load(self) -> None:
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
        self._model_info["decoder_dtype"] = str(self._code2wav.decoder_dtype).removeprefix("torch.")
        self._tokenizer = m.tokenizer
        self._role_ids = self._tokenizer.chat_ids("")[:3]
        self._pad_id = cfg.tts_pad_token_id
        # The prompts' text rows by token, each projected once (engine loop): a prompt's text is one gather.
        self._text = TextTable(self._talker, self._pad_id)
        self._max_len = talker_cache_len(self.config)
        S = self.config.max_slots
        # One slot more than requests: the scratch slot (index S) that padding rows of a graphed step write to.
        self._cache = self._talker.new_cache(S + 1, self._max_len, device=self.device, dtype=self.dtype)
        self._state = SlotState.zeros(S + 1, t.hidden_size, t.vocab_size, self.device, self.dtype)
        # Control ids (>= codebook size) are never sampled for codebook 0, except end-of-speech.
        self._suppress = suppress_mask(t.vocab_size, t.codebook_size, t.codec_eos_token_id, self.device)
        self._eos = t.codec_eos_token_id
        self._codebook_size = t.codebook_size
        # The CUDA fast path, handed to the talker and Code2Wav; None on CPU, where the model runs its own modules.
        self._fast_step = fastpath.build(
            self._talker, self._code2wav, self.fast, self.device, self._max_len, self.config.fused_deterministic
        )
        if self._fast_step is None:
            self._code2wav.set_polyphase_dilation(0)  # a CUDA-only choice
        self._model_info.update(fastpath.model_info(self._talker, self._code2wav, self._fast_step))
        graphs = self._uses_graphs
        if graphs or self.fast.frame_step == "padded":
            self._frame_step = FrameStepRunner(
                self._talker, self._state, self._cache, self._suppress, self._eos, S, scratch=S, use_graphs=graphs
            )
            if graphs and self.config.warmup:
                with torch.inference_mode():
                    self._frame_step.capture_all()
        else:
            self._frame_step = EagerFrameStep(self._talker, self._state, self._cache, self._suppress, self._eos)
        self._model_info["overlap_steps"] = self._overlap
        # Prefill: graphed with graphed frame steps; padded to the same buckets on CUDA otherwise, so an eager
        # engine prefills at the graphed one's shapes; at exact shapes on CPU.
        if graphs:
            prefill_mode = "graphs"
        elif self.device.type == "cuda" or self.fast.frame_step == "padded":
            prefill_mode = "padded"
        else:
            prefill_mode = "exact"
        with torch.inference_mode():
            self._prefiller = PrefillRunner(
                self._talker,
                self._cache,
                scratch=S,
                max_batch=min(S, PREFILL_MAX_BATCH),
                max_len=max_prompt_len(self.config),
                max_tokens=PREFILL_TOKENS_PER_BATCH,
                mode=prefill_mode,
            )
            if self.config.warmup:
                self._prefiller.capture_all()
        self._model_info["prefill_graphs"] = self._prefiller.num_graphs
        self._decode_batch = min(S, self.config.decode_max_batch)
        c = self.config
        self._chunk_sizes = chunk_schedule(c.first_chunk_frames, c.chunk_frames, c.chunk_growth)
        if graphs and self.fast.decode_graphs:
            mode = "graphs"
        else:
            mode = "padded" if self.fast.frame_step == "padded" else "exact"
        with torch.inference_mode():
            slot_decoder = SlotDecoder(
                self._code2wav,
                S,
                self._chunk_sizes,
                mode,
                max_batch=self._decode_batch,
                tf32_matmul=self.config.decoder_tf32,
            )
            if self.config.warmup:
                slot_decoder.capture_all()
        self._model_info["decode_graphs"] = mode == "graphs"
        self._model_info["decode_thread"] = self.fast.decode_thread
        # Without warm-up, graphs are captured on first use, by the engine loop and by the decoder thread. A
        # capture must not overlap the other thread's CUDA calls (torch.cuda.graph synchronises the device and
        # empties the allocator's cache on entry; seen on a GPU: "capturing stream has unjoined work"), so the
        # two threads then take turns around their GPU work. With warm-up every graph exists before either thread
        # starts and they run side by side.
        # Without graphs on CUDA both threads call torch.compile'd functions (the fused kernels, SnakeBeta) on every
        # step, and may compile them: while one thread traces, torch.fx patches nn.Module.__call__ process-wide and
        # the other thread's compiled call fails ("using FX to symbolically trace a dynamo-optimized function",
        # seen on a GPU). They take turns then too; the eager CUDA path is for debugging, not throughput.
        lazy = graphs and not self.config.warmup  # graphed prefill and Code2Wav come only with graphed steps
        compiles = not graphs and (self._model_info["fused_kernels"] or self._model_info["fused_decoder"])
        self._capture_guard = threading.Lock() if lazy or compiles else contextlib.nullcontext()
        self._decoder = DecodeWorker(
            slot_decoder,
            self._deliver,
            self._decode_failed,
            self._cv,
            self.fast.decode_thread,
            self._decode_batch,
            self._timings,
            gpu_guard=self._capture_guard,
        )
        log.debug("engine initialised: %s", self._model_info)  # model_info in full: for debugging

    def admit(self, admitted: list[RequestState]) -> None:
        """Build prompts and prefill newly admitted requests, batched (padded at the end) to spare launches: the
        x-vector prompts with their text in the prefill are built together in a fixed number of launches
        (`build_text_prompts`), the others one by one. Each prefilled request starts (`start`); one cancelled
        meanwhile, or whose prompt or prefill fails, finishes."""
        t0 = time.perf_counter()
        ready: list[RequestState] = []
        batch: list[RequestState] = []  # built together (build_text_prompts)
        for lv in admitted:
            lv.handle.stats.started_at = time.monotonic()
            if lv.cancelled:
                self._finish(lv, FinishReason.CANCELLED, None)
                continue
            if self._batchable(lv):
                batch.append(lv)
                continue
            self._prompt_or_fail(lv, ready)
        if len(batch) > 1:
            try:
                with torch.inference_mode(), record_function("prefill.prompt"):
                    prompts = build_text_prompts(
                        self._cfg, self._talker, [lv.text_ids for lv in batch], self._role_ids,
                        [lv.request.xvector for lv in batch], [lv.language for lv in batch], self._heads, self._text,
                    )  # fmt: skip
                for lv, prompt in zip(batch, prompts, strict=True):
                    lv.prompt = prompt
                ready += batch
                batch = []
            except Exception as e:  # find the culprit: each request's prompt on its own
                log.warning("batched prompts failed (%r); building them one by one", e)
        for lv in batch:
            self._prompt_or_fail(lv, ready)
        self._timings["prefill_prompt_s"] += time.perf_counter() - t0
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
        self._timings["prefill_s"] += time.perf_counter() - t0

    def _prompt_or_fail(self, lv: RequestState, ready: list[RequestState]) -> None:
        try:
            with torch.inference_mode(), record_function("prefill.prompt"):
                lv.prompt = self._build_prompt(lv)
            ready.append(lv)
        except Exception as e:
            self._fail_admission(lv, e)

    @staticmethod
    def _batchable(lv: RequestState) -> bool:
        """Whether `build_text_prompts` builds this request's prompt: an x-vector voice, its whole text known and
        in the prefill."""
        return lv.request.icl is None and lv.feed is None and lv.request.non_streaming_text

    def _build_prompt(self, lv: RequestState) -> Prompt:
        req = lv.request
        x = upload(req.xvector, self.dtype, self.device)
        text_ids = lv.feed.ids if lv.feed is not None else lv.text_ids
        icl = None
        if req.icl is not None:
            voice = self.icl.voice(req.icl, lv.ref_ids, lambda codes: reference_block(self._talker, codes))
            lv.icl_voice = voice
            if not voice.reference_queued:  # its decoder start, while the request prefills and steps
                voice.reference_queued = True
                self._decoder.decode_reference(voice)
            icl = IclRows(voice.ref_ids, voice.block)
        prompt = build_prompt(
            self._cfg,
            self._talker,
            text_ids,
            self._role_ids,
            x,
            lv.language,
            req.non_streaming_text,
            icl,
            self._heads,
            self._text,
        )
        if lv.feed is not None:
            lv.text_ids = list(text_ids)
            if not lv.feed.ended:  # the text goes on: its trailing rows so far, end-of-text comes with the end
                # (admission waited for the prefill's text, so the trailing track is there and ends in teos)
                if prompt.trailing.shape[0] == 0:
                    raise RuntimeError("a streamed request was prefilled before the text its prompt holds")
                prompt.trailing = prompt.trailing[:-1]
                lv.text_rows = prompt.trailing.shape[0]
        return prompt

    @staticmethod
    def _track_ids(lv: RequestState, ids: list[int]) -> list[int]:
        """The streaming-mode trailing text track's ids (end-of-text not counted) for the target text ids `ids`:
        the text after its first token (x-vector), or after the ICL prompt's T2 reference + target ids."""
        if lv.ref_ids is None:
            return ids[1:]
        return icl_trailing_ids(lv.ref_ids, ids, lv.request.icl.frames)

    def extend_text(self, rows: list[RequestState]) -> None:
        """Streamed rows with newly committed text ids (or the end of their text): their trailing text track grows
        by the new tokens' rows (the text table's, as the whole text's prompt has them), then end-of-text."""
        for lv in rows:
            if lv.prompt is None or lv.text_rows is None:
                continue
            ids = lv.feed.ids
            with torch.inference_mode():
                track = self._track_ids(lv, ids)
                parts = [lv.prompt.trailing, self._text.rows(track[lv.text_rows :])]
                if lv.feed.ended:
                    parts.append(lv.prompt.end[None])
                lv.prompt.trailing = torch.cat(parts)
            lv.text_ids = list(ids)
            lv.text_rows = None if lv.feed.ended else lv.prompt.trailing.shape[0]

    def _prefill(self, group: list[RequestState]) -> None:
        """One talker forward over several prompts. Padding sits after each prompt at later positions, so causal
        masking keeps it invisible to the real tokens, and the first decode steps overwrite its K/V."""
        try:
            with torch.inference_mode():
                lens = [lv.prompt.prefill.shape[0] for lv in group]
                t0 = time.perf_counter()
                with record_function("prefill.talker"), self._capture_guard:
                    last = self._prefiller.run([lv.prompt.prefill for lv in group], [lv.slot for lv in group])
                t1 = time.perf_counter()
                slots = upload([lv.slot for lv in group], torch.long, self.device)
                self._state.h[slots] = last
                with record_function("prefill.slots"):
                    self._set_slot_params(slots, [lv.request for lv in group])
                self._timings["prefill_talker_s"] += t1 - t0
                self._timings["prefill_slots_s"] += time.perf_counter() - t1
        except Exception as e:
            if len(group) > 1:  # find the culprit: prefill each request on its own
                for lv in group:
                    self._prefill([lv])
                return
            self._fail_admission(group[0], e)
            return
        for lv, n in zip(group, lens, strict=True):
            lv.pos = n
            self._start(lv)

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
        on = self.fast.overlap_steps
        if on is None:
            return self.device.type == "cuda" and not isinstance(self._frame_step, EagerFrameStep)
        return on

    # ------------------------------------------------------------------ execution (worker thread)
    def step(self, plan: StepPlan) -> None:
        """Launch one frame step for the plan's rows and read codes: this step's at once, or (overlap_steps) the
        step launched the turn before, while the GPU runs this one. A failed batched step is retried row by row,
        so one request's failure ends that request only."""
        rows, stepping = plan.rows, plan.stepping
        ahead = self._ahead
        launched: StepCodes | None = None
        failed = False
        if rows:
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

    def _fail_rows(self, rows: list[RequestState], e: Exception) -> None:
        for lv in rows:
            if lv.done is None:
                lv.done = FinishReason.ERROR
                lv.error = f"generation failed: {type(e).__name__}"

    def drain(self) -> None:
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
            return self._frame_step.launch(*args)

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

    def _unpadded(self, t: int) -> int:
        """The most frames, at most t, that the decoder decodes at their own length (t itself in exact mode, else
        the longest chunk length <= t; 0 if none). Only a request's last chunk may be padded: its state is not read
        again."""
        dec = self._decoder.decoder
        return max((c for c in (t, *dec.chunk_lens) if c <= t and dec.padded_len(c) == c), default=0)

    def decode_due(self, live: dict[int, RequestState]) -> None:
        """Hand the decoder the pending frames of rows whose next chunk is due (or that finished), one job per
        chunk shape; a finished row that still holds more than a chunk gets several jobs, in order."""
        cfg, dec = self.config, self._decoder.decoder
        while True:
            groups: dict[tuple, list[tuple[RequestState, int]]] = collections.defaultdict(list)
            for lv in live.values():
                if not lv.pending or lv.done in (FinishReason.CANCELLED, FinishReason.ERROR):
                    continue
                first = lv.queued == 0
                target = self._next_chunk(lv.queued)
                if len(lv.pending) >= target or lv.done is not None or lv.held:  # held: its audio so far goes out
                    t = min(len(lv.pending), target)
                    if lv.done is None and t < target:  # held, its request goes on: a chunk the decoder takes
                        t = self._unpadded(t)  # unpadded (padding frames would enter the row's stream state)
                        if not t:
                            continue
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
                        starts=[lv.icl_voice for lv in rows] if key[1] else None,
                    )
                )
