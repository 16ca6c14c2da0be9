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

from qwen_tts.model.code_predictor import CodePredictor
from qwen_tts.model.config import TalkerConfig
from qwen_tts.model.layers import DecoderStack, KVCache

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
        # On the fused path, draw every code with sample_kernel.sample (one Triton launch, no sort) instead of the
        # compiled sampling.sample. EngineSettings.kernel_sampler.
        self.kernel_sampler = False
        # With kernel_sampler, each code-predictor pass's draw also writes its code, adds its embedding row into the
        # codec sum and writes the next pass's input (sample_kernel.sample_feed): one launch where four ran.
        # EngineSettings.cp_fused_feed.
        self.cp_fused_feed = False
        # The output head's matmul, (hidden, weight) -> logits, where it is not the head's own F.linear: the few-row
        # kernel on the fused path (fused.set_small_m_heads; EngineSettings.small_m_heads).
        self.head_linear: Callable[[Tensor, Tensor], Tensor] | None = None

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
        return self.model(embeds, positions, cache, slots, kv_len)

    def logits(self, hidden: Tensor) -> Tensor:
        if self.head_linear is not None:
            return self.head_linear(hidden, self.codec_head.weight)
        return self.codec_head(hidden)
