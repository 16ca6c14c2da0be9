"""The native engine's CUDA fast path, as one options object: which kernels run and how.

`EngineSettings` carries the product's settings and names a preset (`fast_path`); `FastPath.preset(name)` turns the
name into the options, and an A/B run hands `dataclasses.replace(FastPath(), field=...)` to the engine instead. Every
option is ignored on the CPU. Figures for each choice: docs/performance.md.

Standard library only: the server's settings import this module, and must not import torch kernels or Triton.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["EAGER_OFF", "PRESETS", "FastPath", "FastPathError", "FrameStepMode", "warp_elements_error"]

FrameStepMode = Literal["auto", "eager", "padded", "graphs"]
PRESETS = ("default", "one-stream", "eager")


class FastPathError(ValueError):
    """A fast-path option is out of range; `setting` names the field."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting


def warp_elements_error(n: object) -> str | None:
    """Why `n` cannot be the sampler kernel's row elements per warp (sample_kernel.py), or None; here, so that
    checking the option needs no Triton."""
    if isinstance(n, int) and 32 <= n <= 4096 and n & (n - 1) == 0:
        return None
    return f"must be a power of two from 32 to 4096, not {n!r}"


# What the eager preset turns off besides the graphed frame step and the polyphase convs: steps launched one ahead,
# every compiled or custom kernel, Code2Wav's graphs and the code predictor's restructured passes (its prompt in one
# pass, its input tables).
EAGER_OFF = (
    "overlap_steps", "fused_kernels", "split_attention", "small_m_gemm", "cp_prompt_one_pass", "cp_input_tables",
    "kernel_sampler", "cp_fused_feed", "fused_decoder", "decoder_snake_kernel", "decode_graphs",
)  # fmt: skip


@dataclass(frozen=True)
class FastPath:
    """The fast path's options; the defaults are the `default` preset (the one the server runs)."""

    # --- the frame step ---------------------------------------------------------------------------
    # auto: CUDA graphs on CUDA (one per batch and kv-length bucket), eager at exact shapes on CPU; eager; graphs;
    # padded: the graphs' padded, bucketed step run eagerly (tests its logic on the CPU).
    frame_step: FrameStepMode = "auto"
    # Launch each step before reading the codes of the one before, so the GPU steps while the host handles codes.
    # None: on where a launch returns before the step has run (CUDA, not the eager step), else off.
    overlap_steps: bool | None = None

    # --- the decoder layers (qwen_tts/fastpath/fused.py) -----------------------------------------------------
    # One-token decoder steps on fused weights, compiled blocks and in-place Triton attention: fewer kernels.
    fused_kernels: bool = True
    # Attention split over positions (decode_attention.split_decode_attention) instead of one program a kv head.
    split_attention: bool = True
    # Matmuls of up to 16 rows by our Triton kernel (small_m_gemm.py): more thread blocks than cuBLAS's tiles.
    small_m_gemm: bool = True
    # With small_m_gemm, K split over up to this many programs for narrow weights (1 never splits); the partial
    # sums are added in a fixed order, so codes stay deterministic and batch invariant.
    small_m_split_k: int = 4
    # With small_m_gemm, the output heads on the few-row kernel too: a row's logits then do not depend on the rows
    # beside it, which lets a lone stream step one row with both stack kernels on (frame_step.one_row_steps).
    small_m_heads: bool = False
    # Compile the fused regions with inductor's emulate_precision_casts: bf16 rounded where the eager layers round
    # it (as the official package does) instead of kept in float32 inside a kernel, which is closer to exact.
    fused_emulate_casts: bool = False

    # --- the code predictor -------------------------------------------------------------------------------
    # Its two prompt tokens as two rows of one pass: 15 passes a frame instead of 16.
    cp_prompt_one_pass: bool = True
    # Its inputs for passes 2-15 gathered from tables projected once (CodePredictor.build_input_tables) instead of
    # a projection's matmul each pass; nothing to do where the projection is an Identity.
    cp_input_tables: bool = True

    # --- sampling (qwen_tts/fastpath/sample_kernel.py) -----------------------------------------------------
    # Each draw by one Triton kernel that finds top-k's and top-p's cuts by bisection instead of a sort.
    kernel_sampler: bool = True
    # With kernel_sampler, each code-predictor draw also writes its code, its embedding into the codec sum and the
    # next pass's input (sample_kernel.sample_feed): one launch where four ran.
    cp_fused_feed: bool = True
    # With kernel_sampler, row elements per warp (a power of two, 32-4096).
    kernel_sampler_warp_elements: int = 512

    # --- the persistent stack kernel (qwen_tts/fastpath/stack/stack_cuda.cu), opt-in ----------------------------
    # "cuda": each code-predictor pass of at most four bf16 rows by one persistent kernel; "off": the fused path's
    # kernels. Its rows are batch invariant among passes of up to four rows only, not against the fused path's.
    cp_stack_kernel: Literal["off", "cuda"] = "off"
    # The same kernel for the talker's passes, where its layer fits the kernel (a warning and the fused path where not).
    talker_stack_kernel: Literal["off", "cuda"] = "off"
    # Threads per block of the code predictor's and the talker's kernel (256 or 512; the same bits either way).
    cp_stack_threads: int = 512
    talker_stack_threads: int = 256
    # A pass of up to this many rows (0-3) by a build compiled for its row count: the same sums, less code.
    stack_exact_rows: int = 1
    # The talker's kernel brings each chunk's cached keys and values into shared memory before the phase's wait.
    talker_stack_stage: bool = True
    # The talker's attention: a row's positions up to talker_stack_chunk are one chunk (a multiple of 32); past it,
    # chunks of at least talker_stack_split positions (0: as the chunk), combined in a fixed order.
    talker_stack_chunk: int = 64
    talker_stack_split: int = 32

    # --- Code2Wav -------------------------------------------------------------------------------------------
    # SnakeBeta as one compiled kernel instead of five eager passes (where decoder_snake_kernel does not run).
    fused_decoder: bool = True
    # The final conv stack's elementwise work (bias, residual, SnakeBeta, the next conv's context) as one Triton
    # pass per activation (snake_kernel.py): rounded once per activation instead of once per op.
    decoder_snake_kernel: bool = True
    # The final conv stack's convs of dilation >= this as undilated convs over interleaved phases (0: off).
    decoder_polyphase_dilation: int = 9
    # Decode on a thread (and CUDA stream) of its own beside the frame steps; False decodes in the engine loop.
    decode_thread: bool = True
    # With graphed frame steps, replay Code2Wav from a CUDA graph per (batch bucket, chunk length).
    decode_graphs: bool = True

    def __post_init__(self) -> None:
        if self.frame_step not in ("auto", "eager", "padded", "graphs"):
            raise FastPathError(
                "frame_step", f"frame_step must be auto, eager, padded or graphs, not {self.frame_step!r}"
            )
        for name in ("cp_stack_kernel", "talker_stack_kernel"):
            if getattr(self, name) not in ("off", "cuda"):
                raise FastPathError(name, f"{name} must be off or cuda, not {getattr(self, name)!r}")
        if not 1 <= self.small_m_split_k <= 8:
            raise FastPathError("small_m_split_k", f"small_m_split_k must be 1 to 8, not {self.small_m_split_k!r}")
        if not 0 <= self.stack_exact_rows <= 3:
            raise FastPathError(
                "stack_exact_rows", f"stack_exact_rows must be 0 to 3 rows, not {self.stack_exact_rows!r}"
            )
        for name in ("cp_stack_threads", "talker_stack_threads"):
            if getattr(self, name) not in (256, 512):
                raise FastPathError(name, f"{name} must be 256 or 512, not {getattr(self, name)!r}")
        if self.talker_stack_chunk < 32 or self.talker_stack_chunk % 32:
            raise FastPathError(
                "talker_stack_chunk",
                f"talker_stack_chunk must be a multiple of 32 positions, not {self.talker_stack_chunk!r}",
            )
        split = self.talker_stack_split
        if split < 0 or split % 32 or split > self.talker_stack_chunk:
            raise FastPathError(
                "talker_stack_split",
                f"talker_stack_split must be 0 or a multiple of 32 positions up to talker_stack_chunk "
                f"({self.talker_stack_chunk}), not {split!r}",
            )
        if err := warp_elements_error(self.kernel_sampler_warp_elements):
            raise FastPathError("kernel_sampler_warp_elements", f"kernel_sampler_warp_elements {err}")
        if self.decoder_polyphase_dilation < 0:
            raise FastPathError(
                "decoder_polyphase_dilation",
                f"decoder_polyphase_dilation must be >= 0, not {self.decoder_polyphase_dilation!r}",
            )

    @classmethod
    def preset(cls, name: str) -> FastPath:
        """default: the server's kernels. one-stream: both stack kernels and the few-row heads, fastest for one
        stream at a time but batch invariant only among up to four rows. eager: the model's own PyTorch, no
        compiled or custom kernel and no CUDA graph (the debugging path)."""
        if name == "default":
            return cls()
        if name == "one-stream":
            return cls(cp_stack_kernel="cuda", talker_stack_kernel="cuda", small_m_heads=True)
        if name == "eager":
            return cls(frame_step="eager", decoder_polyphase_dilation=0, **dict.fromkeys(EAGER_OFF, False))
        raise FastPathError("fast_path", f"fast_path must be {', '.join(PRESETS)}, not {name!r}")

    @classmethod
    def split(cls, fields: Mapping[str, Any], base: FastPath | None = None) -> tuple[FastPath, dict[str, Any]]:
        """A variant's `fields` (benchmarks, tests) as (a FastPath: its fields over `base`, else the default preset;
        the other fields, for EngineSettings)."""
        names = {f.name for f in dataclasses.fields(cls)}
        fast = dataclasses.replace(base or cls(), **{k: v for k, v in fields.items() if k in names})
        return fast, {k: v for k, v in fields.items() if k not in names}
