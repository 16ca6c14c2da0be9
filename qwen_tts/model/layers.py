"""Qwen3 decoder building blocks shared by the talker and the code predictor, with a static per-slot KV cache.

Reimplements (qwen-tts 0.1.1, MQ = core/models/modeling_qwen3_tts.py) `Qwen3TTSRMSNorm`, the rotate_half RoPE of
`Qwen3TTSRotaryEmbedding` (the talker's interleaved M-RoPE reduces to it: its three position streams are identical),
`Qwen3TTSTalkerTextMLP`, and the attention of `Qwen3TTSAttention` / `Qwen3TTSTalkerAttention` (q/k RMSNorm over
head_dim before RoPE, GQA, scale 1/sqrt(head_dim)). HF's DynamicCache is replaced by a preallocated cache whose rows
("slots") belong to independent sequences, so one call can advance many requests at different positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qwen_tts.model.config import DecoderLayersConfig


def upload(values: list | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Values (a list or a tensor) as a `dtype` tensor on `device`, without a host sync on CUDA (a tensor already
    on a device is only moved or cast there).

    A pageable upload waits for the stream to drain first (the copy is synchronous), which stalls the host behind
    whatever the GPU has queued (a frame step launched ahead) and leaves the GPU idle after it. From pinned memory
    the copy is queued on the current stream like a kernel; torch keeps the pinned block until the copy is done."""
    t = values if isinstance(values, Tensor) else torch.tensor(values)
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device=device, dtype=dtype)
    return t.to(dtype).pin_memory().to(device, non_blocking=True)


class KVCache:
    """Static K/V storage: `k`, `v` of shape (num_layers, slots, kv_heads, max_len, head_dim).

    Zero-initialised: unwritten positions are always masked out, but they must be finite or the masked
    softmax would still produce NaN.
    """

    def __init__(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str | None,
        dtype: torch.dtype,
    ) -> None:
        shape = (num_layers, slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


class StepKernels(Protocol):
    """What the talker and the code predictor may hand to a fast path (`Talker.use_kernels`; qwen_tts/fastpath
    implements it for CUDA): their one-token passes and heads. Each computes what the modules compute."""

    # The code predictor's two prompt tokens as two rows of one pass (`stack_step`'s shared_slots), not two passes.
    prompt_one_pass: bool
    # The heads' matmul, (hidden, weight) -> logits; None: each head's own F.linear.
    head_linear: Callable[[Tensor, Tensor], Tensor] | None

    def stack_step(
        self,
        stack: DecoderStack,
        x: Tensor,
        positions: Tensor,
        cache: KVCache,
        slots: Tensor,
        shared_slots: bool = False,
    ) -> Tensor:
        """One token per row through every layer of `stack` and its final norm: x (B, H) -> (B, H), each row's K/V
        written into its slot at its position; a row attends to its slot's positions <= its own. shared_slots: rows
        may share a slot at consecutive positions (each reads the K/V the earlier rows of the pass wrote)."""
        ...


class RMSNorm(nn.Module):
    """Normalise in float32, cast back, then scale (the official order, which matters in bf16)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate_half RoPE, computed in float32 from absolute positions."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device: torch.device | None = None) -> Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        return 1.0 / (self.theta**exponents)

    def _apply(self, fn, recurse=True):
        # `.to(torch.bfloat16)` would round the frequencies; the official model keeps them in float32.
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq(self.inv_freq.device)
        return self

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, T, heads, D); cos/sin (B, T, 1, D)."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """GQA self-attention with q/k norm, reading and writing a slot of a static KV cache."""

    def __init__(self, cfg: DecoderLayersConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        cache_k: Tensor,
        cache_v: Tensor,
        slots: Tensor,
        positions: Tensor,
        kv_len: int,
    ) -> Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, -1, self.head_dim))  # (B, T, Hq, D)
        k = self.k_norm(self.k_proj(x).view(B, T, -1, self.head_dim))  # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        # cache_k is (slots, Hkv, max_len, D); indexing dims 0 and 2 with (B,1) and (B,T) addresses (B, T, Hkv, D).
        cache_k[slots[:, None], :, positions] = k
        cache_v[slots[:, None], :, positions] = v
        keys = cache_k[slots, :, :kv_len]  # (B, Hkv, kv_len, D)
        values = cache_v[slots, :, :kv_len]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 block."""

    def __init__(self, cfg: DecoderLayersConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, *attn_args) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """`layers.N`, `norm` and a RoPE table: the transformer body both models share (weight names as in MQ)."""

    def __init__(self, cfg: DecoderLayersConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def new_cache(self, slots: int, max_len: int, device: torch.device | str | None, dtype: torch.dtype) -> KVCache:
        c = self.cfg
        return KVCache(c.num_hidden_layers, slots, c.num_key_value_heads, max_len, c.head_dim, device, dtype)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        cache: KVCache,
        slots: Tensor,
        kv_len: int,
        kernels: StepKernels | None = None,
    ) -> Tensor:
        """x (B, T, H), positions (B, T), slots (B,) -> final-normed hidden (B, T, H).

        Each row writes its T keys into its slot at its positions and attends to keys of its slot at positions
        <= its query position, among the first kv_len cache positions. With `kernels`, a one-token call is their
        `stack_step` (the same function; it attends to positions <= each row's, whatever kv_len).
        """
        if x.shape[1] == 1 and kernels is not None:
            return kernels.stack_step(self, x[:, 0], positions[:, 0], cache, slots)[:, None]
        cos, sin = self.rotary_emb(positions, x.dtype)
        cos, sin = cos[:, :, None], sin[:, :, None]  # (B, T, 1, D): broadcast over heads
        key_pos = torch.arange(kv_len, device=x.device)
        mask = (key_pos <= positions[..., None])[:, None]  # (B, 1, T, kv_len)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache.k[i], cache.v[i], slots, positions, kv_len)
        return self.norm(x)
