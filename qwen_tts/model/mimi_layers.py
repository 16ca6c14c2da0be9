"""The Mimi encoder's config and parts, as the 12 Hz speech tokenizer uses them (`codec_encoder.CodecEncoder` puts
them together).

`MimiEncoderConfig` reads `encoder_config` as transformers' `MimiConfig` does (its defaults for missing keys).
Reimplements, from transformers 4.57.3 `models/mimi/modeling_mimi.py`: `MimiConv1d` (causal: left padding of
kernel - stride, then right padding up to whole strides), `MimiResnetBlock` and `MimiEncoder` (SEANet), the encoder
transformer (`MimiTransformerModel` with LayerNorm, rotate_half RoPE, GQA, GELU MLP and layer scales; full causal
attention, as its eager and SDPA paths compute it) and the encoding half of `MimiSplitResidualVectorQuantizer`
(nearest codebook entry by Euclidean distance, entries = embed_sum / max(cluster_usage, 1e-5)). Module and parameter
names follow the checkpoint's `encoder.*` tensor names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qwen_tts.model.config import ConfigError
from qwen_tts.model.layers import RotaryEmbedding, apply_rope

# MimiEuclideanCodebook's floor on cluster usage.
_USAGE_EPS = 1e-5


@dataclass(frozen=True)
class MimiEncoderConfig:
    """`encoder_config` of speech_tokenizer/config.json (a transformers `MimiConfig`), with the tokenizer's own
    `encoder_valid_num_quantizers` and `encode_downsample_rate`. Missing keys take MimiConfig's defaults."""

    sampling_rate: int = 24000
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    pad_mode: str = "constant"
    compress: int = 2
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    vector_quantization_hidden_dimension: int = 256
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 64
    hidden_act: str = "gelu"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False
    frame_rate: float = 12.5
    valid_quantizers: int = 16
    downsample_rate: int = 1920

    @classmethod
    def from_tokenizer_dict(cls, st: dict[str, Any]) -> MimiEncoderConfig:
        """From the whole speech_tokenizer/config.json dict; refuses what the released encoder never uses."""
        where = "speech_tokenizer encoder_config"
        e = dict(st.get("encoder_config") or {})
        if not e:
            raise ConfigError(f"{where}: missing (the speech tokenizer has no encoder)")
        for key, want in (("use_causal_conv", True), ("use_conv_shortcut", False), ("use_streaming", False)):
            if key in e and bool(e[key]) != want:
                raise ConfigError(f"{where}: {key}={e[key]!r} is not supported (the released encoder has {want})")
        if e.get("rope_scaling"):
            raise ConfigError(f"{where}: rope_scaling is not supported")
        if float(e.get("trim_right_ratio", 1.0)) != 1.0:
            raise ConfigError(f"{where}: trim_right_ratio must be 1.0")
        defaults = cls()
        kw: dict[str, Any] = {}
        try:
            for name in cls.__dataclass_fields__:
                if e.get(name) is not None and name not in ("upsampling_ratios", "head_dim", "frame_rate"):
                    kw[name] = type(getattr(defaults, name))(e[name])
            if "codebook_dim" in e and e["codebook_dim"] is None:  # MimiConfig: an explicit None is the hidden size
                kw["codebook_dim"] = kw.get("hidden_size", defaults.hidden_size)
            kw["upsampling_ratios"] = tuple(int(r) for r in e.get("upsampling_ratios") or defaults.upsampling_ratios)
            # MimiConfig: head_dim or hidden // heads; the frame rate given, or the SEANet rate halved by the
            # downsampling conv.
            hidden = kw.get("hidden_size", defaults.hidden_size)
            kw["head_dim"] = int(
                e.get("head_dim") or hidden // kw.get("num_attention_heads", defaults.num_attention_heads)
            )
            rate = e.get("_frame_rate", e.get("frame_rate"))
            hop = math.prod(kw["upsampling_ratios"]) * 2
            kw["frame_rate"] = (
                float(rate) if rate is not None else kw.get("sampling_rate", defaults.sampling_rate) / hop
            )
            kw["valid_quantizers"] = int(st.get("encoder_valid_num_quantizers", defaults.valid_quantizers))
            kw["downsample_rate"] = int(st.get("encode_downsample_rate", defaults.downsample_rate))
        except (TypeError, ValueError, ZeroDivisionError) as err:
            raise ConfigError(f"{where}: {err}") from err
        cfg = cls(**kw)
        cfg._check(where)
        return cfg

    def _check(self, where: str) -> None:
        if self.audio_channels != 1:
            raise ConfigError(
                f"{where}: audio_channels must be 1 (the tokenizer encodes mono), got {self.audio_channels}"
            )
        if self.hidden_act != "gelu":
            raise ConfigError(f"{where}: hidden_act {self.hidden_act!r} is not supported (expected 'gelu')")
        if self.pad_mode not in ("constant", "replicate"):
            raise ConfigError(f"{where}: pad_mode {self.pad_mode!r} is not supported")
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{where}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not 1 <= self.num_semantic_quantizers < self.num_quantizers:
            raise ConfigError(f"{where}: num_semantic_quantizers must be in [1, num_quantizers)")
        if not self.num_semantic_quantizers <= self.valid_quantizers <= self.num_quantizers:
            raise ConfigError(
                f"{where}: encoder_valid_num_quantizers {self.valid_quantizers} outside "
                f"[{self.num_semantic_quantizers}, {self.num_quantizers}]"
            )
        hop = math.prod(self.upsampling_ratios) * self.downsample_stride
        if self.downsample_kernel is None or hop != self.downsample_rate:
            raise ConfigError(
                f"{where}: the encoder's hop ({math.prod(self.upsampling_ratios)} x 2 downsampling at "
                f"{self.frame_rate} Hz) does not match encode_downsample_rate {self.downsample_rate}"
            )

    @property
    def seanet_frame_rate(self) -> int:
        """Frames per second out of the SEANet encoder (MimiConfig.encodec_frame_rate)."""
        return math.ceil(self.sampling_rate / math.prod(self.upsampling_ratios))

    @property
    def downsample_stride(self) -> int:
        return 2

    @property
    def downsample_kernel(self) -> int | None:
        """The downsampling conv's kernel; None where the SEANet rate already is the frame rate (no such conv)."""
        if self.frame_rate == self.seanet_frame_rate:
            return None
        return 2 * int(self.seanet_frame_rate / self.frame_rate)


class MimiConv1d(nn.Module):
    """Causal Conv1d: (k_eff - stride) samples of left padding and enough right padding that the input is a whole
    number of strides, so the output has ceil(length / stride) frames."""

    def __init__(
        self,
        c_in: int,
        c_out: int,
        kernel_size: int,
        stride: int = 1,
        dilation: int = 1,
        bias: bool = True,
        pad_mode: str = "constant",
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel_size, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.left = (kernel_size - 1) * dilation + 1 - stride
        self.pad_mode = pad_mode

    def forward(self, x: Tensor) -> Tensor:
        right = -x.shape[-1] % self.stride
        return self.conv(F.pad(x, (self.left, right), mode=self.pad_mode))


class ResnetBlock(nn.Module):
    """ELU -> conv (k, dilation) to dim / compress -> ELU -> conv 1x1 back to dim, plus the input."""

    def __init__(self, cfg: MimiEncoderConfig, dim: int, dilation: int) -> None:
        super().__init__()
        hidden = dim // cfg.compress
        conv = dict(pad_mode=cfg.pad_mode)
        # Indices 1 and 3 hold the convs, as in the checkpoint (`block.1.conv`, `block.3.conv`).
        self.block = nn.ModuleList(
            [
                nn.ELU(),
                MimiConv1d(dim, hidden, cfg.residual_kernel_size, dilation=dilation, **conv),
                nn.ELU(),
                MimiConv1d(hidden, dim, 1, **conv),
            ]
        )

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        return x + h


class SEANetEncoder(nn.Module):
    """(B, 1, N) waveform -> (B, hidden, ceil(N / prod(ratios))): a conv, then per ratio (smallest first) the
    residual blocks, ELU and a strided conv doubling the channels, then ELU and a conv to the hidden size."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        pad = dict(pad_mode=cfg.pad_mode)
        layers: list[nn.Module] = [MimiConv1d(cfg.audio_channels, cfg.num_filters, cfg.kernel_size, **pad)]
        ch = cfg.num_filters
        for ratio in reversed(cfg.upsampling_ratios):
            layers += [ResnetBlock(cfg, ch, cfg.dilation_growth_rate**j) for j in range(cfg.num_residual_layers)]
            layers += [nn.ELU(), MimiConv1d(ch, 2 * ch, 2 * ratio, stride=ratio, **pad)]
            ch *= 2
        layers += [nn.ELU(), MimiConv1d(ch, cfg.hidden_size, cfg.last_kernel_size, **pad)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class SelfAttention(nn.Module):
    """Causal GQA self-attention over the whole sequence, rotate_half RoPE, scale 1/sqrt(head_dim)."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        hd, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = hd
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, heads * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * hd, bias=bias)
        self.o_proj = nn.Linear(heads * hd, cfg.hidden_size, bias=bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, -1, self.head_dim), cos, sin)  # (B, T, Hq, D)
        k = apply_rope(self.k_proj(x).view(B, T, -1, self.head_dim), cos, sin)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )  # (B, Hq, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate, bias=False)
        self.fc2 = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    """Pre-norm block: x + scale * attn(LN(x)); x + scale * mlp(LN(x))."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class MimiTransformer(nn.Module):
    """`encoder_transformer.layers.N`: (B, T, hidden) -> (B, T, hidden), positions 0..T-1, no final norm."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, x: Tensor) -> Tensor:
        positions = torch.arange(x.shape[1], device=x.device)[None]
        cos, sin = self.rotary_emb(positions, x.dtype)
        cos, sin = cos[:, :, None], sin[:, :, None]  # (1, T, 1, D): broadcast over heads
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class Codebook(nn.Module):
    """`codebook.{embed_sum, cluster_usage}`: the entries are embed_sum / max(cluster_usage, eps)."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("embed_sum", torch.zeros(size, dim))
        self.register_buffer("cluster_usage", torch.ones(size))

    def entries(self) -> Tensor:
        return self.embed_sum / self.cluster_usage.clamp(min=_USAGE_EPS)[:, None]


class VectorQuantizer(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.codebook = Codebook(size, dim)


class ResidualVQ(nn.Module):
    """A 1x1 input projection, then codebooks applied in turn, each to what the previous ones left."""

    def __init__(self, cfg: MimiEncoderConfig, kept: int) -> None:
        super().__init__()
        dim = cfg.vector_quantization_hidden_dimension
        if dim != cfg.hidden_size:
            self.input_proj = nn.Conv1d(cfg.hidden_size, dim, 1, bias=False)
        else:
            self.input_proj = None
        self.layers = nn.ModuleList(VectorQuantizer(cfg.codebook_size, cfg.codebook_dim) for _ in range(kept))

    def forward(self, latents: Tensor) -> Tensor:
        """(B, hidden, T) -> (B, kept, T) int64."""
        x = self.input_proj(latents) if self.input_proj is not None else latents
        residual = x.transpose(1, 2)  # (B, T, D)
        B, T, D = residual.shape
        codes = []
        for layer in self.layers:
            entries = layer.codebook.entries()
            # Distances as the reference computes them (cdist over the flattened frames, in float32): the same
            # argmin where two entries are nearly equidistant.
            dist = torch.cdist(residual.reshape(1, B * T, D).float(), entries[None].float(), p=2)[0]
            idx = dist.argmin(dim=-1).view(B, T)
            residual = residual - F.embedding(idx, entries)
            codes.append(idx)
        return torch.stack(codes, dim=1)


class SplitRVQ(nn.Module):
    """`quantizer.semantic_residual_vector_quantizer` (the first codes) and `acoustic_residual_vector_quantizer`
    (the rest, as many as the tokenizer keeps), both quantizing the same latents."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        semantic = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualVQ(cfg, semantic)
        self.acoustic_residual_vector_quantizer = ResidualVQ(cfg, cfg.valid_quantizers - semantic)

    def forward(self, latents: Tensor) -> Tensor:
        """(B, hidden, T) -> (B, valid_quantizers, T) int64."""
        codes = [self.semantic_residual_vector_quantizer(latents)]
        if len(self.acoustic_residual_vector_quantizer.layers):
            codes.append(self.acoustic_residual_vector_quantizer(latents))
        return torch.cat(codes, dim=1)
