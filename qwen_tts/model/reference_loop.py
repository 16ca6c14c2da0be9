"""Single-request reference generation loop (x-vector or ICL voice clone): text -> codec frames (T, 16).

Reimplements qwen-tts 0.1.1 MQ `Qwen3TTSForConditionalGeneration.generate` + `Qwen3TTSTalkerForConditionalGeneration`
`forward` under HF `generate` for batch 1 (reference doc 2.4/2.5): per step, cb0 from the talker logits (repetition
penalty on previously generated cb0 ids, control ids except EOS suppressed, EOS masked for the first
`min_new_tokens` steps), stop at EOS (which gets no residual codes), cb1..15 from the code predictor, next input =
(C(cb0) + the residual embeddings, one sum) + trailing text (or tpad). The batching engine re-implements this loop; this one
is the plain API and the parity reference.

`max_frames` counts emitted frames. The official `max_new_tokens=N` samples N cb0 tokens but the last one never gets
residual codes, so it emits at most N-1 frames: `max_frames=N-1` reproduces it.

Noise counters: step k uses counter 16*k for cb0 and 16*k + 1 + j for code j+1, all under the request's seed.
"""

from __future__ import annotations

import torch
from torch import LongTensor, Tensor

from qwen_tts.model.config import ModelConfig
from qwen_tts.model.icl_prompt import ref_text_ids, reference_block
from qwen_tts.model.prompt import IclRows, build_prompt
from qwen_tts.model.sampling import apply_repetition_penalty, mark_seen, mask_eos, sample, suppress, suppress_mask
from qwen_tts.model.talker import Talker
from qwen_tts.model.tokenizer import ROLE_LEN, TAIL_LEN, TextTokenizer


@torch.inference_mode()
def generate_codes(
    talker: Talker,
    cfg: ModelConfig,
    tokenizer: TextTokenizer,
    text: str,
    xvector: Tensor,
    language: str | None = "auto",
    non_streaming: bool = True,
    max_frames: int = 2047,
    greedy: bool = True,
    temperature: float = 0.9,
    top_k: int = 50,
    top_p: float = 1.0,
    repetition_penalty: float = 1.05,
    cp_greedy: bool | None = None,
    cp_temperature: float = 0.9,
    cp_top_k: int = 50,
    cp_top_p: float = 1.0,
    seed: int = 0,
    min_new_tokens: int = 2,
    ref_codes: Tensor | None = None,
    ref_text: str | None = None,
) -> LongTensor:
    """Codes (T, 16) on the talker's device, cut before the first EOS; T <= max_frames.

    cp_greedy=None follows `greedy` for the code predictor. ref_codes (frames, 16) and ref_text: clone in ICL mode
    (qwen_tts/model/icl_prompt.py); the codes returned are the generated ones only (`decode_icl` makes the audio).
    """
    tc = cfg.talker
    dev = talker.codec_head.weight.device
    ids = tokenizer.chat_ids(text)
    if (ref_codes is None) != (ref_text is None):
        raise ValueError("ICL needs both ref_codes and ref_text")
    icl = None if ref_codes is None else IclRows(ref_text_ids(tokenizer, ref_text), reference_block(talker, ref_codes))
    prompt = build_prompt(
        cfg, talker, ids[ROLE_LEN:-TAIL_LEN], ids[:ROLE_LEN], xvector, language or "auto", non_streaming, icl
    )
    L = prompt.prefill.shape[0]
    n_trailing = prompt.trailing.shape[0]
    cache = talker.new_cache(1, L + max_frames)
    slot = torch.zeros(1, dtype=torch.long, device=dev)

    def row(value: float | int | bool, dtype: torch.dtype) -> Tensor:
        return torch.tensor([value], dtype=dtype, device=dev)

    t_temp, t_k, t_p = row(temperature, torch.float32), row(top_k, torch.long), row(top_p, torch.float32)
    t_greedy, t_penalty = row(greedy, torch.bool), row(repetition_penalty, torch.float32)
    cp_temp, cp_k, cp_p = row(cp_temperature, torch.float32), row(cp_top_k, torch.long), row(cp_top_p, torch.float32)
    cp_greedy_t = row(greedy if cp_greedy is None else cp_greedy, torch.bool)
    seeds = row(seed, torch.long)
    suppressed = suppress_mask(tc.vocab_size, tc.codebook_size, tc.codec_eos_token_id, dev)
    seen = torch.zeros(1, tc.vocab_size, dtype=torch.bool, device=dev)

    hidden = talker(prompt.prefill[None], torch.arange(L, device=dev)[None], cache, slot, kv_len=L)
    h = hidden[:, -1]  # (1, H)
    frames = []
    for k in range(max_frames):
        logits = talker.logits(h).float()
        if repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, seen, t_penalty)
        logits = suppress(logits, suppressed)
        logits = mask_eos(logits, tc.codec_eos_token_id, row(k < min_new_tokens, torch.bool))
        cb0 = sample(logits, t_temp, t_k, t_p, t_greedy, seeds, row(16 * k, torch.long))
        if int(cb0) == tc.codec_eos_token_id:
            break
        mark_seen(seen, cb0)

        def cp_sample(j: int, cp_logits: Tensor, k: int = k) -> LongTensor:
            return sample(cp_logits, cp_temp, cp_k, cp_p, cp_greedy_t, seeds, row(16 * k + 1 + j, torch.long))

        cb0_embed = talker.embed_codec(cb0)
        residual, codec_sum = talker.code_predictor(h, cb0_embed, cp_sample)
        frames.append(torch.cat((cb0[:, None], residual), dim=1))
        if k + 1 == max_frames:
            break
        text_track = prompt.trailing[k] if k < n_trailing else prompt.pad
        x = (codec_sum + text_track)[:, None]  # (1, 1, H)
        h = talker(x, torch.full((1, 1), L + k, device=dev), cache, slot, kv_len=L + k + 1)[:, -1]
    if not frames:
        return torch.zeros((0, tc.num_code_groups), dtype=torch.long, device=dev)
    return torch.cat(frames, dim=0)


@torch.inference_mode()
def teacher_forced_logits(
    talker: Talker,
    seq: Tensor,
    prompt_len: int,
    codes: LongTensor,
    frames_per_call: int = 1,
    pad_to: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The talker and code predictor over fixed inputs, the engine's way: the prompt as one prefill, then a talker
    token a step on the KV cache; the code predictor through `CodePredictor.forward` with its sampler replaced by the
    given codes, `frames_per_call` frames a call (1: one stream; all: a batch of streams). For agreement checks
    against the official package and across processes (make_fixture.py, test_reproducible.py, test_parity.py).

    seq (L + F - 1, H): the prompt's L rows, then each frame's input; codes (F, 16). pad_to: the prefill padded with
    zero rows to this length, as the engine's CUDA prefill pads a prompt to its length bucket (the decode steps
    overwrite the padding's cache rows before any query sees them). -> (hidden (F, H), talker logits (F, vocab),
    code-predictor logits (F, 15, V)), logits in float32."""
    dev = seq.device
    n = len(seq)
    T = max(prompt_len, pad_to or 0)
    cache = talker.new_cache(1, max(n, T))
    slot = torch.zeros(1, dtype=torch.long, device=dev)
    prompt = torch.cat((seq[:prompt_len], seq.new_zeros(T - prompt_len, seq.shape[1])))
    hs = [talker(prompt[None], torch.arange(T, device=dev)[None], cache, slot, T)[0, prompt_len - 1]]
    for p in range(prompt_len, n):
        hs.append(talker(seq[None, p : p + 1], torch.full((1, 1), p, device=dev), cache, slot, p + 1)[0, -1])
    h = torch.stack(hs)
    c0 = talker.embed_codec(codes[:, 0])
    out = []
    for s in range(0, len(h), frames_per_call):
        teacher, logits = codes[s : s + frames_per_call], []

        def replay(j: int, lg: Tensor, teacher=teacher, logits=logits) -> LongTensor:
            logits.append(lg.float())
            return teacher[:, j + 1]

        talker.code_predictor(h[s : s + frames_per_call], c0[s : s + frames_per_call], replay)
        out.append(torch.stack(logits, dim=1))
    return h, talker.logits(h).float(), torch.cat(out)
