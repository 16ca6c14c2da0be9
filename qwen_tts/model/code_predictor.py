"""The code predictor ("sub-talker"): residual codebooks 1..15 of one frame from the talker's hidden state.

Reimplements qwen-tts 0.1.1 MQ `Qwen3TTSTalkerCodePredictorModelForConditionalGeneration` and the per-frame
`code_predictor.generate(...)` call in `Qwen3TTSTalkerForConditionalGeneration.forward`: a fresh cache per frame,
a 2-token prefill [h, C(cb0)] at positions 0-1 and then one step per code, with `lm_head[j]` predicting cb_{j+1} and
`codec_embedding[j]` (talker width) embedding cb_{j+1} for the next step. Inputs pass `small_to_mtp_projection`
(a Linear with bias when the talker is wider, e.g. 1.7B; an Identity with no tensors when equal, e.g. 0.6B).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import LongTensor, Tensor, nn

from qwen_tts.model.config import CodePredictorConfig
from qwen_tts.model.layers import DecoderStack, KVCache, StepKernels

# feed(j, logits_j, codes_j, table_e, codec_sum, table_x, x): a pass's draw and what follows it (`forward`).
Feed = Callable[[int, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None], None]


class CodePredictorModel(DecoderStack):
    """`code_predictor.model`: decoder layers plus one embedding table per residual codebook."""

    def __init__(self, cfg: CodePredictorConfig, talker_hidden: int) -> None:
        super().__init__(cfg)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, talker_hidden) for _ in range(cfg.num_code_groups - 1)
        )


class CodePredictor(nn.Module):
    def __init__(self, cfg: CodePredictorConfig, talker_hidden: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_residual = cfg.num_code_groups - 1
        self.model = CodePredictorModel(cfg, talker_hidden)
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(self.num_residual)
        )
        if talker_hidden != cfg.hidden_size:
            self.small_to_mtp_projection: nn.Module = nn.Linear(talker_hidden, cfg.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()
        # (num_residual - 1, vocab, hidden) small_to_mtp_projection(codec_embedding[j].weight): the next pass's input
        # as one row gathered from a table instead of an embedding row through the projection's matmul and bias
        # (`build_input_tables`; FastPath.cp_input_tables). None: the projection runs every pass.
        self.input_tables: Tensor | None = None
        # Scratch cache reused across frames (not module state); grown by reserve().
        self._cache: KVCache | None = None
        self._slot_ids: Tensor | None = None
        self._positions: Tensor | None = None

    def reserve(self, batch: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        """Allocate the per-frame scratch cache for up to `batch` rows (the engine calls this once up front)."""
        w = self.lm_head[0].weight
        device, dtype = torch.device(device) if device is not None else w.device, dtype or w.dtype
        c = self._cache
        if c is not None and c.slots >= batch and c.k.device == device and c.k.dtype == dtype:
            return
        self._cache = self.model.new_cache(batch, self.num_residual + 1, device, dtype)
        self._slot_ids = torch.arange(batch, device=device)
        self._positions = torch.arange(self.num_residual + 1, device=device)[None]

    def drop_input_tables(self) -> None:
        """Back to the projection every pass (`input_tables` None)."""
        self.input_tables = None

    def build_input_tables(self) -> int:
        """Project every residual embedding table through small_to_mtp_projection once (`input_tables`); returns
        the tables' bytes, 0 where the projection is an Identity (the embedding row is the input: nothing to save).

        Each row is what the projection makes of that embedding row, up to the matmul's rounding at this shape
        (bf16: within one rounding of the per-pass product). Build it again after loading other weights."""
        self.input_tables = None
        if not isinstance(self.small_to_mtp_projection, nn.Linear):
            return 0
        with torch.no_grad():
            tables = [
                self.small_to_mtp_projection(self.model.codec_embedding[j].weight) for j in range(self.num_residual - 1)
            ]
            self.input_tables = torch.stack(tables)
        return self.input_tables.numel() * self.input_tables.element_size()

    def next_input_is_a_row(self) -> bool:
        """Whether a pass's input is one gathered row of a table (`input_tables`, or no projection): what a `feed`
        hook needs."""
        return self.input_tables is not None or isinstance(self.small_to_mtp_projection, nn.Identity)

    def _head(self, j: int, hidden: Tensor, kernels: StepKernels | None) -> Tensor:
        if kernels is not None and kernels.head_linear is not None:
            return kernels.head_linear(hidden, self.lm_head[j].weight)
        return self.lm_head[j](hidden)

    def forward(
        self,
        h: Tensor,
        cb0_embed: Tensor,
        sample: Callable[[int, Tensor], LongTensor],
        feed: Feed | None = None,
        kernels: StepKernels | None = None,
    ) -> tuple[LongTensor, Tensor]:
        """h, cb0_embed (B, H_talker) -> codes (B, 15), codec_sum (B, H_talker).

        `sample(j, logits_j)` picks cb_{j+1} from logits (B, vocab). codec_sum = cb0_embed + sum_j
        codec_embedding[j](cb_{j+1}), the codec part of the next talker input, summed as the official generation sums
        it (`codec_hiddens.sum(1)`): in float32, in order, rounded once (in bf16 not 15 roundings). On the CPU that is
        torch's sum bit for bit; written as float32 additions, each row's sum is the same whatever the batch on any
        device (a reduction kernel may split its work by the batch's size).

        `feed(j, logits_j, codes_j, table_e, codec_sum, table_x, x)`, where given (the sampler kernel's
        `sample_feed`), replaces `sample` and what follows it in a pass: it draws cb_{j+1} into codes_j (B,), adds
        its row of table_e into codec_sum (B, H_talker) float32 in place and, with table_x, writes its row of
        table_x into x (B, H_cp), the next pass's input. The same codes and sums as `sample`'s path, in one launch
        a pass instead of four. It needs the next input as one gathered row: `input_tables`, or no projection.

        `kernels` (the talker's, `Talker.use_kernels`): the one-token passes and the heads by a fast path.
        """
        B = h.shape[0]
        self.reserve(B, h.device, h.dtype)
        cache, slots = self._cache, self._slot_ids[:B]
        pos = self._positions.expand(B, -1)  # (B, 16)
        # The fast path attends to each row's written positions whatever kv_len (one kernel serves all 15
        # passes). The eager layers attend over exactly the positions written so far, as the official generation
        # does: with a masked 16-position tail the bf16 attention rounds differently (top-1 98.3% against the
        # official package's bf16 logits instead of equal; tests/test_parity.py).
        kv_len = self.num_residual + 1
        x = self.small_to_mtp_projection(torch.stack((h, cb0_embed), dim=1))  # (B, 2, H_cp)
        fast = kernels is not None
        if fast and kernels.prompt_one_pass:
            # Rows 2b and 2b+1 are row b's two tokens, in its slot at positions 0 and 1.
            rows = kernels.stack_step(
                self.model, x.reshape(2 * B, -1), pos[:, :2].reshape(-1), cache, slots.repeat_interleave(2), True
            )
            hidden = rows.view(B, 2, -1)[:, 1]
        elif fast:  # one token at a time: two steps, same result
            self.model(x[:, :1], pos[:, :1], cache, slots, kv_len, kernels)
            hidden = self.model(x[:, 1:], pos[:, 1:2], cache, slots, kv_len, kernels)[:, -1]
        else:
            hidden = self.model(x, pos[:, :2], cache, slots, 2)[:, -1]
        if feed is not None and self.next_input_is_a_row():
            return self._fed_passes(hidden, cb0_embed, feed, pos, kv_len, kernels)
        codes = []
        codec_sum = cb0_embed.float()
        for j in range(self.num_residual):
            code = sample(j, self._head(j, hidden, kernels))
            emb = self.model.codec_embedding[j](code)
            codec_sum = codec_sum + emb  # float32 + the embedding's dtype: float32, no rounding
            codes.append(code)
            if j + 1 < self.num_residual:  # the last code is not fed back
                if self.input_tables is not None:
                    x = self.input_tables[j][code][:, None]
                else:
                    x = self.small_to_mtp_projection(emb[:, None])
                hidden = self.model(x, pos[:, j + 2 : j + 3], cache, slots, kv_len if fast else j + 3, kernels)[:, -1]
        return torch.stack(codes, dim=1), codec_sum.to(cb0_embed.dtype)

    def _fed_passes(
        self, hidden: Tensor, cb0_embed: Tensor, feed: Feed, pos: Tensor, kv_len: int, kernels: StepKernels | None
    ) -> tuple[LongTensor, Tensor]:
        """`forward`'s passes after the prompt, each draw and what follows it by `feed`."""
        B, R = hidden.shape[0], self.num_residual
        cache, slots = self._cache, self._slot_ids[:B]
        codes = torch.empty(B, R, dtype=torch.long, device=hidden.device)
        codec_sum = cb0_embed.to(torch.float32, copy=True)  # summed into in place
        fast = kernels is not None
        for j in range(R):
            logits = self._head(j, hidden, kernels)
            table_e = self.model.codec_embedding[j].weight
            if j + 1 == R:  # the last code is not fed back
                feed(j, logits, codes[:, j], table_e, codec_sum, None, None)
                break
            table_x = self.input_tables[j] if self.input_tables is not None else table_e
            x = torch.empty(B, table_x.shape[1], dtype=table_x.dtype, device=hidden.device)
            feed(j, logits, codes[:, j], table_e, codec_sum, table_x, x)
            hidden = self.model(x[:, None], pos[:, j + 2 : j + 3], cache, slots, kv_len if fast else j + 3, kernels)[
                :, -1
            ]
        return codes, codec_sum.to(cb0_embed.dtype)
