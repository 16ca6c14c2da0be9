"""The one-kernel decoder stack: a stack's weights re-laid for the CUDA kernel (stack_cuda.py) and the switch that
sends a stack's one-token passes through it.

Our own code (no official counterpart). The kernel computes what `layers.DecoderStack.forward` computes for T = 1
and up to stack_cuda.MAX_ROWS bf16 rows: every layer's input RMSNorm, q|k|v, q/k RMSNorm, RoPE, the K/V write,
attention over the slot's positions, o_proj and residual, RMSNorm, gate|up, SiLU * up, down_proj and residual, then
the final norm, as one persistent launch. Its weights are one (layers, ...) tensor per kind (`StackWeights`); its
grid barrier's counters live in one buffer per device (`prepare`, before any graph capture), so it runs on one
stream at a time, as the engine's frame steps do. `StackKernel` is one stack on the kernel, with its options.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from qwen_tts.fastpath.stack import stack_cuda
from qwen_tts.fastpath.stack.stack_cuda import StackOptions

if TYPE_CHECKING:
    from qwen_tts.fastpath.fused import FusedWeights
    from qwen_tts.model.layers import DecoderStack, KVCache

# The barrier's counters, one buffer per device (a device resource, zero between launches).
_counters: dict[torch.device, Tensor] = {}


def prepare(device: torch.device | str) -> Tensor:
    """The kernel's barrier counters for a device (allocated once, zeroed; call before capturing graphs that use
    them)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    c = _counters.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("stack_kernel.prepare(device) must run before CUDA graph capture")
        c = _counters[device] = torch.zeros(stack_cuda.BARRIER_INTS, dtype=torch.int32, device=device)
    return c


class StackWeights:
    """A decoder stack's weights re-laid as one (layers, ...) tensor each; the layers' parameters become views of
    them (the same storage and state dict)."""

    def __init__(self, stack: DecoderStack, fused: Sequence[FusedWeights]) -> None:
        """fused: the stack's layers re-laid by `fused.fuse` (their q|k|v and gate|up weights), in layer order;
        they become views of these tensors too."""
        layers = stack.layers
        if len(fused) != len(layers):
            raise ValueError(f"{len(fused)} fused layers for a stack of {len(layers)}")
        a0 = layers[0].self_attn
        cfg = stack.cfg
        self.L, self.H, self.I, self.D = len(layers), cfg.hidden_size, cfg.intermediate_size, a0.head_dim
        self.NQ, self.NKV = fused[0].n_q, fused[0].n_kv
        self.eps = layers[0].input_layernorm.eps
        if self.D & (self.D - 1) or self.D < 16:
            raise ValueError(f"head_dim must be a power of two >= 16, not {self.D}")
        if self.NQ % self.NKV:
            raise ValueError(f"{self.NQ} query heads do not group over {self.NKV} kv heads")
        with torch.no_grad():
            self.w_qkv = _relay([f.w_qkv for f in fused])
            self.w_gate_up = _relay([f.w_gate_up for f in fused])
            for i, (lay, f) in enumerate(zip(layers, fused, strict=True)):
                a, mlp = lay.self_attn, lay.mlp
                f.w_qkv, f.w_gate_up = self.w_qkv[i], self.w_gate_up[i]
                _point(self.w_qkv[i], [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
                _point(self.w_gate_up[i], [mlp.gate_proj.weight, mlp.up_proj.weight])
            self.w_o = _relay([lay.self_attn.o_proj.weight for lay in layers], params=True)
            self.w_down = _relay([lay.mlp.down_proj.weight for lay in layers], params=True)
            self.ln1 = _relay([lay.input_layernorm.weight for lay in layers], params=True)
            self.ln2 = _relay([lay.post_attention_layernorm.weight for lay in layers], params=True)
            qk = _relay([torch.stack((lay.self_attn.q_norm.weight, lay.self_attn.k_norm.weight)) for lay in layers])
            for i, lay in enumerate(layers):
                lay.self_attn.q_norm.weight.data, lay.self_attn.k_norm.weight.data = qk[i][0], qk[i][1]
            self.qk_norm = qk
        self.norm = stack.norm.weight
        self.rotary = stack.rotary_emb  # its inv_freq (float32, remade when the module moves)


def _relay(tensors: list[Tensor], params: bool = False) -> Tensor:
    """One (len, ...) tensor holding `tensors`; params: each (a parameter) becomes a view of its row."""
    big = torch.stack([t.data for t in tensors])
    if params:
        for i, t in enumerate(tensors):
            t.data = big[i]
    return big


def _point(fused: Tensor, params: list[Tensor]) -> None:
    """Make each parameter a view of its rows of `fused` (as fused._fuse_linear_weights does)."""
    start = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[start : start + n]
        start += n


class StackKernel:
    """One stack's one-token passes on the CUDA kernel: its re-laid weights (`StackWeights`), its cache length and
    the kernel's options."""

    def __init__(self, stack: DecoderStack, fused: Sequence[FusedWeights], max_len: int, options: StackOptions) -> None:
        self.weights = StackWeights(stack, fused)
        self.max_len = max_len
        self.options = options

    def prepare(self, device: torch.device | str) -> str | None:
        """Compile and load the kernel and make the barrier's counters, before any graph capture; returns why it
        cannot run there (None: it can)."""
        prepare(device)
        return stack_cuda.prepare(self.weights, self.max_len, device, self.options)

    def blocks(self, device: torch.device | str) -> int:
        """The blocks a pass launches on the device."""
        return stack_cuda.blocks(self.weights, self.max_len, device, self.options)

    def runs(self, x: Tensor, cache: KVCache) -> bool:
        """Whether `stack_pass` takes this pass (the rows and the cache within the kernel's limits)."""
        return stack_cuda.runs(self.weights, x, cache, self.options)

    def stack_pass(
        self, x: Tensor, positions: Tensor, cache: KVCache, slots: Tensor, phase_range: tuple[int, int] | None = None
    ) -> Tensor:
        """One token per row through the whole stack and its final norm: x (M, H) -> (M, H); each row's K/V written
        into its slot at its position (rows may share a slot at different positions). phase_range (0, end): run
        only the first `end` phases, five a layer then the final norm (profiling, benchmarks/kernels/bench_stack.py; the
        output is then partial)."""
        if phase_range is not None and phase_range[0] != 0:
            raise ValueError(f"the kernel runs phases from 0, not {phase_range}")
        stop = None if phase_range is None else phase_range[1]
        barrier = prepare(x.device)
        return stack_cuda.stack_pass(self.weights, x, positions, cache, slots, barrier, stop=stop, options=self.options)
