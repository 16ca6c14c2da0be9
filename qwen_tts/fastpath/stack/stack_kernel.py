"""The one-kernel decoder stack: a stack's weights re-laid for the CUDA kernel (stack_cuda.py) and the switch that
sends a stack's one-token passes through it.

Our own code (no official counterpart). The kernel computes what `layers.DecoderStack.forward` computes for T = 1
and up to stack_cuda.MAX_ROWS bf16 rows: every layer's input RMSNorm, q|k|v, q/k RMSNorm, RoPE, the K/V write,
attention over the slot's positions, o_proj and residual, RMSNorm, gate|up, SiLU * up, down_proj and residual, then
the final norm, as one persistent launch. Its weights are one (layers, ...) tensor per kind (`StackWeights`); its
grid barrier's counters live in one buffer per device (`prepare`, before any graph capture), so it runs on one
stream at a time, as the engine's frame steps do.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qwen_tts.fastpath.stack import stack_cuda

MODES = ("off", "cuda")  # cuda: the CUDA kernel of stack_cuda.py
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

    def __init__(self, stack: nn.Module) -> None:
        layers = stack.layers
        if any(layer.fused is None for layer in layers):
            raise ValueError("stack_kernel needs fused.enable() on the stack first (its q|k|v and gate|up weights)")
        a0 = layers[0].self_attn
        cfg = stack.cfg
        self.L, self.H, self.I, self.D = len(layers), cfg.hidden_size, cfg.intermediate_size, a0.head_dim
        self.NQ, self.NKV = layers[0].fused.n_q, layers[0].fused.n_kv
        self.eps = layers[0].input_layernorm.eps
        if self.D & (self.D - 1) or self.D < 16:
            raise ValueError(f"head_dim must be a power of two >= 16, not {self.D}")
        if self.NQ % self.NKV:
            raise ValueError(f"{self.NQ} query heads do not group over {self.NKV} kv heads")
        with torch.no_grad():
            self.w_qkv = _relay([lay.fused.w_qkv for lay in layers])
            self.w_gate_up = _relay([lay.fused.w_gate_up for lay in layers])
            for i, lay in enumerate(layers):
                a, mlp = lay.self_attn, lay.mlp
                lay.fused.w_qkv, lay.fused.w_gate_up = self.w_qkv[i], self.w_gate_up[i]
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


def enable(stack: nn.Module, mode: str) -> None:
    """Run the stack's one-token passes of up to stack_cuda.MAX_ROWS bf16 rows through the CUDA kernel ("cuda"),
    or not ("off"). The stack must be on the fused path (fused.enable) already."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if mode != "off" and stack.stack_weights is None:
        stack.stack_weights = StackWeights(stack)
    stack.stack_kernel = None if mode == "off" else mode


def runs(stack: nn.Module, x: Tensor, cache) -> bool:
    """Whether `stack_pass` takes this pass (the kernel is on, the rows and the cache within its limits)."""
    return stack.stack_kernel == "cuda" and stack_cuda.runs(stack.stack_weights, x, cache)


def stack_pass(
    stack: nn.Module, x: Tensor, positions: Tensor, cache, slots: Tensor, phase_range: tuple[int, int] | None = None
) -> Tensor:
    """One token per row through the whole stack and its final norm: x (M, H) -> (M, H); each row's K/V written
    into its slot at its position (rows may share a slot at different positions). phase_range (0, end): run only
    the first `end` phases, five a layer then the final norm (profiling, benchmarks/bench_stack.py; the output is
    then partial)."""
    if phase_range is not None and phase_range[0] != 0:
        raise ValueError(f"the kernel runs phases from 0, not {phase_range}")
    stop = None if phase_range is None else phase_range[1]
    return stack_cuda.stack_pass(stack.stack_weights, x, positions, cache, slots, prepare(x.device), stop=stop)
