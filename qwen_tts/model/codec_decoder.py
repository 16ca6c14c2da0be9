"""Code2Wav: the 12 Hz speech tokenizer's decoder (16 codebooks at 12.5 Hz -> 24 kHz waveform).

Reimplements qwen-tts 0.1.1 `Qwen3TTSTokenizerV2Decoder` (`core/tokenizer_12hz/modeling_qwen3_tts_tokenizer_v2.py`):
split RVQ lookup, causal pre-conv, an 8-layer sliding-window transformer, ConvNeXt upsampling and a SnakeBeta
conv decoder. Unlike the official `chunked_decode` (300-frame chunks, 25 frames of left context), `forward` decodes
the whole sequence causally in one pass, and `decode_chunk` streams it exactly: every layer is causal, so carrying
each causal conv's input history, each transposed conv's pending overlap and each attention layer's last
`sliding_window - 1` keys/values reproduces the whole decode chunk by chunk, with work proportional to the chunk.

Codes must lie in [0, codebook_size). They are not range-checked here (a check would cost a host sync per chunk):
out-of-range ids raise IndexError on CPU and a device-side assert on CUDA. Strip padding (-1) and control ids first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qwen_tts.model.config import Code2WavConfig
from qwen_tts.model.layers import MLP, RMSNorm

# SnakeBeta as one kernel, (x, alpha, beta) -> y (DecoderKernels.snake_beta).
SnakeFn = Callable[[Tensor, Tensor, Tensor], Tensor]


class DecoderKernels(Protocol):
    """What Code2Wav's final conv stack may hand to a fast path (`Code2Wav.use_kernels`; qwen_tts/fastpath implements
    it for CUDA). Each computes what the modules compute."""

    # SnakeBeta as one kernel; None: the module's own expression.
    snake_beta: SnakeFn | None
    # The elementwise work between two convs (bias, residual, SnakeBeta, padding) as one kernel, with the signature
    # of qwen_tts/fastpath/snake_kernel.snake; None: the modules' own forward.
    snake: Callable[..., tuple[Tensor, Tensor | None]] | None


# Queries per attention call: bounds the (queries x keys) score matrix for long sequences.
_ATTN_BLOCK = 128


@dataclass
class Code2WavStream:
    """Exact decoding state of B rows; each row may be at its own frame position.

    Lists are indexed by the owning module's `slot` (see `Code2Wav.__init__`). `decode_chunk` updates these
    tensors in place (fixed addresses, so a chunk of fixed shape can be captured in a CUDA graph); create and use
    a stream under the same autograd mode (both inside `torch.inference_mode()` or both outside).
    """

    position: Tensor  # (B,) long: frames already decoded per row (RoPE position of the next frame)
    conv_history: list[Tensor]  # per causal conv: (B, C_in, (k-1)*dilation) last inputs
    tconv_overlap: list[Tensor]  # per transposed conv: (B, C_out, k-stride) partial sums still to be emitted
    keys: list[Tensor]  # per attention layer: (B, H_kv, window-1, D) rotated keys of the last frames
    values: list[Tensor]  # per attention layer: (B, H_kv, window-1, D)

    @property
    def batch(self) -> int:
        return self.position.shape[0]

    @staticmethod
    def cat(streams: list[Code2WavStream]) -> Code2WavStream:
        """Stack the rows of several streams into one batched stream (copies)."""

        def cat_all(get):
            return [torch.cat(parts, dim=0) for parts in zip(*(get(s) for s in streams), strict=True)]

        return Code2WavStream(
            position=torch.cat([s.position for s in streams], dim=0),
            conv_history=cat_all(lambda s: s.conv_history),
            tconv_overlap=cat_all(lambda s: s.tconv_overlap),
            keys=cat_all(lambda s: s.keys),
            values=cat_all(lambda s: s.values),
        )

    def split(self) -> list[Code2WavStream]:
        """One batch-1 stream per row (copies: decoding one never touches the others)."""

        def row(ts: list[Tensor], i: int) -> list[Tensor]:
            return [t[i : i + 1].clone() for t in ts]

        return [
            Code2WavStream(
                position=self.position[i : i + 1].clone(),
                conv_history=row(self.conv_history, i),
                tconv_overlap=row(self.tconv_overlap, i),
                keys=row(self.keys, i),
                values=row(self.values, i),
            )
            for i in range(self.batch)
        ]


class CausalConv1d(nn.Module):
    """Conv1d with (k-1)*dilation zeros of left padding: output length == input length (stride 1)."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel_size, dilation=dilation, groups=groups)
        self.context = (kernel_size - 1) * dilation
        self.slot = -1  # index into Code2WavStream.conv_history, assigned by Code2Wav
        self.polyphase = False  # `Code2Wav.set_polyphase_dilation`

    def forward(self, x: Tensor, stream: Code2WavStream | None = None) -> Tensor:
        return self.run(self.pad(x, stream))

    def pad(self, x: Tensor, stream: Code2WavStream | None = None) -> Tensor:
        """The conv's input with its left context in front: the stream's history (updated to the new input's
        tail), or zeros without a stream."""
        if self.context == 0:
            return x
        if stream is None:
            return F.pad(x, (self.context, 0))
        x = torch.cat([stream.conv_history[self.slot], x], dim=-1)
        self.keep_history(x, stream)
        return x

    def padding(self, stream: Code2WavStream | None) -> dict:
        """The left context for `snake_kernel.snake`, which pads the conv's input as `pad` does."""
        return {"context": self.context, "history": stream.conv_history[self.slot] if stream is not None else None}

    def keep_history(self, padded: Tensor, stream: Code2WavStream | None) -> None:
        """Store the tail of an already padded input as the stream's history for the next chunk."""
        if stream is not None and self.context > 0:
            stream.conv_history[self.slot].copy_(padded[..., padded.shape[-1] - self.context :])

    def run(self, x: Tensor, bias: bool = True) -> Tensor:
        """The conv over an input that `pad` (or `snake_kernel.snake`) padded; bias=False leaves the bias out
        (for a kernel that adds it later, in the same pass as other elementwise work)."""
        c = self.conv
        b = c.bias if bias else None
        if self.polyphase:
            return self._polyphase_conv(x, b)
        return F.conv1d(x, c.weight, b, c.stride, c.padding, c.dilation, c.groups)

    def _polyphase_conv(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """The same (unpadded) dilated conv as an undilated one over the input's `d` interleaved phases: output
        t = m*d + r sums w_j x[(m + j)*d + r], the undilated conv of phase r (x[r::d]) at m. The phases go into
        the batch (one copy in, one out), padded at the end to whole phases (a causal conv's later outputs only,
        trimmed). On an H200 cuDNN ran one dilated conv of the float16 decoder (384 channels, d 9) in 8.8 ms of a
        64-row 12-frame chunk's 45, its undilated neighbours in under 1.5 (profile_step.py)."""
        c = self.conv
        d = c.dilation[0]
        B, C, L = x.shape
        n = L - self.context  # outputs
        per = -(-L // d)  # samples per phase
        x = F.pad(x, (0, per * d - L)).view(B, C, per, d).permute(0, 3, 1, 2).reshape(B * d, C, per)
        y = F.conv1d(x, c.weight, bias, groups=c.groups)  # (B*d, C_out, per - (k-1))
        c_out, m = y.shape[1], y.shape[2]
        return y.view(B, d, c_out, m).permute(0, 2, 3, 1).reshape(B, c_out, m * d)[..., :n]


class CausalTransConv1d(nn.Module):
    """ConvTranspose1d trimmed by k-stride samples on the right: output length == input length * stride."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel_size, stride=stride)
        self.stride = stride
        self.overlap = kernel_size - stride
        self.slot = -1  # index into Code2WavStream.tconv_overlap, assigned by Code2Wav

    def forward(self, x: Tensor, stream: Code2WavStream | None = None) -> Tensor:
        return self.run_unbiased(x, stream) + self.conv.bias[:, None]

    def run_unbiased(self, x: Tensor, stream: Code2WavStream | None = None) -> Tensor:
        """The trimmed transposed conv without its bias (`forward` adds it; `snake_kernel.snake` adds it in the
        pass that reads the output): the pending tail is then the overlap alone. A view (strided)."""
        c = self.conv
        y = F.conv_transpose1d(x, c.weight, None, c.stride, c.padding, c.output_padding, c.groups, c.dilation)
        n = x.shape[-1] * self.stride  # y: (B, C, n + overlap)
        if stream is not None and self.overlap > 0:
            pending = stream.tconv_overlap[self.slot]
            # Overlap-add: the previous chunk's last frame also reaches into these first samples.
            y[..., : self.overlap] += pending
            pending.copy_(y[..., n:])
        return y[..., :n]


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / e^beta, per channel (alpha, beta stored as logs)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor, stream: Code2WavStream | None = None, fast: SnakeFn | None = None) -> Tensor:
        """fast: the same expression as one kernel (Code2Wav's kernels' snake_beta)."""
        if fast is not None:
            return fast(x, self.alpha, self.beta)
        alpha = self.alpha.exp()[:, None]
        beta = self.beta.exp()[:, None]
        return x + torch.sin(x * alpha).pow(2) / (beta + 1e-9)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv (k=7) -> LayerNorm -> 4x GELU MLP -> gamma, plus residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, stream: Code2WavStream | None = None) -> Tensor:
        h = self.dwconv(x, stream).transpose(1, 2)  # (B, T, C)
        h = self.pwconv2(self.act(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    """SnakeBeta -> dilated causal conv k7 -> SnakeBeta -> conv k1, plus residual."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: Tensor, stream: Code2WavStream | None = None, fast: SnakeFn | None = None) -> Tensor:
        h = self.conv1(self.act1(x, stream, fast), stream)
        return x + self.conv2(self.act2(h, stream, fast), stream)


class DecoderBlock(nn.Module):
    """SnakeBeta -> upsampling transposed conv (k=2r, stride r) -> residual units with dilation 1, 3, 9."""

    def __init__(self, c_in: int, c_out: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(c_in), CausalTransConv1d(c_in, c_out, 2 * rate, rate)]
            + [ResidualUnit(c_out, d) for d in (1, 3, 9)]
        )

    def forward(self, x: Tensor, stream: Code2WavStream | None = None, fast: SnakeFn | None = None) -> Tensor:
        for m in self.block:
            x = m(x, stream) if isinstance(m, CausalTransConv1d) else m(x, stream, fast)
        return x


# ----------------------------------------------------------------------------------------------------------------
# Quantizer (decode side). Module nesting mirrors the checkpoint names:
# quantizer.rvq_{first,rest}.{input_proj,output_proj,vq.layers.N._codebook.{embedding_sum,cluster_usage}}


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def table(self) -> Tensor:
        # EMA codebook: the entry is the running sum divided by the (clamped) usage count.
        return self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class _CodebookLayer(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self._codebook = _Codebook(size, dim)


class _Codebooks(nn.Module):
    def __init__(self, n: int, size: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleList([_CodebookLayer(size, dim) for _ in range(n)])


class ResidualVQ(nn.Module):
    """Sum of codebook lookups followed by a 1x1 projection (`input_proj` is encode-only, kept for loading)."""

    def __init__(self, n_q: int, size: int, dim: int, io_dim: int):
        super().__init__()
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)
        self.vq = _Codebooks(n_q, size, dim)

    def decode(self, codes: Tensor) -> Tensor:
        """codes (B, n_q, T) -> (B, io_dim, T)."""
        h = 0
        for q, layer in enumerate(self.vq.layers):
            h = h + F.embedding(codes[:, q], layer._codebook.table())  # (B, T, dim)
        return self.output_proj(h.transpose(1, 2))


class SplitResidualVQ(nn.Module):
    """Codebook 0 (semantic) and codebooks 1.. (acoustic) each have their own RVQ; their outputs are summed."""

    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = ResidualVQ(1, cfg.codebook_size, dim, cfg.codebook_dim)
        self.rvq_rest = ResidualVQ(cfg.num_quantizers - 1, cfg.codebook_size, dim, cfg.codebook_dim)

    def decode(self, codes: Tensor) -> Tensor:
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])


# ----------------------------------------------------------------------------------------------------------------
# Sliding-window transformer (Qwen3-like, no qk-norm, layer scales)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the half-split layout; x (B, H, T, D), cos/sin (B, 1, T, D/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _window_mask(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """(B, 1, Tq, Tk) bool: key visible iff it is not in the future, within the window, and real (pos >= 0)."""
    q = q_pos[:, None, :, None]
    k = k_pos[:, None, None, :]
    return (k <= q) & (k > q - window) & (k >= 0)


class Attention(nn.Module):
    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.window = cfg.sliding_window
        self.slot = -1  # index into Code2WavStream.keys/values, assigned by Code2Wav

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        blocks: list[tuple[int, int, int, int, Tensor]],
        stream: Code2WavStream | None,
    ) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if stream is not None:
            k_cache, v_cache = stream.keys[self.slot], stream.values[self.slot]
            k = torch.cat([k_cache, k], dim=2)  # (B, H_kv, W-1+T, D)
            v = torch.cat([v_cache, v], dim=2)
            k_cache.copy_(k[:, :, k.shape[2] - k_cache.shape[2] :])
            v_cache.copy_(v[:, :, v.shape[2] - v_cache.shape[2] :])
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        outs = [
            F.scaled_dot_product_attention(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], mask)
            for q0, q1, k0, k1, mask in blocks
        ]
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x: Tensor, *attn_args) -> Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), *attn_args))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    """latent_dim -> hidden -> N sliding-window layers -> norm -> latent_dim, over (B, T, C)."""

    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.layers = nn.ModuleList([TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self.window = cfg.sliding_window
        exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim
        self.register_buffer("inv_freq", 1.0 / (cfg.rope_theta**exponents), persistent=False)

    def forward(self, x: Tensor, stream: Code2WavStream | None = None) -> Tensor:
        b, t, _ = x.shape
        steps = torch.arange(t, device=x.device)
        start = stream.position if stream is not None else torch.zeros(b, dtype=torch.long, device=x.device)
        q_pos = start[:, None] + steps  # (B, T)
        # Cached keys sit before the new ones; slots of a fresh stream get negative positions and are masked.
        lead = self.window - 1 if stream is not None else 0
        k_pos = start[:, None] + torch.arange(-lead, t, device=x.device)  # (B, lead + T)
        freqs = q_pos[:, None, :, None].float() * self.inv_freq  # (B, 1, T, D/2)
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        # Query blocks with their key ranges and masks, shared by all layers. Key index j + lead belongs to
        # query j, and query j sees keys (j + lead - window, j + lead].
        blocks = []
        for q0 in range(0, t, _ATTN_BLOCK):
            q1 = min(q0 + _ATTN_BLOCK, t)
            k0, k1 = max(0, q0 + lead - self.window + 1), q1 + lead
            blocks.append((q0, q1, k0, k1, _window_mask(q_pos[:, q0:q1], k_pos[:, k0:k1], self.window)))
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h, cos, sin, blocks, stream)
        return self.output_proj(self.norm(h))


# ----------------------------------------------------------------------------------------------------------------


class Code2Wav(nn.Module):
    """Codes (B, num_quantizers, T) -> waveform (B, T * total_upsample) in [-1, 1], exactly causal."""

    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        self.cfg = cfg
        self.total_upsample = cfg.total_upsample
        self.quantizer = SplitResidualVQ(cfg)
        self.pre_conv = CausalConv1d(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = PreTransformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv1d(cfg.latent_dim, cfg.latent_dim, r, r), ConvNeXtBlock(cfg.latent_dim)])
            for r in cfg.upsampling_ratios
        )
        dims = [cfg.decoder_dim // 2**i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv1d(cfg.latent_dim, dims[0], 7)]
            + [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, 7)]
        )
        # A fast path's kernels for the final conv stack (`use_kernels`); None: the modules' own.
        self.kernels: DecoderKernels | None = None
        # Streaming slots, in module order.
        self._convs = [m for m in self.modules() if isinstance(m, CausalConv1d) and m.context > 0]
        self._tconvs = [m for m in self.modules() if isinstance(m, CausalTransConv1d) and m.overlap > 0]
        self._attns = [m for m in self.modules() if isinstance(m, Attention)]
        for group in (self._convs, self._tconvs, self._attns):
            for i, m in enumerate(group):
                m.slot = i

    def _check(self, codes: Tensor) -> None:
        if codes.dim() != 3 or codes.shape[1] != self.cfg.num_quantizers:
            raise ValueError(f"codes must be (B, {self.cfg.num_quantizers}, T), got {tuple(codes.shape)}")

    def _decode(self, codes: Tensor, stream: Code2WavStream | None) -> Tensor:
        h = self.quantizer.decode(codes)  # (B, codebook_dim, T)
        h = self.pre_conv(h, stream)  # (B, latent, T)
        h = self.pre_transformer(h.transpose(1, 2), stream).transpose(1, 2)
        for stage in self.upsample:
            for m in stage:
                h = m(h, stream)
        h = self._run_decoder(h.to(self.decoder_dtype), stream)
        return h[:, 0].float().clamp(-1.0, 1.0)  # (B, T * total_upsample)

    def _run_decoder(self, h: Tensor, stream: Code2WavStream | None) -> Tensor:
        """The final conv stack. With the kernels' `snake` (`use_kernels`), every conv runs without its bias and one
        kernel per activation does the elementwise work between two convs: the bias, the residual sum, SnakeBeta
        and the next conv's left context. The same function, in fewer passes."""
        kernels = self.kernels
        if kernels is None or kernels.snake is None:
            fast = kernels.snake_beta if kernels is not None else None
            for m in self.decoder:
                h = m(h, stream) if isinstance(m, CausalConv1d) else m(h, stream, fast)
            return h
        snake = kernels.snake
        first, *blocks, act, last = self.decoder
        # The next activation's input, the sum of these (x: a residual, y: a conv's unbiased output).
        pending = {"y": first.run(first.pad(h, stream), bias=False), "bias": first.conv.bias}
        for block in blocks:
            act0, tconv, *units = block.block
            a, _ = snake(act0.alpha, act0.beta, **pending)
            pending = {"y": tconv.run_unbiased(a, stream), "bias": tconv.conv.bias}
            for u in units:
                a, residual = snake(u.act1.alpha, u.act1.beta, **pending, **u.conv1.padding(stream), keep_sum=True)
                u.conv1.keep_history(a, stream)
                g, _ = snake(u.act2.alpha, u.act2.beta, y=u.conv1.run(a, bias=False), bias=u.conv1.conv.bias)
                pending = {"x": residual, "y": u.conv2.run(g, bias=False), "bias": u.conv2.conv.bias}
        a, _ = snake(act.alpha, act.beta, **pending, **last.padding(stream))
        last.keep_history(a, stream)
        return last.run(a, bias=False) + last.conv.bias[:, None]

    def use_kernels(self, kernels: DecoderKernels | None) -> None:
        """Run the final conv stack's elementwise work through `kernels` (None: the modules' own forward, as on the
        CPU)."""
        self.kernels = kernels

    def forward(self, codes: Tensor) -> Tensor:
        """Decode whole sequences from frame 0 (same result as streaming them in any chunking)."""
        self._check(codes)
        if codes.shape[-1] == 0:
            return codes.new_zeros((codes.shape[0], 0), dtype=torch.float32)
        return self._decode(codes, None)

    @property
    def decoder_dtype(self) -> torch.dtype:
        """The dtype the final conv stack (`decoder`, from the first conv at 50 Hz to the waveform) runs in."""
        return self.decoder[0].conv.weight.dtype

    def set_decoder_dtype(self, dtype: torch.dtype) -> None:
        """Run the final conv stack in `dtype` (float16: half the bytes and twice the tensor-core rate of float32;
        every op still accumulates in float32); the quantizer, transformer and upsampling stay as they are. Make
        new streams afterwards: their state takes each layer's dtype."""
        self.decoder.to(dtype)

    def set_polyphase_dilation(self, dilation: int) -> None:
        """Run every conv of the final conv stack with a dilation >= `dilation` as an undilated conv over the
        input's interleaved phases (`CausalConv1d._polyphase_conv`; 0: none). The same function; streams stay
        valid."""
        for m in self.decoder.modules():
            if isinstance(m, CausalConv1d):
                m.polyphase = dilation > 0 and m.conv.dilation[0] >= max(dilation, 2)

    def new_stream(self, batch: int = 1) -> Code2WavStream:
        """Fresh state for `batch` rows at frame 0 (zero histories == the causal zero padding), each state tensor
        in its layer's dtype."""
        p = next(self.parameters())
        keep = self.cfg.sliding_window - 1
        kv_shape = (batch, self.cfg.num_key_value_heads, keep, self.cfg.head_dim)

        def zeros(*shape, like: Tensor) -> Tensor:
            return torch.zeros(*shape, device=like.device, dtype=like.dtype)

        return Code2WavStream(
            position=torch.zeros(batch, dtype=torch.long, device=p.device),
            conv_history=[zeros(batch, m.conv.in_channels, m.context, like=m.conv.weight) for m in self._convs],
            tconv_overlap=[zeros(batch, m.conv.out_channels, m.overlap, like=m.conv.weight) for m in self._tconvs],
            keys=[zeros(*kv_shape, like=m.q_proj.weight) for m in self._attns],
            values=[zeros(*kv_shape, like=m.q_proj.weight) for m in self._attns],
        )

    def decode_chunk(self, codes: Tensor, stream: Code2WavStream) -> Tensor:
        """Decode the next t frames of every row: (B, Q, t) -> (B, t * total_upsample); advances `stream`."""
        self._check(codes)
        if codes.shape[0] != stream.batch:
            raise ValueError(f"codes batch {codes.shape[0]} != stream batch {stream.batch}")
        t = codes.shape[-1]
        if t == 0:
            return codes.new_zeros((codes.shape[0], 0), dtype=torch.float32)
        wav = self._decode(codes, stream)
        stream.position.add_(t)
        return wav
