"""Talker prefill for voice cloning, in both text modes: x-vector mode, and ICL mode given `IclRows`.

Reimplements the x-vector branch of qwen-tts 0.1.1 MQ `Qwen3TTSForConditionalGeneration.generate` (reference doc 2.3).
With P = text_projection(text_embedding(.)), C = codec_embedding, codec = C(prefix) ++ xvector ++ C([pad, bos]) where
prefix = [think, think_bos, lang, think_eos] or, for "auto", [nothink, think_bos, think_eos]:

    role     P(<|im_start|> assistant \\n)
    control  [tpad * (n-2), tbos] + codec[:-1]                          (n = len(codec))
    streaming:      P(text[0]) + C(bos);   trailing = P(text[1:]) ++ teos, then tpad
    non-streaming:  (P(text) ++ teos) + C(pad), then tpad + C(bos);  trailing = tpad only

Text projections are computed in the same groups as the official code (role, [bos, eos, pad], the first token of the
text, the whole text in non-streaming mode) so the float rounding of each row matches, but for the streaming-mode
trailing text: its rows are projected in aligned groups of TEXT_TRACK_GROUP rows (`text_track_rows`), so a row's
bits depend on its token and its index alone, not on how much text follows. A matmul's rounding depends on its row
count; this way text that arrives token by token (qwen_tts/text_stream.py) gets the rows the whole text gets.

The native engine takes every text row from a `TextTable` instead: each token projected once, in such a group, and
kept, so a prompt's text is one gather and a token's row is the same bits in every text. `build_text_prompts` builds
the prompts of a burst (x-vector voices, text in the prefill) in a fixed number of launches, with those bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from qwen_tts.model.config import ModelConfig
from qwen_tts.model.layers import upload
from qwen_tts.model.talker import Talker


@dataclass
class Prompt:
    prefill: Tensor  # (L, H) input embeddings of the prefill
    trailing: Tensor  # (N, H) text-track embeddings added to decode steps 0..N-1; (0, H) in non-streaming mode
    pad: Tensor  # (H,) tpad, added to every decode step after `trailing` runs out
    end: Tensor  # (H,) teos, the streaming-mode trailing text's last row


def supported_languages(cfg: ModelConfig) -> list[str]:
    """ "auto" plus the checkpoint's languages; dialects are excluded, as the official wrapper does."""
    return cfg.languages


def normalize_language(cfg: ModelConfig, language: str | None) -> str:
    """Case-insensitive language name; None or "auto" -> "auto"; unknown -> ValueError listing the allowed names."""
    if language is None:
        return "auto"
    name = str(language).strip().lower()
    allowed = supported_languages(cfg)
    if name not in allowed:
        raise ValueError(f"unsupported language {language!r}; allowed: {', '.join(allowed)}")
    return name


TEXT_TRACK_GROUP = 16  # rows per text projection of the streaming-mode trailing text


def text_track_rows(talker: Talker, track_ids: list[int], start: int, pad_id: int) -> Tensor:
    """P(track_ids[start:]) as (len(track_ids) - start, H), for the trailing text track whose ids are `track_ids`.

    Row k is projected in the group of rows TEXT_TRACK_GROUP * (k // TEXT_TRACK_GROUP) ... of that size, filled
    with `pad_id` past the known ids: the same shape and place whatever follows, so the row is the same bits
    whether the text after it is known yet or not (rows never mix in a matmul; only the row count changes rounding).
    """
    w = talker.codec_head.weight
    group = TEXT_TRACK_GROUP
    out = []
    for first in range(start - start % group, len(track_ids), group):
        out.append(project_group(talker, track_ids[first : first + group], pad_id)[max(start, first) - first :])
    if not out:
        return w.new_zeros((0, w.shape[1]))
    return torch.cat(out)


def project_group(talker: Talker, ids: list[int], pad_id: int) -> Tensor:
    """P(ids) for at most TEXT_TRACK_GROUP ids, projected as one group of that size filled with `pad_id`."""
    group = ids + [pad_id] * (TEXT_TRACK_GROUP - len(ids))
    return talker.embed_text(upload(group, torch.long, talker.codec_head.weight.device))[: len(ids)]


TEXT_TABLE_ROWS = 16384  # rows a TextTable holds before it starts over


class TextTable:
    """P(token) rows projected once and kept: a prompt's text rows are then one gather, where `text_track_rows`
    runs the projection's matmuls per group at every admission (host time and a launch each on CUDA).

    A token first seen is projected in a group of TEXT_TRACK_GROUP rows filled with `pad_id`, as `text_track_rows`
    projects, so its row is the same bits whichever tokens shared its group: the row a token gets depends on the
    token alone, in any text, in any prompt and across the table starting over. At `limit` rows the table starts
    over (bounded memory: a row is hidden_size values of the talker's dtype). For one talker, on its device."""

    def __init__(self, talker: Talker, pad_id: int, limit: int = TEXT_TABLE_ROWS) -> None:
        if limit < TEXT_TRACK_GROUP:
            raise ValueError(f"limit must be at least {TEXT_TRACK_GROUP} rows, not {limit}")
        self._talker = talker
        self._pad_id = pad_id
        self.limit = limit
        self._slot: dict[int, int] = {}  # token -> its row in _rows
        w = talker.codec_head.weight
        self._rows = w.new_empty((min(1024, limit), w.shape[1]))

    def __len__(self) -> int:
        return len(self._slot)

    def rows(self, ids: list[int]) -> Tensor:
        """P(ids) as (len(ids), H), each row the table's row of its token."""
        missing = [t for t in dict.fromkeys(ids) if t not in self._slot]
        if missing:
            if len(self._slot) + len(missing) > self.limit:
                self._slot.clear()
                missing = list(dict.fromkeys(ids))
            if len(missing) > self.limit:  # more distinct tokens than the table holds: these rows are not kept
                at = {t: i for i, t in enumerate(missing)}
                return self._projected(missing)[upload([at[t] for t in ids], torch.long, self._device)]
            self._add(missing)
        if not ids:
            return self._rows[:0]
        return self._rows.index_select(0, upload([self._slot[t] for t in ids], torch.long, self._device))

    @property
    def _device(self) -> torch.device:
        return self._rows.device

    def _projected(self, tokens: list[int]) -> Tensor:
        """P(tokens), each group of TEXT_TRACK_GROUP tokens projected padded to that size."""
        group = TEXT_TRACK_GROUP
        return torch.cat([project_group(self._talker, tokens[i : i + group], self._pad_id)
                          for i in range(0, len(tokens), group)])  # fmt: skip

    def _add(self, tokens: list[int]) -> None:
        first = len(self._slot)
        need = first + len(tokens)
        if need > self._rows.shape[0]:
            grown = self._rows.new_empty((min(self.limit, max(need, 2 * self._rows.shape[0])), self._rows.shape[1]))
            grown[:first] = self._rows[:first]
            self._rows = grown
        self._rows[first:need] = self._projected(tokens)
        for i, t in enumerate(tokens):
            self._slot[t] = first + i


@dataclass
class PromptHead:
    """What both prompt kinds share: the role and control rows, and the tts bos/eos/pad text rows."""

    rows: Tensor  # (3 + n - 1, H) role rows, then control rows (n = len(codec))
    bos_codec: Tensor  # (1, H) C(codec_bos), the codec track of the row after the control rows
    tbos: Tensor  # (H,)
    teos: Tensor  # (H,)
    tpad: Tensor  # (H,)


def build_head(cfg: ModelConfig, talker: Talker, role_ids: list[int], xvector: Tensor, language: str) -> PromptHead:
    """Role + control rows: P(role) then [tpad * (n-2), tbos] + codec[:-1], codec = C(prefix) ++ xvector ++ C(pad)."""
    if len(role_ids) != 3:
        raise ValueError(f"role_ids must be the 3 ids of '<|im_start|>assistant\\n', got {len(role_ids)}")
    tc = cfg.talker
    language = normalize_language(cfg, language)
    w = talker.codec_head.weight
    dev = w.device

    def ids(values: list[int]) -> Tensor:
        return upload(values, torch.long, dev)

    if xvector.shape != (tc.hidden_size,):
        raise ValueError(f"x-vector must have shape ({tc.hidden_size},), got {tuple(xvector.shape)}")
    tbos, teos, tpad = talker.embed_text(ids([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]))
    prefix = _codec_prefix(cfg, language)
    codec = torch.cat(
        (
            talker.embed_codec(ids(prefix)),
            upload(xvector, w.dtype, dev)[None],
            talker.embed_codec(ids([tc.codec_pad_id, tc.codec_bos_id])),
        )
    )  # (n, H)
    n = codec.shape[0]
    control = torch.cat((tpad.expand(n - 2, -1), tbos[None])) + codec[:-1]
    role = talker.embed_text(ids(role_ids))
    return PromptHead(torch.cat((role, control)), codec[-1:], tbos, teos, tpad)


def _codec_prefix(cfg: ModelConfig, language: str) -> list[int]:
    """The codec ids before the x-vector: [think, think_bos, lang, think_eos], or for "auto" [nothink, think_bos,
    think_eos]."""
    tc = cfg.talker
    if language == "auto":
        return [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id]
    return [tc.codec_think_id, tc.codec_think_bos_id, tc.codec_language_id[language], tc.codec_think_eos_id]


class HeadCache:
    """`build_head` once per language and role, its x-vector row filled per request: a request's head is then a
    copy and one add, with the bits build_head gives it, where build_head runs a dozen embeddings and projections
    (host time at admission, on CUDA a launch each). For one talker."""

    def __init__(self) -> None:
        self._heads: dict[tuple[str, tuple[int, ...]], PromptHead] = {}

    def head(self, cfg: ModelConfig, talker: Talker, role_ids: list[int], xvector: Tensor, language: str) -> PromptHead:
        language = normalize_language(cfg, language)
        if xvector.shape != (cfg.talker.hidden_size,):
            raise ValueError(f"x-vector must have shape ({cfg.talker.hidden_size},), got {tuple(xvector.shape)}")
        w = talker.codec_head.weight
        base, x_row = self.base(cfg, talker, role_ids, language)
        rows = base.rows.clone()
        rows[x_row] = base.tpad + upload(xvector, w.dtype, w.device)
        return PromptHead(rows, base.bos_codec, base.tbos, base.teos, base.tpad)

    def base(self, cfg: ModelConfig, talker: Talker, role_ids: list[int], language: str) -> tuple[PromptHead, int]:
        """The language's head built with a zero x-vector, and the index of the x-vector's control row (tpad + x:
        after 3 role rows and the codec prefix's control rows). `language` normalised."""
        key = (language, tuple(role_ids))
        base = self._heads.get(key)
        if base is None:
            zero = talker.codec_head.weight.new_zeros(cfg.talker.hidden_size)
            base = self._heads[key] = build_head(cfg, talker, role_ids, zero, language)
        return base, 3 + len(_codec_prefix(cfg, language))


def build_text_prompts(
    cfg: ModelConfig,
    talker: Talker,
    texts: list[list[int]],
    role_ids: list[int],
    xvectors: list[Tensor],
    languages: list[str],
    heads: HeadCache,
    table: TextTable,
) -> list[Prompt]:
    """The prompts `build_prompt` builds with `heads` and `table` for x-vector requests with their whole text in the
    prefill (non-streaming), the same bits, in a fixed number of launches for any number of requests: every row of
    every prefill is one gather from the rows they are made of (the heads, the x-vector rows tpad + x, the text rows
    + C(pad), the end rows), and each prompt's prefill is a view of that one tensor."""
    if not texts:
        return []
    if any(not t for t in texts):
        raise ValueError("text_ids is empty: the prompt needs at least one text token")
    hidden = cfg.talker.hidden_size
    for x in xvectors:
        if x.shape != (hidden,):
            raise ValueError(f"x-vector must have shape ({hidden},), got {tuple(x.shape)}")
    languages = [normalize_language(cfg, language) for language in languages]
    w = talker.codec_head.weight
    tc = cfg.talker
    bases = {}  # language -> (head, x row, offset of its rows in the sources)
    sources: list[Tensor] = []
    offset = 0
    for language in dict.fromkeys(languages):
        base, x_row = heads.base(cfg, talker, role_ids, language)
        bases[language] = (base, x_row, offset)
        sources.append(base.rows)
        offset += base.rows.shape[0]
    any_head = next(iter(bases.values()))[0]
    pads = talker.embed_codec(upload([tc.codec_pad_id, tc.codec_bos_id], torch.long, w.device))  # C(pad), C(bos)
    end = torch.stack((any_head.teos + pads[0], any_head.tpad + pads[1]))  # teos + C(pad), tpad + C(bos)
    xs = torch.stack([x.to(device="cpu") for x in xvectors])
    xrows = any_head.tpad + upload(xs, w.dtype, w.device)  # (n, H) tpad + x
    text = table.rows([t for ids in texts for t in ids]) + pads[0]  # (sum of lengths, H) P(t) + C(pad)
    end_at, x_at = offset, offset + 2
    text_at = x_at + len(texts)
    sources += [end, xrows, text]
    index: list[int] = []
    lengths: list[int] = []
    first_text = text_at
    for i, (ids, language) in enumerate(zip(texts, languages, strict=True)):
        base, x_row, at = bases[language]
        rows = list(range(at, at + base.rows.shape[0]))
        rows[x_row] = x_at + i
        rows += range(first_text, first_text + len(ids))
        rows += (end_at, end_at + 1)
        first_text += len(ids)
        index += rows
        lengths.append(len(rows))
    flat = torch.cat(sources).index_select(0, upload(index, torch.long, w.device))
    empty = flat.new_zeros((0, hidden))
    prompts = []
    start = 0
    for n in lengths:
        prompts.append(Prompt(prefill=flat[start : start + n], trailing=empty, pad=any_head.tpad, end=any_head.teos))
        start += n
    return prompts


class IclRows(NamedTuple):
    """An ICL prompt's reference: the transcript's ids and the code block (frames, H), each frame's 16 code
    embeddings summed (qwen_tts/model/icl_prompt.py: `ref_text_ids`, `reference_block`)."""

    ref_ids: list[int]
    block: Tensor


def build_prompt(
    cfg: ModelConfig,
    talker: Talker,
    text_ids: list[int],
    role_ids: list[int],
    xvector: Tensor,
    language: str,
    non_streaming: bool,
    icl: IclRows | None = None,
    heads: HeadCache | None = None,
    table: TextTable | None = None,
) -> Prompt:
    """Prefill embeddings (L, H), trailing text track and tpad for one request (module dtype and device); with `icl`,
    the ICL prompt of that reference (qwen_tts/model/icl_prompt.py has its layout). `heads`: the role and control
    rows from that cache (the same bits) instead of built afresh. `table`: the text's rows from that table (within
    rounding of the grouped projections: a token's row there is the same bits in any text)."""
    if not text_ids:
        raise ValueError("text_ids is empty: the prompt needs at least one text token")
    if heads is not None:
        head = heads.head(cfg, talker, role_ids, xvector, language)
    else:
        head = build_head(cfg, talker, role_ids, xvector, language)
    if icl is not None:
        return _icl_prompt(cfg, talker, head, text_ids, non_streaming, icl, table)
    tc = cfg.talker
    dev = talker.codec_head.weight.device
    teos, tpad = head.teos, head.tpad

    def ids(values: list[int]) -> Tensor:
        return upload(values, torch.long, dev)

    if non_streaming:
        m = len(text_ids)
        text = torch.cat((_text_rows(talker, table, text_ids), teos[None]))  # (m+1, H)
        text = text + talker.embed_codec(ids([tc.codec_pad_id] * (m + 1)))
        prefill = torch.cat((head.rows, text, tpad[None] + head.bos_codec))
        trailing = tpad.new_zeros((0, tpad.shape[0]))
    elif table is not None:
        text = table.rows(text_ids)
        prefill = torch.cat((head.rows, text[:1] + head.bos_codec))
        trailing = torch.cat((text[1:], teos[None]))
    else:
        prefill = torch.cat((head.rows, talker.embed_text(ids(text_ids[:1])) + head.bos_codec))
        rest = text_track_rows(talker, text_ids[1:], 0, cfg.tts_pad_token_id)
        trailing = torch.cat((rest, teos[None]))
    return Prompt(prefill=prefill, trailing=trailing, pad=tpad, end=teos)


def _text_rows(talker: Talker, table: TextTable | None, ids: list[int]) -> Tensor:
    """P(ids): from `table`, else projected in one group (the official code's rounding)."""
    if table is not None:
        return table.rows(ids)
    return talker.embed_text(upload(ids, torch.long, talker.codec_head.weight.device))


def _icl_prompt(
    cfg: ModelConfig,
    talker: Talker,
    head: PromptHead,
    text_ids: list[int],
    non_streaming: bool,
    icl: IclRows,
    table: TextTable | None = None,
) -> Prompt:
    """The head's rows without its final C(bos), then the ICL block: T = P(ref_text ++ text) ++ teos (T1 rows) and
    K = C(bos) ++ the code block (T2 rows); non-streaming T + C(pad), then K + tpad; streaming T[:T2] + K."""
    if not icl.ref_ids:
        raise ValueError("ref_ids is empty: an ICL prompt needs the reference transcript")
    dev = talker.codec_head.weight.device
    tpad = head.tpad
    codec = torch.cat((head.bos_codec, icl.block.to(device=dev, dtype=tpad.dtype)))  # (T2, H)
    ids = icl.ref_ids + text_ids
    if non_streaming:
        text = torch.cat((_text_rows(talker, table, ids), head.teos[None]))  # (T1, H)
        pads = talker.embed_codec(upload([cfg.talker.codec_pad_id] * text.shape[0], torch.long, dev))
        rows = torch.cat((text + pads, codec + tpad))
        trailing = tpad.new_zeros((0, tpad.shape[0]))
    else:
        rows, trailing = _streaming_icl(cfg, talker, ids, head.teos, tpad, codec, table)
    return Prompt(prefill=torch.cat((head.rows, rows)), trailing=trailing, pad=tpad, end=head.teos)


def _streaming_icl(
    cfg: ModelConfig,
    talker: Talker,
    ids: list[int],
    teos: Tensor,
    tpad: Tensor,
    codec: Tensor,
    table: TextTable | None = None,
) -> tuple[Tensor, Tensor]:
    """Streaming mode's ICL rows and trailing text track for `ids` = ref_ids ++ text_ids and `codec` = K (T2 rows).

    T[:T2] is projected in one group holding the first T2 ids only, and the trailing ids T[T2:] in the aligned groups
    of `text_track_rows`: each row's bits depend on the ids up to its own group, not on how much text follows, so a
    text that arrives token by token (the native engine's text_stream) gets the rows of the whole text. With `table`
    every row is the table's row of its token."""
    t2 = codec.shape[0]
    dev = codec.device
    if table is not None:
        text = table.rows(ids)
        if len(ids) >= t2:
            return text[:t2] + codec, torch.cat((text[t2:], teos[None]))
        text = torch.cat((text, teos[None], tpad.expand(t2 - len(ids) - 1, -1)))
        return text + codec, tpad.new_zeros((0, tpad.shape[0]))
    if len(ids) >= t2:  # T1 > T2: the text trails, then teos
        rows = talker.embed_text(upload(ids[:t2], torch.long, dev)) + codec
        trailing = torch.cat((text_track_rows(talker, ids[t2:], 0, cfg.tts_pad_token_id), teos[None]))
        return rows, trailing
    text = torch.cat((talker.embed_text(upload(ids, torch.long, dev)), teos[None], tpad.expand(t2 - len(ids) - 1, -1)))
    return text + codec, tpad.new_zeros((0, tpad.shape[0]))
