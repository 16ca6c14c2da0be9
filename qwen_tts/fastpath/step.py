"""The fast path as one object: `FastStep` holds every kernel choice and the weights it re-lays, and implements the
model's seams (`layers.StepKernels` for the talker, `codec_decoder.DecoderKernels` for Code2Wav).

`build(talker, code2wav, fast, device, talker_cache_len)` is the one entry point: it takes the options of a
`FastPath` (options.py) and the numerics choice `deterministic`, re-lays the weights, compiles and loads what must exist before
a CUDA graph capture, and hands the object to the talker (`Talker.use_kernels`) and Code2Wav (`Code2Wav.use_kernels`).
No module state: two engines in one process may run different options (CUDA graphs keep the kernels they were
captured with). The model is imported for types only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from qwen_tts.fastpath import fused, small_m_gemm, snake_kernel
from qwen_tts.fastpath.decode_attention import HAVE_TRITON
from qwen_tts.fastpath.options import warp_elements_error
from qwen_tts.fastpath.stack.stack_cuda import StackOptions
from qwen_tts.fastpath.stack.stack_kernel import StackKernel

if TYPE_CHECKING:
    from qwen_tts.fastpath.options import FastPath
    from qwen_tts.model.codec_decoder import Code2Wav
    from qwen_tts.model.layers import DecoderStack, KVCache
    from qwen_tts.model.talker import Talker

log = logging.getLogger("qwen_tts.fastpath")


class FastStep:
    """The CUDA fast path of one engine: the kernels' options, the re-laid weights (keyed by the stack they belong
    to, never set on the model's modules) and the operations the model delegates."""

    def __init__(self, options: FastPath, device: torch.device | str, deterministic: bool = True) -> None:
        o = options
        self.device = torch.device(device)
        small_m = int(o.small_m_split_k) if o.small_m_gemm else 0
        if small_m and (err := small_m_gemm.split_k_error(small_m)):
            raise ValueError(err)
        self.regions = fused.Regions(bool(o.fused_emulate_casts), deterministic, small_m)
        self.split_attention = bool(o.split_attention)
        self.small_m_heads = bool(o.small_m_gemm and o.small_m_heads)
        self.prompt_one_pass = bool(o.cp_prompt_one_pass)
        self.cp_input_tables = bool(o.cp_input_tables)
        self.cp_stack_kernel, self.talker_stack_kernel = str(o.cp_stack_kernel), str(o.talker_stack_kernel)
        self.stack_options = StackOptions(
            threads=int(o.cp_stack_threads), long_threads=int(o.talker_stack_threads), stage=bool(o.talker_stack_stage),
            chunk=int(o.talker_stack_chunk), split=int(o.talker_stack_split), exact_rows=int(o.stack_exact_rows),
        )  # fmt: skip
        self.kernel_sampler = bool(o.kernel_sampler)
        self.cp_fused_feed = self.kernel_sampler and bool(o.cp_fused_feed)
        self.warp_elements = int(o.kernel_sampler_warp_elements)
        if err := warp_elements_error(self.warp_elements):
            raise ValueError(f"kernel_sampler_warp_elements {err}")
        self.fused_kernels = bool(o.fused_kernels)
        self.fused_decoder = bool(o.fused_decoder)
        self.decoder_snake_kernel = bool(o.decoder_snake_kernel)
        self.polyphase = int(o.decoder_polyphase_dilation)
        # DecoderKernels: what Code2Wav runs (`take_decoder`).
        self.snake_beta = None
        self.snake = None
        # The stacks taken (`take_talker`): each layer's re-laid weights, and the stacks on the CUDA stack kernel.
        self._fused: dict[DecoderStack, list[fused.FusedWeights]] = {}
        self._kernels: dict[DecoderStack, StackKernel] = {}
        self._names: dict[str, DecoderStack] = {}

    # ------------------------------------------------------------------ set-up
    def take_talker(self, talker: Talker, talker_cache_len: int) -> None:
        """Re-lay the talker's and its code predictor's weights, make what the kernels need before any graph
        capture (the few-row matmul's counters, the stack kernel's build), and hand this object to the talker."""
        cp = talker.code_predictor
        self._names = {"code_predictor": cp.model, "talker": talker.model}
        for stack in (talker.model, cp.model):
            self._fused[stack] = fused.fuse(stack)
        log.info("fused decode path on for %d decoder layers", sum(len(w) for w in self._fused.values()))
        small_m_gemm.prepare(self.device)  # its counters exist before capture
        cp.drop_input_tables()
        if self.cp_input_tables:
            n = cp.build_input_tables()
            log.info("code predictor input tables: %.1f MB", n / 1e6)
        for name, mode, max_len in (
            ("code_predictor", self.cp_stack_kernel, cp.num_residual + 1),
            ("talker", self.talker_stack_kernel, talker_cache_len),
        ):
            if mode != "cuda":
                continue
            stack = self._names[name]
            kernel = StackKernel(stack, self._fused[stack], max_len, self.stack_options)
            reason = kernel.prepare(self.device)  # compiled and loaded now, not inside a capture
            if reason:
                setting = "cp_stack_kernel" if name == "code_predictor" else "talker_stack_kernel"
                log.warning("%s=cuda cannot run here (%s): the fused path's kernels run instead", setting, reason)
            else:
                self._kernels[stack] = kernel
        talker.use_kernels(self)

    def take_decoder(self, code2wav: Code2Wav) -> None:
        """Code2Wav's final conv stack: the polyphase convs, SnakeBeta compiled, the elementwise kernel."""
        code2wav.set_polyphase_dilation(self.polyphase)
        if HAVE_TRITON and self.fused_decoder:
            self.snake_beta = fused.snake_beta
        if HAVE_TRITON and self.decoder_snake_kernel:
            self.snake = snake_kernel.snake
        code2wav.use_kernels(self if self.snake_beta is not None or self.snake is not None else None)

    # ------------------------------------------------------------------ StepKernels
    @property
    def head_linear(self):
        """The heads' matmul: the few-row kernel (small_m_heads), else None (each head's own F.linear)."""
        return self._head if self.small_m_heads else None

    def _head(self, hidden: Tensor, weight: Tensor) -> Tensor:
        return small_m_gemm.linear(hidden, weight, self.regions.small_m)

    def stack_step(
        self,
        stack: DecoderStack,
        x: Tensor,
        positions: Tensor,
        cache: KVCache,
        slots: Tensor,
        shared_slots: bool = False,
    ) -> Tensor:
        """One token per row through a stack taken by `take_talker`: by the stack kernel where it takes the pass,
        else the fused path's kernels (fused.stack_step)."""
        kernel = self._kernels.get(stack)
        if kernel is not None and kernel.runs(x, cache):
            return kernel.stack_pass(x, positions, cache, slots)
        return fused.stack_step(
            stack, self._fused[stack], x, positions, cache, slots, self.regions, self.split_attention, shared_slots
        )

    # ------------------------------------------------------------------ the engine's frame step
    def compiled(self, name: str):
        """One of fused.py's compiled regions ("talker_logits", "sample", ...) with this fast path's options."""
        return fused.compiled(name, self.regions)

    def kernel(self, name: str) -> StackKernel | None:
        """The stack kernel of "code_predictor" or "talker", where it runs."""
        stack = self._names.get(name)
        return None if stack is None else self._kernels.get(stack)

    def one_row_steps(self) -> bool:
        """Whether a lone row's frame step can run as one row and still get the bits it gets beside others: both
        decoder stacks by the CUDA stack kernel (a row's sums do not depend on the rows beside it, up to four) and
        the heads by the few-row kernel (likewise); the compiled regions left (the talker's logits, the compiled
        sampler) run a lone row as two copies themselves. Then one stream's steps skip the padding row."""
        return self.kernel("talker") is not None and self.kernel("code_predictor") is not None and self.small_m_heads

    def stack_blocks(self) -> dict[str, int]:
        """The blocks (SMs) each stack on the CUDA stack kernel launches."""
        return {name: k.blocks(self.device) for name in ("code_predictor", "talker") if (k := self.kernel(name))}


def build(
    talker: Talker,
    code2wav: Code2Wav,
    options: FastPath,
    device: torch.device | str,
    talker_cache_len: int,
    deterministic: bool = True,
) -> FastStep | None:
    """The fast path for this talker and Code2Wav as `options` ask, handed to both (`deterministic`: the compiled
    regions' reduction configurations by rule, EngineSettings.fused_deterministic); None off
    CUDA (the model keeps what it has: its own modules unless a caller handed it kernels). The talker's part needs
    fused_kernels, Triton and head dims the attention kernel takes; Code2Wav's needs Triton (the polyphase convs do
    not)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    fast = FastStep(options, device, deterministic)
    if fast.fused_kernels and fused.supported(talker):
        fast.take_talker(talker, talker_cache_len)
    else:
        talker.use_kernels(None)
    fast.take_decoder(code2wav)
    return fast


def model_info(talker: Talker, code2wav: Code2Wav, fast: FastStep | None) -> dict[str, Any]:
    """What runs, for the engine's model_info: the talker's kernels where a FastStep was handed to it, Code2Wav's."""
    step = talker.kernels if isinstance(talker.kernels, FastStep) else None
    cp = talker.code_predictor
    blocks = step.stack_blocks() if step is not None else {}
    dec = code2wav.kernels
    return {
        "decoder_polyphase_dilation": fast.polyphase if fast is not None else 0,
        "fused_kernels": step is not None,
        "fused_emulate_casts": step is not None and step.regions.emulate_casts,
        "fused_deterministic": step is not None and step.regions.deterministic,
        "kernel_sampler": step is not None and step.kernel_sampler,
        "cp_fused_feed": step is not None and step.cp_fused_feed and cp.next_input_is_a_row(),
        "small_m_heads": step is not None and step.small_m_heads,
        "cp_input_tables": cp.input_tables is not None,
        "cp_prompt_one_pass": step is not None and step.prompt_one_pass,
        "cp_stack_kernel": "cuda" if step is not None and step.kernel("code_predictor") else "off",
        "talker_stack_kernel": "cuda" if step is not None and step.kernel("talker") else "off",
        "one_row_steps": step is not None and step.one_row_steps(),
        "stack_blocks": blocks,
        "stack_exact_rows": step.stack_options.exact_rows if blocks else 0,
        "fused_decoder": dec is not None and dec.snake_beta is not None,
        "decoder_snake_kernel": dec is not None and dec.snake is not None,
    }
