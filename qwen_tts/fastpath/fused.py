"""The CUDA fast path of the one-token decoder step: fused weights, compiled pre/post-attention blocks, in-place
attention, a compiled sampler (the engine draws with `sample_kernel.py`'s sort-free one by default). Our own code;
it computes the same function as `layers.py` (no official counterpart).

Eager, one decoder layer at T = 1 is ~60 small kernels (RMSNorm alone is five, RoPE ten) and the talker plus the
15 code-predictor passes run ~100 layers per frame. Here each layer is
  1. `pre_attention` (compiled): input RMSNorm, one q|k|v matmul over fused weights, q/k RMSNorm, RoPE;
  2. `decode_attention` (Triton): the K/V write and attention over the slot's positions, read in place;
  3. `post_attention` (compiled): o_proj + residual, RMSNorm, one gate|up matmul, SiLU * up, down_proj + residual;
about ten kernels; a layer's step 3 and the next layer's step 1 are one compiled region (`stack_step`). The compiled functions take weights as arguments, so one compilation serves every layer of
every model of a width (torch.compile with dynamic shapes: one artifact for all batch buckets). Nothing in them
mutates an input (the KV cache is written by the Triton kernel only), so the cache update stays in place and
the whole step still captures into one CUDA graph. CPU runs keep the eager modules.

`fuse(stack)` re-lays each decoder layer's q/k/v and gate/up weights into one tensor each (the parameters become
views into it: no extra memory, same state dict); `stack_step` runs a one-token pass over them. The fast path's
object (step.py) holds the re-laid weights and the options the regions are compiled with (`Regions`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qwen_tts.fastpath.decode_attention import HAVE_TRITON, decode_attention
from qwen_tts.fastpath.small_m_gemm import linear as small_m_linear
from qwen_tts.model.sampling import apply_repetition_penalty, mask_eos, sample, suppress

if TYPE_CHECKING:
    from qwen_tts.model.layers import DecoderStack, KVCache


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`layers.RMSNorm` as a function: normalise in float32, cast back, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _pre_attention(
    x: Tensor,
    ln_w: Tensor,
    w_qkv: Tensor,
    q_norm_w: Tensor,
    k_norm_w: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float,
    n_q: int,
    n_kv: int,
    small_m: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """x (B, H), cos/sin (B, D) -> q (B, Hq, D), k and v (B, Hkv, D), each contiguous in its last dim.

    small_m: matmuls through `small_m_gemm.linear` (the few-row Triton kernel, K split over at most `small_m`
    programs) instead of F.linear (0)."""
    B = x.shape[0]
    D = cos.shape[-1]
    qkv = _linear(rms_norm(x, ln_w, eps), w_qkv, small_m)
    q, k, v = qkv.split([n_q * D, n_kv * D, n_kv * D], dim=-1)
    c, s = cos[:, None], sin[:, None]
    q = _rope(rms_norm(q.reshape(B, n_q, D), q_norm_w, eps), c, s)
    k = _rope(rms_norm(k.reshape(B, n_kv, D), k_norm_w, eps), c, s)
    # No .contiguous(): decode_attention takes row and head strides, so v stays a view of the q|k|v output.
    return q, k, v.reshape(B, n_kv, D)


def _linear(x: Tensor, w: Tensor, small_m: int) -> Tensor:
    return small_m_linear(x, w, small_m) if small_m else F.linear(x, w)


def _post_attention(
    x: Tensor,
    attn: Tensor,
    w_o: Tensor,
    ln_w: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    eps: float,
    small_m: int = 0,
) -> Tensor:
    """x (B, H), attn (B, Hq, D) -> the layer output (B, H)."""
    x = x + _linear(attn.reshape(attn.shape[0], -1), w_o, small_m)
    gate, up = _linear(rms_norm(x, ln_w, eps), w_gate_up, small_m).chunk(2, dim=-1)
    return x + _linear(F.silu(gate) * up, w_down, small_m)


def _post_then_pre(
    x: Tensor,
    attn: Tensor,
    w_o: Tensor,
    ln_w: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    eps: float,
    next_ln_w: Tensor,
    next_w_qkv: Tensor,
    next_q_norm_w: Tensor,
    next_k_norm_w: Tensor,
    cos: Tensor,
    sin: Tensor,
    next_eps: float,
    n_q: int,
    n_kv: int,
    small_m: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One layer's post-attention block and the next layer's pre-attention block in one compiled region, so the
    residual add and the next RMSNorm share a kernel: (x, q, k, v) for the next layer's attention."""
    x = _post_attention(x, attn, w_o, ln_w, w_gate_up, w_down, eps, small_m)
    nxt = _pre_attention(x, next_ln_w, next_w_qkv, next_q_norm_w, next_k_norm_w, cos, sin, next_eps, n_q, n_kv, small_m)
    return (x, *nxt)


def _post_then_norm(
    x: Tensor, attn: Tensor, w_o: Tensor, ln_w: Tensor, w_gate_up: Tensor, w_down: Tensor, eps: float,
    norm_w: Tensor, norm_eps: float, small_m: int = 0,
) -> Tensor:  # fmt: skip
    """The last layer's post-attention block and the stack's final RMSNorm."""
    return rms_norm(_post_attention(x, attn, w_o, ln_w, w_gate_up, w_down, eps, small_m), norm_w, norm_eps)


def _rope_tables(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    freqs = positions[:, None].float() * inv_freq  # (B, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _talker_logits(
    logits: Tensor, seen: Tensor, penalty: Tensor, suppressed: Tensor, eos_id: int, eos_masked: Tensor
) -> Tensor:
    """The talker's logits processors (penalty, suppression, min-length), in float32."""
    logits = apply_repetition_penalty(logits.float(), seen, penalty)
    return mask_eos(suppress(logits, suppressed), eos_id, eos_masked)


_SOURCES = {
    "pre": _pre_attention,
    "post_pre": _post_then_pre,
    "post_norm": _post_then_norm,
    "rope": _rope_tables,
    "sample": sample,
    "talker_logits": _talker_logits,
}
# Which positional arguments of each function carry the batch in dim 0.
_BATCHED = {
    "pre": (0, 5, 6),
    "post_pre": (0, 1, 11, 12),
    "post_norm": (0, 1),
    "rope": (0,),
    "sample": (0, 1, 2, 3, 4, 5, 6),
    "talker_logits": (0, 1, 2, 5),
}
# The functions whose matmuls take the few-row kernel (`Regions.small_m`, bound when the region is compiled).
_SMALL_M = ("pre", "post_pre", "post_norm")
# The compiled regions, by name and options (a cache of compiled functions).
_compiled: dict[tuple[str, Regions], object] = {}


@dataclasses.dataclass(frozen=True)
class Regions:
    """How the regions are compiled.

    emulate_casts: inductor's `emulate_precision_casts`: a bf16 value is rounded to bf16 wherever the eager ops
    round it (after the RMSNorm's cast, each RoPE product, the residual adds, SiLU * up), where by default a fused
    kernel keeps it in float32 until its store: the same function rounded as `layers.py` rounds.
    deterministic: inductor's deterministic mode: a reduction kernel's configuration by a fixed rule, not by timing
    several on first use (which can sum a row in different orders in two processes); ignored where this torch has
    no such mode. small_m: the layers' matmuls through `small_m_gemm.linear` with K split over at most this many
    programs (0: F.linear). CUDA graphs keep the kernels they were captured with. docs/performance.md."""

    emulate_casts: bool = False
    deterministic: bool = False
    small_m: int = 0

    def __post_init__(self) -> None:
        if self.deterministic and not hasattr(torch._inductor.config, "deterministic"):
            object.__setattr__(self, "deterministic", False)


# Recompiles one process may need per compiled function: one per (dtype, fixed argument values such as eps and
# head counts) of each model it runs. Dynamo's default of 8 stopped a process that ran several models (the CUDA test
# suite: tiny models in float32 and bf16, FailOnRecompileLimitHit under fullgraph); a benchmark running the 1.7B
# and the 0.6B and their variants needs a handful more.
RECOMPILE_LIMIT = 64


def _allow_recompiles() -> None:
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    if getattr(cfg, name) < RECOMPILE_LIMIT:
        setattr(cfg, name, RECOMPILE_LIMIT)


def _compile(fn, **kwargs):
    """torch.compile with this module's recompile limit for its own regions where torch takes one per call (2.13+).
    The process-wide limit alone was not enough: the whole CPU suite hit Dynamo's default of 8 on `_pre_attention`
    although `_allow_recompiles` had raised it (the global was back at 8 when the limit was checked); a region's
    own limit does not depend on the global."""
    _allow_recompiles()
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        kwargs["recompile_limit"] = RECOMPILE_LIMIT
    return torch.compile(fn, **kwargs)


def compiled(name: str, regions: Regions = Regions()):
    """The compiled version of one of this module's functions (compiled once per process and options, on first use).

    Compiled with dynamic shapes, so one artifact serves every batch size >= 2; torch.compile specialises a batch
    of one (other kernels, other reduction orders), so a single row is run as two copies of itself: a row then
    gets the same bits alone as in any batch.
    """
    fn = _compiled.get((name, regions))
    if fn is not None:
        return fn
    # No split reductions: they are chosen by shape, so a row's sums would depend on how many rows came along.
    options = {"split_reductions": False, "emulate_precision_casts": regions.emulate_casts}
    if regions.deterministic:
        options["deterministic"] = True
    source = _SOURCES[name]
    if name in _SMALL_M:
        source = _bind_small_m(source, regions.small_m)
    inner = _compile(source, dynamic=True, fullgraph=True, options=options)
    batched = _BATCHED[name]

    def run(*args):
        if args[0].shape[0] != 1:
            return inner(*args)
        args = tuple(a.expand(2, *a.shape[1:]).contiguous() if i in batched else a for i, a in enumerate(args))
        out = inner(*args)
        return tuple(o[:1] for o in out) if isinstance(out, tuple) else out[:1]

    _compiled[(name, regions)] = run
    return run


def _bind_small_m(fn, small_m: int):
    """fn with its `small_m` fixed (a constant of the compiled region, not an input)."""

    def region(*args):
        return fn(*args, small_m=small_m)

    return region


def _snake_beta(x: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
    """SnakeBeta (codec_decoder.SnakeBeta.forward, the same expression): x + sin^2(x e^alpha) / e^beta per channel."""
    return x + torch.sin(x * alpha.exp()[:, None]).pow(2) / (beta.exp()[:, None] + 1e-9)


@functools.cache
def _snake_compiled():
    return _compile(_snake_beta, dynamic=True)


def snake_beta(x: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
    """`_snake_beta` as one compiled kernel (eager: five passes over the activation, the largest tensors in
    Code2Wav). Pointwise, so its bits do not depend on the batch; compiled with dynamic shapes on first use.

    The input is made contiguous first: on the H200 the sliced outputs of the transposed convolutions gave one
    recompile per stride pattern until torch.compile's recompile limit (8) stopped the 1.7B's start-up. Not
    fullgraph, so hitting the limit again would run the eager expression instead of failing."""
    return _snake_compiled()(x.contiguous(), alpha, beta)


def supported(module: nn.Module) -> bool:
    """Whether the fast path can run this module's decoder layers (CUDA weights, Triton importable)."""
    try:
        p = next(module.parameters())
    except StopIteration:
        return False
    from qwen_tts.model.layers import Attention

    # The kernel's head dimension is one power-of-two block.
    dims_ok = all(m.head_dim & (m.head_dim - 1) == 0 for m in module.modules() if isinstance(m, Attention))
    return HAVE_TRITON and p.is_cuda and dims_ok


def _fuse_linear_weights(linears: list[nn.Linear]) -> Tensor:
    """Concatenate the weights of `linears` along the output dim into one tensor; each weight becomes a view."""
    fused = torch.cat([lin.weight.data for lin in linears], dim=0)
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = fused[start : start + n]
        start += n
    return fused


def fuse(stack: DecoderStack) -> list[FusedWeights]:
    """Each decoder layer of `stack` with its q/k/v and gate/up weights re-laid as one tensor each (the parameters
    become views of them)."""
    out = []
    for layer in stack.layers:
        a, m = layer.self_attn, layer.mlp
        out.append(
            FusedWeights(
                w_qkv=_fuse_linear_weights([a.q_proj, a.k_proj, a.v_proj]),
                w_gate_up=_fuse_linear_weights([m.gate_proj, m.up_proj]),
                n_q=a.q_proj.weight.shape[0] // a.head_dim,
                n_kv=a.k_proj.weight.shape[0] // a.head_dim,
            )
        )
    return out


class FusedWeights:
    """The re-laid weights of one decoder layer (views of its parameters share their storage)."""

    def __init__(self, w_qkv: Tensor, w_gate_up: Tensor, n_q: int, n_kv: int) -> None:
        self.w_qkv, self.w_gate_up, self.n_q, self.n_kv = w_qkv, w_gate_up, n_q, n_kv


def _pre_args(layer, f: FusedWeights) -> tuple:
    a = layer.self_attn
    return layer.input_layernorm.weight, f.w_qkv, a.q_norm.weight, a.k_norm.weight


def _post_args(layer, f: FusedWeights) -> tuple:
    a = layer.self_attn
    w = (a.o_proj.weight, layer.post_attention_layernorm.weight, f.w_gate_up, layer.mlp.down_proj.weight)
    return (*w, layer.post_attention_layernorm.eps)


def stack_step(
    stack: DecoderStack,
    weights: Sequence[FusedWeights],
    x: Tensor,
    positions: Tensor,
    cache: KVCache,
    slots: Tensor,
    regions: Regions = Regions(),
    split_attention: bool = False,
    shared_slots: bool = False,
) -> Tensor:
    """One token through every layer of a `layers.DecoderStack` (its layers' re-laid `weights`, `fuse`) and its
    final norm: x (B, H) -> (B, H).

    Region boundaries sit at the attention calls only: pre(0), attention(0), post(0)+pre(1), attention(1), ...,
    post(n-1)+final norm.

    shared_slots: rows may share a slot at consecutive positions (the code predictor's two prompt tokens as two
    rows of one pass): every row's K/V is written into the cache before the attention kernel runs, so a row reads
    the earlier positions of its slot whichever program runs first (the kernel writes them again, the same bits).
    split_attention: attend with `split_decode_attention` (split over positions, tensor-core dot products).
    """
    layers = stack.layers
    cos, sin = compiled("rope", regions)(positions, stack.rotary_emb.inv_freq, x.dtype)
    first, f0 = layers[0], weights[0]
    q, k, v = compiled("pre", regions)(
        x, *_pre_args(first, f0), cos, sin, first.input_layernorm.eps, f0.n_q, f0.n_kv,
    )  # fmt: skip
    for i, layer in enumerate(layers):
        if shared_slots:
            cache.k[i][slots, :, positions] = k
            cache.v[i][slots, :, positions] = v
        attn = decode_attention(q, k, v, cache.k[i], cache.v[i], slots, positions, split_attention)
        if i + 1 < len(layers):
            nxt, fn = layers[i + 1], weights[i + 1]
            x, q, k, v = compiled("post_pre", regions)(
                x, attn, *_post_args(layer, weights[i]), *_pre_args(nxt, fn), cos, sin, nxt.input_layernorm.eps,
                fn.n_q, fn.n_kv,
            )  # fmt: skip
        else:
            x = compiled("post_norm", regions)(
                x, attn, *_post_args(layer, weights[i]), stack.norm.weight, stack.norm.eps,
            )  # fmt: skip
    return x
