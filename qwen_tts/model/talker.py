"""The talker: a Qwen3 decoder over summed text + codec embeddings that emits codebook-0 ids.

Reimplements qwen-tts 0.1.1 MQ `Qwen3TTSTalkerModel` and the module layout of `Qwen3TTSTalkerForConditionalGeneration`
(`text_projection` = `Qwen3TTSTalkerResizeMLP`, `codec_head`, `code_predictor`). The HF generate plumbing (rope deltas,
left padding, DynamicCache) is replaced by explicit per-row positions and a static per-slot KV cache, so the batching
engine can decode rows at different positions in one call. Attribute names equal the checkpoint names minus "talker.".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import LongTensor, Tensor, nn

from qwen_tts.model.code_predictor import CodePredictor, Feed
from qwen_tts.model.config import TalkerConfig
from qwen_tts.model.layers import DecoderStack, KVCache, StepKernels

__all__ = ["KVCache", "Talker", "TalkerModel", "TextProjection"]


class TalkerModel(DecoderStack):
    """`talker.model`: decoder layers plus the text and codec embedding tables."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__(cfg)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class TextProjection(nn.Module):
    """`talker.text_projection`: text_hidden -> text_hidden -> hidden, SiLU between, both with bias."""

    def __init__(self, text_hidden: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    """Talker weights and one-call forward over a static cache; the loop lives in generate.py / the engine."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = TalkerModel(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.hidden_size)
        self.codec_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg.code_predictor, cfg.hidden_size)
        # A fast path's one-token passes and heads for this talker and its code predictor (`use_kernels`); None:
        # the modules' own.
        self.kernels: StepKernels | None = None

    def use_kernels(self, kernels: StepKernels | None) -> None:
        """Run the one-token passes and the heads of this talker and its code predictor through `kernels` (None:
        the modules' own). The same function."""
        self.kernels = kernels

    def new_cache(
        self, slots: int, max_len: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> KVCache:
        """A zeroed cache for `slots` sequences of up to `max_len` positions, on the module's device and dtype."""
        w = self.codec_head.weight
        return self.model.new_cache(slots, max_len, device or w.device, dtype or w.dtype)

    def embed_text(self, ids: LongTensor) -> Tensor:
        """text_projection(text_embedding(ids)): shape ids.shape + (hidden,)."""
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codec(self, ids: LongTensor) -> Tensor:
        return self.model.codec_embedding(ids)

    def forward(self, embeds: Tensor, positions: LongTensor, cache: KVCache, slots: LongTensor, kv_len: int) -> Tensor:
        """embeds (B, T, H), positions (B, T), slots (B,) -> final-normed hidden (B, T, H).

        Writes each row's K/V into its slot at its positions; a row attends to its own slot's keys at positions
        <= its query position among the first `kv_len` (> max position in the call) cache positions.
        """
        return self.model(embeds, positions, cache, slots, kv_len, self.kernels)

    def logits(self, hidden: Tensor) -> Tensor:
        if self.kernels is not None and self.kernels.head_linear is not None:
            return self.kernels.head_linear(hidden, self.codec_head.weight)
        return self.codec_head(hidden)

    def residual_codes(
        self, h: Tensor, cb0_embed: Tensor, sample: Callable[[int, Tensor], LongTensor], feed: Feed | None = None
    ) -> tuple[LongTensor, Tensor]:
        """The code predictor's codes for one frame (`CodePredictor.forward`), with this talker's kernels."""
        return self.code_predictor(h, cb0_embed, sample, feed, self.kernels)
