"""Talker prefill for in-context (ICL) voice cloning, in both text modes, and its output audio.

Reimplements the ICL branch of qwen-tts 0.1.1 MQ `Qwen3TTSForConditionalGeneration.generate` and
`generate_icl_prompt` (reference doc 2.3), and the cut in IM `Qwen3TTSModel.generate_voice_clone` (doc 5). The role
and control rows are those of x-vector mode (the x-vector is still inserted), without the final C(bos) row; then,
with T = P(ref_text ++ text) ++ teos (T1 rows) and K = C(bos) ++ the reference code block (T2 = 1 + frames rows),
where a block row is the sum of the frame's 16 code embeddings (talker codec_embedding for code 0, the code
predictor's codec_embedding[q-1] for code q):

    non-streaming:  T + C(pad), then K + tpad;      trailing = tpad only
    streaming:      T[:T2] + K (T padded with tpad to T2 when T1 <= T2);   trailing = T[T2:] when T1 > T2

In streaming mode T[:T2] and the trailing rows are projected in groups that do not depend on how much text follows
(qwen_tts/model/prompt.py, `build_prompt` with `icl`), as the x-vector prompt's trailing text is (qwen_tts/model/prompt.py): the prefill then needs only
the first `icl_prefill_tokens` target tokens, and text streamed in later gets the rows of the whole text.

The official output is the decode of the reference codes followed by the generated ones, with the first
`int(ref / total * samples)` samples cut (`icl_cut`). That float product lands one sample short of ref * 1920 for
some totals, keeping the reference's last sample; a stream primed with the reference codes (`prime_stream`) starts
at ref * 1920 exactly, since the total is not known when the first chunk goes out.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qwen_tts.model.codec_decoder import Code2Wav, Code2WavStream
from qwen_tts.model.talker import Talker
from qwen_tts.model.tokenizer import ROLE_LEN, TextTokenizer

REF_TEMPLATE = "<|im_start|>assistant\n{text}<|im_end|>\n"
REF_TAIL_LEN = 2  # "<|im_end|>", "\n"


def ref_text_ids(tokenizer: TextTokenizer, text: str) -> list[int]:
    """The reference transcript's ids as the official package takes them: the framed sequence minus 3 + 2 ids."""
    return tokenizer.encode(REF_TEMPLATE.format(text=text))[ROLE_LEN:-REF_TAIL_LEN]


def reference_block(talker: Talker, codes: Tensor) -> Tensor:
    """(frames, 16) codes -> (frames, H): each frame's 16 code embeddings, summed in one reduction as the official."""
    n_groups = talker.cfg.num_code_groups
    if codes.dim() != 2 or codes.shape[1] != n_groups:
        raise ValueError(f"reference codes must be (frames, {n_groups}), got {tuple(codes.shape)}")
    codes = codes.to(talker.codec_head.weight.device)
    tables = talker.code_predictor.model.codec_embedding
    parts = [talker.embed_codec(codes[:, :1])]
    parts += [tables[q - 1](codes[:, q : q + 1]) for q in range(1, n_groups)]
    return torch.cat(parts, dim=1).sum(1)  # (frames, 16, H) -> (frames, H)


def icl_prompt_len(language: str, ref_ids: int, text_ids: int, frames: int, non_streaming: bool) -> int:
    """Prefill rows of an ICL prompt: 3 role rows, 5 control rows ("auto") or 6, then T1 + T2 rows (non-streaming)
    or T2 rows (streaming). `language` as `normalize_language` gives it."""
    t1, t2 = ref_ids + text_ids + 1, frames + 1
    return 3 + (5 if language == "auto" else 6) + (t1 + t2 if non_streaming else t2)


def icl_prefill_tokens(ref_ids: int, frames: int) -> int:
    """Target-text tokens a streaming-mode ICL prompt's prefill holds: T[:T2] is the reference transcript's `ref_ids`
    tokens and then the first T2 - ref_ids = frames + 1 - ref_ids target tokens (none when the transcript fills the
    code block's rows). The rest of the target text trails, one token per frame step."""
    return max(0, frames + 1 - ref_ids)


def icl_trailing_ids(ref_ids: list[int], text_ids: list[int], frames: int) -> list[int]:
    """The ids of a streaming-mode ICL prompt's trailing text track (teos follows them): T[T2:] without teos."""
    return (ref_ids + text_ids)[frames + 1 :]


def icl_cut(ref_frames: int, total_frames: int, samples: int) -> int:
    """Samples the official cuts off the front of the decode of ref + generated codes (its own float arithmetic)."""
    return int(ref_frames / max(total_frames, 1) * samples)


@torch.inference_mode()
def decode_icl(code2wav: Code2Wav, ref_codes: Tensor, codes: Tensor) -> Tensor:
    """The official ICL output: decode (ref ++ generated) codes, (frames, 16) each, and cut the reference part."""
    dev = next(code2wav.parameters()).device
    both = torch.cat((ref_codes.to(dev), codes.to(dev)))
    wav = code2wav(both.T[None])[0]
    return wav[icl_cut(len(ref_codes), len(both), wav.shape[0]) :]


@torch.inference_mode()
def prime_stream(code2wav: Code2Wav, ref_codes: Tensor) -> Code2WavStream:
    """A batch-1 Code2Wav stream that has decoded the reference codes: its next chunk is the first generated audio."""
    dev = next(code2wav.parameters()).device
    stream = code2wav.new_stream(1)
    code2wav.decode_chunk(ref_codes.to(dev).T[None], stream)
    return stream
