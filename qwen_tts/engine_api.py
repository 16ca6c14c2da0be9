"""The one engine interface that the server, the batch CLI and the benchmarks use.

An engine turns (x-vector, text, options) into a stream of float32 PCM chunks at `engine.sample_rate`. Nothing
above this interface knows which implementation (native PyTorch, vLLM-Omni, the fake) runs: callers build one
with `qwen_tts.engines.create_engine(EngineSettings(...))` and use only what is defined here.

    engine = create_engine(EngineSettings(model_path="demo"))
    await engine.start()
    handle = engine.submit(SynthesisRequest(text=..., xvector=...))
    async for chunk in handle:      # np.ndarray float32, mono, engine.sample_rate
        ...
    handle.stats.finish_reason      # eos | budget | cancelled | error
    engine.cancel(handle)           # stops the request's work at the next step
"""

from __future__ import annotations

import asyncio
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from .audio import SAMPLE_RATE

FRAME_SAMPLES = 1920  # 12.5 Hz codec frames at SAMPLE_RATE

__all__ = [
    "FRAME_SAMPLES",
    "SAMPLE_RATE",
    "Engine",
    "EngineError",
    "EngineNotReadyError",
    "EngineSettings",
    "EngineSettingsError",
    "FinishReason",
    "QueueFullError",
    "RequestFailedError",
    "RequestHandle",
    "RequestStats",
    "SynthesisRequest",
]

FrameStepMode = Literal["auto", "eager", "padded", "graphs"]


class FinishReason(str, Enum):
    EOS = "eos"  # the model emitted end-of-speech
    BUDGET = "budget"  # the frame budget (from text length, capped by max_frames) ran out
    CANCELLED = "cancelled"  # the client or caller cancelled
    ERROR = "error"  # the request failed; others are unaffected


class EngineError(Exception):
    """Base class of errors an engine raises at submission."""


class QueueFullError(EngineError):
    """Admission refused: all slots busy and the wait queue is full."""


class EngineNotReadyError(EngineError):
    """The engine is not started, is draining, or has died."""


class RequestFailedError(EngineError):
    """Raised from a handle's iteration when the request failed inside the engine."""


class EngineSettingsError(EngineError, ValueError):
    """An engine cannot be built from its settings; `setting` names the EngineSettings field at fault, so each
    caller can name its own option (TTS_MODEL_PATH, --model, ...) in front of the message."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting


@dataclass
class EngineSettings:
    """Everything an engine is built from; `qwen_tts.engines.create_engine` takes this and nothing else.

    The defaults here are the project's defaults: the server's settings and the batch CLI's options take theirs
    from this class and map onto it in one function each.
    """

    model_path: str = "demo"  # 'demo' (the tiny random checkpoint), a checkpoint directory, or a hub id in the cache
    backend: str = "native"  # native | vllm-omni | fake (sine tones, for HTTP load tests)
    demo_dir: Path | None = None  # where the demo checkpoint is written (None: a per-user cache directory)
    stage_config: Path | None = None  # vLLM-Omni deploy config; read only by that backend
    stage_init_timeout: float = 600.0  # vllm-omni: seconds each stage process may take to start
    # vllm-omni: how the speaker vector reaches the talker: tensor (raw bytes, needs vllm-omni-myfi), list (floats,
    # stock vLLM-Omni), auto (tensor when the plugins are installed)
    vllm_speaker_transport: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA (Code2Wav always float32)
    max_slots: int = 16  # requests decoding at once
    max_queue: int = 64  # requests waiting for a slot; beyond that, QueueFullError
    max_frames: int = 2048  # hard cap per request (frames of 80 ms)
    max_text_tokens: int = 1024  # longest accepted text, in tokens (sizes the KV cache)
    first_chunk_frames: int = 3  # small first chunk: the first audio comes fast
    chunk_frames: int = 12  # later chunks: fewer, larger decodes
    # Each chunk after the first at most this many times the one before, up to chunk_frames (3, 6, 12, 12, ...
    # frames by default; `chunk_schedule`). A chunk of g times the audio already sent arrives before that audio runs
    # out only if the stream runs at >= g x real time: with the jump from 3 to 12 frames (g = 4) the 1.7B's streams
    # at 2.3x (256 on an H200) stalled ~100 ms at p95; a ramp of 2 should keep them ahead (not yet measured;
    # bench_gpu.py --engine-variants chunk-jump is the old schedule).
    chunk_growth: int = 2
    warmup: bool = True
    # When the engine is idle, wait this long after the first arrival so a burst shares one batched prefill.
    admission_window_s: float = 0.002
    # Hold new requests in the queue while the running ones get a frame less often than every this many ms (the
    # engine's recent time per frame step, a moving average); 0 admits whenever a slot is free. A frame is 80 ms of
    # audio, so 64 keeps each running stream at >= 1.25x real time instead of letting every admission slow all of
    # them below it; a request is always admitted when nothing runs. Off by default: whole-file clients do not need
    # real time, and on CPU a stream rarely has it.
    admission_step_budget_ms: float = 0.0
    # TF32 cuDNN convolutions in the float32 Code2Wav on CUDA: 3.5x faster at batch 64 on an H200 and no 52 GiB
    # cuDNN workspace spike; the audio moves by at most -52 dBFS from the exact decode (chunk joins -62 dBFS,
    # docs/history/benchmarks-diary.md). False: exact streaming (stream == whole decode to ~1e-5). No effect on CPU.
    decoder_tf32: bool = True
    # How the native engine runs its batched frame step: auto = CUDA graphs on CUDA (one per batch and kv-length
    # bucket, captured at start when warmup is on, else on first use; ~10x fewer launches), eager at exact shapes
    # on CPU; eager; graphs; padded = the graphs' padded, bucketed step run eagerly (tests its logic on CPU).
    frame_step: FrameStepMode = "auto"
    # On CUDA, run one-token decoder steps on the fast path (qwen_tts/fastpath/fused.py: fused weights, compiled blocks,
    # in-place Triton attention, the sampler kernel): the same function in far fewer kernels. Ignored on CPU.
    fused_kernels: bool = True
    # On the fast path, attend with the kernel split over positions (decode_attention.split_decode_attention:
    # ten programs per row and kv head at 300 positions instead of one, q.k and P.V on the tensor cores) instead
    # of one program per row and kv head. Same function. On an H200 the graphed 1.7B step went 7.66 -> 6.73 ms at
    # batch 1 and 9.38 -> 7.75 ms at batch 64 (docs/history/benchmarks-diary.md; bench_gpu.py --engine-variants
    # no-split-attention for the A/B). Ignored on CPU.
    split_attention: bool = True
    # On the fast path, the decoder layers' matmuls of up to 16 rows through our Triton kernel
    # (qwen_tts/fastpath/small_m_gemm.py: more thread blocks than SMs for every weight) instead of cuBLAS's 64x8 tiles. On
    # an H200 with split attention: one 1.7B stream 10.5x -> 11.7x real time (step 7.4 -> 6.7 ms); more rows go to
    # cuBLAS, so batches of 64+ are unchanged (bench_gpu.py --engine-variants no-small-m-gemm). Ignored on CPU.
    small_m_gemm: bool = True
    # With small_m_gemm, split K over up to this many programs for weights with fewer column blocks than SMs (the
    # code predictor's 1024-wide o and down projections: 32 blocks on an H200's 132 SMs); 1 never splits. The
    # partial sums are added in a fixed order (small_m_gemm.py), so codes stay deterministic and batch invariant.
    # On an H200 the 1.7B step's matmuls at 2 rows: 3.40 ms unsplit, 2.97 with split 4 (bench_gemm.py
    # --max-splits; bench_gpu.py --engine-variants no-split-k). Process-wide. Ignored on CPU.
    small_m_split_k: int = 4
    # On the fast path, compile its regions with inductor's emulate_precision_casts (fused.set_emulate_casts): each
    # bf16 intermediate rounded where the eager layers round it (the RMSNorm's cast, RoPE's products, the residual
    # adds, SiLU * up) instead of kept in float32 inside a fused kernel. Same function, rounded as the official
    # package rounds. Measured on an H200 (make_fixture.py --teacher-forced, 1.7B and 0.6B, 64 frames): the same
    # step (4.535 against 4.532 ms at batch 1), logits 1.47-1.57% (relative RMS) from the official bf16 generation's
    # instead of 1.67-1.70%, but 1.40-1.48% from exact float32, as the official bf16 is, instead of 1.03-1.10%. Off:
    # the default is the closer to exact. Process-wide. Ignored on CPU.
    fused_emulate_casts: bool = False
    # On the fast path, compile its regions in inductor's deterministic mode (fused.set_deterministic): each
    # reduction kernel's configuration picked by a fixed rule instead of timed on first use, so a restarted server
    # or another replica sums the RMSNorms in the same order and gives the same bits for the same request and seed.
    # Measured on an H200 (benchmarks/bench_reproducible.py, 0.6B, two fresh processes each, empty caches): without
    # it 39% of the talker's and 53% of the code predictor's bf16 logits differed between the two processes, and a
    # top-1 flipped; with it both runs were bit-identical. Cost: the 1.7B step 4.543 -> 4.597 ms at batch 1, 6.237 ->
    # 6.245 at batch 64 (profile_step.py, graph replays); one stream 15.47x real time with it. Process-wide. Ignored
    # on CPU and where torch has no such mode (bench_gpu.py --engine-variants no-deterministic).
    fused_deterministic: bool = True
    # With small_m_gemm, the talker's codec head and the code predictor's 15 heads (16 matmuls of 4-12 MB a frame
    # step, cuBLAS's by default) through the few-row kernel as well (fused.set_small_m_heads). Measured on an H200
    # (profile_step.py, graph replays): the 0.6B step 3.97 -> 3.99 ms at batch 1, 5.65 -> 5.65 at batch 64; cuBLAS
    # already takes ~4.4 us a head there. A row's logits then do not depend on the rows beside it, which with both
    # stack kernels on "cuda" lets a lone stream's steps run one row instead of two (frame_step.one_row_steps): one
    # 0.6B stream 17.2x -> 24.7x real time on an H200 with the three settings (docs/history/benchmarks-diary.md, sixteenth round;
    # the 1.7B's talker does not fit the kernel, so its steps stay two rows). Off (bench_gpu.py --engine-variants
    # small-m-heads). Ignored on CPU.
    small_m_heads: bool = False
    # On the fast path, the code predictor's input for its passes 2-15 gathered from 14 tables made once, each
    # residual embedding table through small_to_mtp_projection (CodePredictor.build_input_tables: 59 MB for the
    # 1.7B), instead of an embedding row through the projection's matmul and bias every pass. Nothing to do where
    # the projection is an Identity (the 0.6B). Measured on an H200 (profile_step.py, 1.7B, graph replays, with
    # small_m_heads): the step 4.69 -> 4.59 ms at batch 1, 6.28 -> 6.20 at batch 64; the 15 bias-fused cuBLAS
    # kernels took 0.16 ms a step at batch 1 (bench_gpu.py --engine-variants no-cp-input-tables). Ignored on CPU.
    cp_input_tables: bool = True
    # On the fast path, each code-predictor pass through one kernel for the whole stack ("off": the fused path's
    # kernels). "cuda": passes of at most four bf16 rows by our CUDA kernel (qwen_tts/fastpath/stack/stack_cuda.cu, compiled by NVRTC when the
    # engine starts; if it cannot compile there, a warning and the fused path), whose weights reach shared memory a
    # phase ahead of each grid wait: 131.5 us a pass at one row against 213 (fused), 150 against 174 at two rows,
    # but 191 against 176 at four (fifteenth round); one 1.7B stream 15.37x -> 15.84x real time and two 15.99x ->
    # 16.41x (fourteenth round: the engine runs a lone row as two unless one_row_steps), first audio +2 ms (its
    # blocks hold every SM, so Code2Wav waits). Its rows are batch invariant among themselves, not against the fused
    # path's: a request's codes match alone and beside one other stream, not beside more. So off by default
    # (docs/history/benchmarks-diary.md; bench_gpu.py --engine-variants cp-stack-cuda). Ignored
    # on CPU.
    cp_stack_kernel: str = "off"
    # On the fast path, the talker's passes of at most four bf16 rows by the same CUDA kernel ("cuda"; "off": the
    # fused path's kernels). Its attention over the talker's long cache runs in chunks of positions whose partial
    # softmax sums the last chunk to finish combines. The kernel holds two of a layer's weight shares per block in
    # shared memory: the 0.6B's talker layer (the code predictor's shape) fits an H200's SMs, the 1.7B's does not, and
    # there a warning says so and the fused path runs. The same batch invariance as cp_stack_kernel: among passes of
    # up to four rows. Off by default (docs/history/benchmarks-diary.md; bench_gpu.py --engine-variants talker-stack-cuda). Ignored
    # on CPU.
    talker_stack_kernel: str = "off"
    # With either stack kernel on "cuda": launch it on only as many SMs as keep each block's largest share of every
    # phase (stack_cuda.lean_blocks: 128 of an H200's 132 for the code predictor and the 0.6B's talker), so Code2Wav's
    # kernels on the decoder's stream have SMs of their own while a pass holds the rest. The same bits (a row's sums
    # do not depend on the grid). On an H200 one 0.6B stream 22.1x -> 23.1x real time, one 1.7B stream 17.4x ->
    # 17.7x, in one device call (sixteenth round, docs/history/benchmarks-diary.md; bench_gpu.py --engine-variants full-grid for
    # every SM). Ignored unless a stack runs on the kernel.
    stack_lean_grid: bool = True
    # With either stack kernel on "cuda": the weight copies marked first to leave L2 (stack_cuda's `evict_first`), so
    # the weight stream does not push the caches' keys and values and the activations out of it. The same bits. On an
    # H200 one 0.6B stream 24.13x -> 25.11x, one 1.7B stream 18.30x -> 18.62x (nineteenth round, docs/history/benchmarks-diary.md),
    # so on (bench_gpu.py --engine-variants no-stack-evict-first for the plain copies).
    stack_evict_first: bool = True
    # With the code predictor's stack kernel on "cuda": a block's threads (stack_cuda's `threads`; 256 or 512). With
    # 512 each warp of a block has half the weight rows of q|k|v and gate|up, and attention's vectors and scores are
    # spread over sixteen warps: the same sums, the same bits. Measured on an H100 (twenty-second round,
    # docs/history/benchmarks-diary.md): a pass 120.9 -> 113.4 us at one row, 137.0 -> 126.8 at two, 173.5 -> 160.5 at four; one
    # 0.6B stream 23.81x -> 24.32x real time, one 1.7B stream 17.46x -> 17.87x. So 512 (bench_gpu.py
    # --engine-variants cp-stack-threads-256 for 256).
    cp_stack_threads: int = 512
    # The same for the talker's stack kernel (stack_cuda's `long_threads`): a long cache's positions stay on eight
    # warps, so the same bits at either size. At 512 its build spills registers (the kernel's register cap halves):
    # on an H100 the 0.6B's talker pass 732.5 -> 807.3 us at one row, one 0.6B stream 24.32x -> 24.12x (twenty-second
    # round). So 256 (bench_gpu.py --engine-variants talker-stack-threads-512).
    talker_stack_threads: int = 256
    # With either stack kernel on "cuda": a pass of M <= stack_exact_rows rows (0-3; one stream's steps are one row)
    # launches a build of the kernel compiled for M rows (stack_cuda's `exact_rows`), not the one for four: the same
    # sums in the same order, so the same bits, with the rows' loops and registers for M rows only and less code
    # (sm_90, one row: the code predictor's 141 -> 105 KB, the 0.6B talker's 171 -> 132 KB; two rows 116 and 144 KB).
    # Measured on an H100 (twenty-ninth round, docs/history/benchmarks-diary.md) with the one-row build: a code-predictor pass
    # 112.5 -> 100.2 us at one row, the 0.6B talker's 712.4 -> 606.4 us (position 100); one 0.6B stream 26.54x ->
    # 29.57x real time, one 1.7B stream 18.50x -> 19.38x. So 1. The two- and three-row builds (2, 3) are built and
    # tested on the CPU, not yet on a GPU (bench_gpu.py --engine-variants stack-exact-rows-3; no-stack-exact-rows
    # for 0).
    stack_exact_rows: int = 1
    # With the talker's stack kernel on "cuda": at the start of each layer's attention phase, before its grid wait, a
    # block's attention unit has the copy engine bring its chunk's cached keys and values (up to 192 positions for
    # the 0.6B's talker) into the weight slot that phase leaves free, and reads them from shared memory instead of
    # waiting on L2 or HBM after this pass's queries (stack_cuda's `stage`). The same bits. On an H100 (twenty-third
    # round, docs/history/benchmarks-diary.md) the 0.6B's talker pass 735.9 -> 709.2 us at one row and position 100, 767.3 -> 755.8
    # at position 300, 825.7 -> 815.4 at two rows; one 0.6B stream 25.03x -> 25.13x real time (call 3). So on
    # (bench_gpu.py --engine-variants no-talker-stack-stage for off). Staging the code predictor's cache too was
    # slower (113.1 -> 114.1 us a pass; one 0.6B stream 24.76x -> 24.40x, call 2) and was removed.
    talker_stack_stage: bool = True
    # With the talker's stack kernel on "cuda": a row's positions up to this many are one chunk of its attention
    # (stack_cuda's `chunk`, a multiple of 32); past it, chunks of at least talker_stack_split positions, at most
    # four, combined by the last to finish (other sums than one chunk's: a fixed order, batch invariant). Measured
    # with the split equal to the chunk, on H100s: 192 with talker_stack_stage (one chunk, staged whole, up to 192
    # positions) took the talker's pass at position 100 709.2 -> 695.8 us but at 300 755.8 -> 774.3, one 0.6B stream
    # 25.13x -> 25.02x (twenty-third round, call 3); 32 took it 742.8 -> 691.4 us at position 100 and 660.4 -> 686.7
    # at 40 (two chunks where 64 has one), one 0.6B stream within the spread (twenty-sixth round, call 1). So 64
    # (bench_gpu.py --engine-variants talker-stack-chunk-192, talker-stack-chunk-32; both keep the split's 32).
    talker_stack_chunk: int = 64
    # With the talker's stack kernel on "cuda": past talker_stack_chunk positions, the fewest positions a chunk takes
    # (stack_cuda's `split`: 0, as talker_stack_chunk; else a multiple of 32 up to it). A row's positions up to the
    # chunk stay one chunk (no combine); past it they spread over more, shorter chunks (at 32: 3 chunks at 65-96
    # positions, 4 from 97, against 2 and 2-3 at 64). Other sums than 0's (a fixed order, batch invariant). On an
    # H100 (twenty-sixth round, docs/history/benchmarks-diary.md), one 0.6B stream with 32 against 0, median of three requests
    # each: 24.75 / 24.91 against 24.54 / 24.68 (call 3, in the order 0, 32, 32, 0), 24.67 / 24.78 against
    # 24.55 / 24.65 (call 5, 32, 0, 0, 32), 25.40 against 25.30 (call 6): +0.4-0.9% in each pair. So 32
    # (bench_gpu.py --engine-variants talker-stack-split-0 for 0).
    talker_stack_split: int = 32
    # On the fast path, the code predictor's two prompt tokens (the talker's hidden state, codebook 0) run as two
    # rows of one pass instead of two passes: 15 passes per frame instead of 16 (fused.stack_step's shared_slots).
    # On an H200 the graphed step at batch 1 went 5.66 -> 5.54 ms; with the sampler kernel and polyphase convs on,
    # one 1.7B stream 14.6x -> 15.0x real time and 64 streams 414 -> 420 audio-s/s in one process (256 streams
    # 675 -> 654, inside the default's own spread between two device calls: 634 and 675). bench_gpu.py
    # --engine-variants cp-two-passes; the CUDA tests check it against the reference loop. Ignored on CPU.
    cp_prompt_one_pass: bool = True
    # On the fast path, draw each code with one Triton kernel that finds top-k's k-th largest logit (and top-p's
    # cut) by bisection instead of sorting the row (qwen_tts/fastpath/sample_kernel.py): the same draws for top-k, one
    # launch instead of the compiled sampler's sort and ~4 kernels around it, 16 times a frame. On an H200: a
    # draw 10-16 us instead of 45-83 (bench_sampler.py); the graphed step at batch 1 5.66 -> 5.19 ms; one 1.7B
    # stream 13.2x -> 14.6x real time, 64 streams 356 -> 399 audio-s/s (docs/history/benchmarks-diary.md; bench_gpu.py
    # --engine-variants no-kernel-sampler). False: the compiled sampling.sample. Ignored on CPU.
    kernel_sampler: bool = True
    # With kernel_sampler, each code-predictor pass's draw also writes its code, adds the code's embedding row into
    # the frame's codec sum and writes the next pass's input row (sample_kernel.sample_feed): one launch a pass where
    # four ran (the draw, the embedding's gather, the add, the input table's gather), the same codes and sums.
    # Needs the next input as one gathered row (cp_input_tables, or a code predictor without the projection).
    # bench_gpu.py --engine-variants cp-unfused-feed. Ignored on CPU.
    cp_fused_feed: bool = True
    # With kernel_sampler, row elements per warp of the sampler kernel (sample_kernel.set_warp_elements; a power
    # of two, 32-4096): 512 runs the code predictor's 2048 logits on 4 warps. On an H200 512 was the fastest or
    # within 1 us of it at every batch (bench_sampler.py): 2048 (one warp) took 42 us a draw. Process-wide.
    kernel_sampler_warp_elements: int = 512
    # On CUDA, run Code2Wav's SnakeBeta activations (its largest tensors) as one compiled kernel each instead of
    # five eager passes: a 64-row 12-frame chunk 79 -> 65 ms on an H200, 64 streams 277 -> 313 audio-s/s, 256
    # streams 448 -> 525; the audio stays within -52 dBFS of the exact decode as without it, chunk joins -59 instead
    # of -62 dBFS (docs/history/benchmarks-diary.md). With decoder_snake_kernel (the default) the final conv stack takes its
    # SnakeBeta from that kernel instead; this one then runs only with decoder_snake_kernel off. Ignored on CPU.
    fused_decoder: bool = True
    # On CUDA, run Code2Wav's final conv stack (50 Hz to the waveform, where its time goes) in float16 instead of
    # float32 with TF32: half the bytes, twice the tensor-core rate, every op accumulating in float32. On an H200
    # the full-size random decoder's audio stays within -50.2 dBFS of the exact float32 decode (TF32: -52.4),
    # chunk joins -58.5 (TF32: -59.3); a 64-row 12-frame chunk 60.8 -> 55.6 ms, 1.7 instead of 3.3 GiB of
    # scratch; 64 streams 307 -> 358 audio-s/s, 256 streams 524 -> 604 (docs/history/benchmarks-diary.md; bench_gpu.py
    # --engine-variants fp32-decoder, profile_step.py --codec-variants fp16-decoder). Ignored on CPU.
    decoder_fp16: bool = True
    # On CUDA, run the final conv stack's convs with a dilation >= this as undilated convs over the input's
    # interleaved phases (Code2Wav.set_polyphase_dilation; 0: off). On an H200 cuDNN ran one of them (384
    # channels, dilation 9) in 8.8 ms of a 64-row 12-frame float16 chunk's 45, even with cudnn.benchmark; as
    # undilated convs it takes 1.3 ms, the chunk's kernels 45.2 -> 38.8 ms, the audio as close to the exact decode
    # (-50.4 dBFS, joins -58.5); 256 streams 561 -> 605 audio-s/s (docs/history/benchmarks-diary.md; bench_gpu.py
    # --engine-variants no-polyphase). Ignored on CPU.
    decoder_polyphase_dilation: int = 9
    # On CUDA, run the final conv stack's elementwise work as one Triton kernel per activation
    # (Code2Wav.set_snake_kernel, qwen_tts/fastpath/snake_kernel.py): each conv without its bias, then one pass that adds
    # the bias and the residual, applies SnakeBeta and writes the next conv's input with its left context in front,
    # instead of cuDNN's bias pass, the residual add, the compiled SnakeBeta and the history concatenation. The
    # same function, rounded once per activation instead of once per op. On an H200 a 64-row 12-frame float16
    # chunk 47.2 -> 30.8 ms (kernels 38.8 -> 24.3 ms), the audio as close to the exact decode (-50.5 dBFS, joins
    # -57.7); 64 streams 411 -> 481 audio-s/s, 256 streams 665 -> 778 (docs/history/benchmarks-diary.md; bench_gpu.py
    # --engine-variants no-snake-kernel). Takes the place of fused_decoder's compiled SnakeBeta. Ignored on CPU.
    decoder_snake_kernel: bool = True
    # With decoder_snake_kernel, lay the final conv stack's activations out (batch, samples, channels) in memory
    # and run its convs in that layout (Code2Wav.set_snake_kernel(channels_last=True)): on an H200 cuDNN's
    # float16 kernels transformed every (batch, channels, samples) input and output, 4.8 ms of a 64-row 12-frame
    # chunk's 24.3 ms of kernels; its k=1 convs become matmuls and its polyphase convs read a free view of
    # whole phases. The same function. Measured on an H200 (profile_step.py, three device calls): the chunk's
    # kernels 24.4 -> 16.3 ms (layout transforms 4.9 -> 0.3 ms, copies 3.0 -> 1.0, the snake kernel 5.9 -> 4.4), the
    # audio as close to the exact decode (-50.5 dBFS, joins -57.7), 0.46 GiB less scratch. Through the engine only
    # its one-stream row was measured (14.52x against 14.44x); its 64-stream row did not come within the stage's
    # limit, so it stays off until the engine's figures at 64 and 256 streams are in (bench_gpu.py
    # --engine-variants channels-last; profile_step.py --codec-variants fp16+polyphase-9+snake-kernel+channels-last).
    decoder_channels_last: bool = False
    # Decode each request's chunks on their own instead of batched with others' of the same length: the waveform
    # is then a function of the request's codes alone, bit for bit, whatever else runs (a batched convolution
    # rounds differently: 1 int16 LSB on ~1% of samples). Costs the batching of Code2Wav; docs/security.md.
    batch_invariant_decode: bool = False
    # Run Code2Wav on a thread (and, on CUDA, a stream) of its own beside the frame steps, so decoding overlaps
    # generation; False decodes inline in the engine loop (same audio, for A/B measurements).
    decode_thread: bool = True
    # With CUDA-graph frame steps, also replay Code2Wav from a CUDA graph per (batch bucket, chunk length):
    # one launch instead of ~1,000 per chunk. Chunks shorter than their bucket are padded and trimmed.
    decode_graphs: bool = True
    # Graphed Code2Wav moves its inputs and audio through pinned host buffers and waits on an event. False: pageable
    # copies, whose blocking copy of the audio held the engine loop up for as long as the chunk ran on the GPU (one
    # 0.6B stream 24.7x -> 25.6x in the benchmark on an H100 with pinned buffers; docs/history/benchmarks-diary.md, 27th round).
    decode_pinned_io: bool = True
    # On CUDA, run the engine loop's work (prefill, frame steps) on a high-priority CUDA stream: Code2Wav's long
    # convolution kernels on the decoder's stream then fill the SMs the frame step leaves idle instead of making
    # its ~1,800 short kernels wait behind them. False: the engine loop uses the default stream.
    step_stream_priority: bool = True
    # Launch each frame step before reading the codes of the one before, so the GPU runs step N+1 while the host
    # handles step N's codes (end-of-speech, chunks for the decoder) instead of idling. A row that turns out to
    # have ended at step N was stepped once more for nothing (discarded; its slot is reset on reuse, as after any
    # end-of-speech step). None: on where steps run asynchronously (CUDA, graphed or padded), off on CPU and for the
    # eager CUDA step, which compute as they are launched, so the extra step would only cost. On an H200: one
    # stream 12.8 -> 13.6x, 64 streams 346 -> 373 audio-s/s, 256 streams 555 -> 588 (bench_gpu.py
    # --engine-variants no-overlap).
    overlap_steps: bool | None = None
    # Chunks of one request that may wait in or for the decoder before that request's generation pauses.
    decode_lookahead: int = 2
    # Most rows in one Code2Wav call (and its largest graph bucket): a 12-frame chunk of 64 rows already fills an
    # H200, and larger buckets only add graph memory. More rows due at once are decoded in several calls.
    decode_max_batch: int = 64

    def __post_init__(self) -> None:
        names = (
            "max_slots",
            "max_frames",
            "max_text_tokens",
            "first_chunk_frames",
            "chunk_frames",
            "decode_lookahead",
            "decode_max_batch",
        )
        for name in names:
            if getattr(self, name) < 1:
                raise EngineSettingsError(name, f"{name} must be >= 1")
        if self.admission_step_budget_ms < 0:
            raise EngineSettingsError(
                "admission_step_budget_ms",
                f"admission_step_budget_ms must be >= 0, not {self.admission_step_budget_ms}",
            )
        if self.chunk_growth < 2:
            raise EngineSettingsError("chunk_growth", f"chunk_growth must be >= 2, not {self.chunk_growth}")
        if self.max_queue < 0:
            raise EngineSettingsError("max_queue", "max_queue must be >= 0")
        if not 0 <= self.stack_exact_rows <= 3:
            raise EngineSettingsError(
                "stack_exact_rows", f"stack_exact_rows must be 0 to 3 rows, not {self.stack_exact_rows!r}"
            )
        if not 1 <= self.small_m_split_k <= 8:
            raise EngineSettingsError(
                "small_m_split_k", f"small_m_split_k must be 1 to 8, not {self.small_m_split_k!r}"
            )
        if self.talker_stack_chunk < 32 or self.talker_stack_chunk % 32:
            raise EngineSettingsError(
                "talker_stack_chunk",
                f"talker_stack_chunk must be a multiple of 32 positions, not {self.talker_stack_chunk!r}",
            )
        if (
            self.talker_stack_split < 0
            or self.talker_stack_split % 32
            or self.talker_stack_split > self.talker_stack_chunk
        ):
            raise EngineSettingsError(
                "talker_stack_split",
                f"talker_stack_split must be 0 or a multiple of 32 positions up to talker_stack_chunk "
                f"({self.talker_stack_chunk}), not {self.talker_stack_split!r}",
            )
        for name in ("cp_stack_threads", "talker_stack_threads"):
            if getattr(self, name) not in (256, 512):
                raise EngineSettingsError(name, f"{name} must be 256 or 512, not {getattr(self, name)!r}")
        from .fastpath.sample_kernel import warp_elements_error  # the kernel's own rule; imported here, not at load

        if err := warp_elements_error(self.kernel_sampler_warp_elements):
            raise EngineSettingsError("kernel_sampler_warp_elements", f"kernel_sampler_warp_elements {err}")
        if self.decoder_polyphase_dilation < 0:
            raise EngineSettingsError(
                "decoder_polyphase_dilation",
                f"decoder_polyphase_dilation must be >= 0, not {self.decoder_polyphase_dilation!r}",
            )
        if self.cp_stack_kernel not in ("off", "cuda"):
            raise EngineSettingsError(
                "cp_stack_kernel", f"cp_stack_kernel must be off or cuda, not {self.cp_stack_kernel!r}"
            )
        if self.talker_stack_kernel not in ("off", "cuda"):
            raise EngineSettingsError(
                "talker_stack_kernel", f"talker_stack_kernel must be off or cuda, not {self.talker_stack_kernel!r}"
            )
        if self.frame_step not in ("auto", "eager", "padded", "graphs"):
            raise EngineSettingsError(
                "frame_step", f"frame_step must be auto, eager, padded or graphs, not {self.frame_step!r}"
            )


def chunk_schedule(first: int, chunk: int, growth: int) -> list[int]:
    """The streaming chunk sizes in frames: `first`, then each at most `growth` times the one before, up to `chunk`,
    which repeats (the last entry). chunk_schedule(3, 12, 2) == [3, 6, 12]."""
    sizes = [first]
    while sizes[-1] < chunk:
        sizes.append(min(chunk, sizes[-1] * growth))
    return sizes


@dataclass
class SynthesisRequest:
    """One synthesis job. Defaults follow the checkpoints' generation_config.json."""

    text: str
    xvector: torch.Tensor  # (D,) float32; D = talker hidden size
    language: str = "auto"
    non_streaming_text: bool = True  # all text in the prefill (better pacing); False feeds one token per step
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    cp_temperature: float = 0.9
    cp_top_k: int = 50
    cp_top_p: float = 1.0
    greedy: bool = False  # argmax for codebook 0 and the residual codebooks (official do_sample=False)
    seed: int | None = None  # None: a random seed is drawn at submission
    max_frames: int | None = None  # hard cap; the engine also derives a budget from the text length
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Frames of end-of-speech masking at the start (official min_new_tokens=2); benchmarks raise it to fix lengths.
    min_frames: int = 2
    return_codes: bool = False  # keep the generated codes on the handle (tests, parity, debugging)


@dataclass
class RequestStats:
    request_id: str
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # prefill began
    first_audio_at: float | None = None
    finished_at: float | None = None
    frames: int = 0
    samples: int = 0
    frame_budget: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.submitted_at

    @property
    def time_to_first_audio(self) -> float | None:
        return None if self.first_audio_at is None else self.first_audio_at - self.submitted_at

    @property
    def audio_seconds(self) -> float:
        return self.samples / SAMPLE_RATE

    @property
    def wall_time(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    def as_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "queue_time": self.queue_time,
            "time_to_first_audio": self.time_to_first_audio,
            "wall_time": self.wall_time,
            "frames": self.frames,
            "audio_seconds": self.audio_seconds,
            "frame_budget": self.frame_budget,
            "finish_reason": self.finish_reason.value if self.finish_reason else None,
            "error": self.error,
        }


_DONE = object()


class RequestHandle:
    """Async iterator over a request's audio chunks. Created by `Engine.submit`.

    The engine pushes chunks from its own thread or task with `put_threadsafe`; the consumer iterates in its
    event loop. Iteration ends after the last chunk; a failed request raises RequestFailedError.
    """

    def __init__(self, request: SynthesisRequest, loop: asyncio.AbstractEventLoop | None = None):
        self.request = request
        self.request_id = request.request_id
        self.stats = RequestStats(request.request_id)
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._finished = False
        self.codes: list[torch.Tensor] = []  # (t, 16) per decoded chunk when request.return_codes

    # --- producer side (engine) -------------------------------------------------------------
    def put_threadsafe(self, chunk: np.ndarray) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, chunk)

    def finish_threadsafe(self, reason: FinishReason, error: str | None = None) -> None:
        self.stats.finish_reason = reason
        self.stats.error = error
        self.stats.finished_at = time.monotonic()
        self._loop.call_soon_threadsafe(self._queue.put_nowait, _DONE)

    # --- consumer side ------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self._finished

    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        return self

    async def __anext__(self) -> np.ndarray:
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _DONE:
            self._finished = True
            if self.stats.finish_reason is FinishReason.ERROR:
                raise RequestFailedError(self.stats.error or "request failed")
            raise StopAsyncIteration
        return item

    async def collect(self) -> np.ndarray:
        """Wait for the whole utterance and return it as one float32 array."""
        chunks = [c async for c in self]
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)


class Engine(ABC):
    """Async engine interface (native PyTorch, vLLM-Omni, or the fake).

    `xvector_dim`, `languages`, `model_info`, `device` and `sample_rate` are known from construction on (before
    `start`), so a caller can check its voices and inputs before any weights load.
    """

    @abstractmethod
    async def start(self) -> None:
        """Load, warm up, and begin serving. `ready` is True afterwards."""

    @abstractmethod
    async def stop(self, drain_timeout: float = 0.0) -> None:
        """Stop accepting; let in-flight work finish for up to `drain_timeout` s, cancel the rest."""

    @abstractmethod
    def submit(self, request: SynthesisRequest) -> RequestHandle:
        """Queue a request. Raises QueueFullError, EngineNotReadyError, or ValueError for bad options."""

    @abstractmethod
    def cancel(self, handle: RequestHandle) -> None:
        """Cancel a request; its work stops at the next engine step. Idempotent."""

    @property
    @abstractmethod
    def ready(self) -> bool:
        """Loaded, warmed up, and accepting work."""

    @property
    def restarting_itself(self) -> bool:
        """Not ready because the engine is bringing itself back (a backend that restarts its own pipeline): a
        supervisor above must wait rather than replace it."""
        return False

    @property
    @abstractmethod
    def xvector_dim(self) -> int:
        """Width of the x-vectors this engine's model takes."""

    @property
    @abstractmethod
    def languages(self) -> list[str]:
        """Accepted language names, lower case, including 'auto'."""

    @property
    def sample_rate(self) -> int:
        """Rate of the PCM chunks, in Hz."""
        return SAMPLE_RATE

    @property
    def device(self) -> torch.device:
        """Where the engine wants request x-vectors (a voice cache keeps them there)."""
        return torch.device("cpu")

    @property
    def model_info(self) -> dict[str, Any]:
        """What is served: at least `name` and `xvector_dim`; engines add size, device, dtype, slots, and `path`
        (a file system path: callers that publish the info drop it)."""
        return {"name": type(self).__name__, "xvector_dim": self.xvector_dim}

    @property
    def num_running(self) -> int:
        """Requests being generated now."""
        return 0

    @property
    def num_waiting(self) -> int:
        """Requests accepted and waiting for a slot."""
        return 0

    @property
    def timings(self) -> dict[str, float]:
        """Cumulative busy time by phase (engine specific, e.g. steps, step_s, prefill_s, decode_s); may be empty."""
        return {}
