"""The native engine's per-voice ICL cache: what every request of one ICL voice would otherwise recompute.

An ICL request (`SynthesisRequest.icl`, qwen_tts/icl.py) puts its reference into the prompt: the reference
transcript's ids before the target text, and the reference code block, each frame's 16 code embeddings summed
(qwen_tts/model/icl_prompt.py). Its audio is the decode of the reference codes followed by the generated ones with
the reference part cut, so the streaming decoder starts the request from Code2Wav's state after the reference codes.
Both depend on the voice alone: an `IclVoice` holds them under `IclReference.key`, in a bounded LRU (`IclCache`).

Threads: the engine loop looks voices up and builds the code block at admission (it owns the talker); the decoder
thread fills in the decoder state the first time a request of the voice starts decoding (it owns Code2Wav). An
evicted voice stays valid for the requests that hold it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from qwen_tts.engine_api import SynthesisRequest
from qwen_tts.icl import IclReference
from qwen_tts.model.icl_prompt import icl_prefill_tokens, icl_prompt_len, ref_text_ids
from qwen_tts.model.tokenizer import TextTokenizer

ICL_CACHE_VOICES = 32  # voices kept; each holds a code block and one Code2Wav stream state on the device


@dataclass(eq=False)
class IclVoice:
    """One ICL voice's shared prompt part and decoder start."""

    key: str
    codes: Tensor  # (frames, 16) int64 on the CPU: the reference codes
    text: str  # the reference transcript
    ref_ids: list[int]  # its ids as the prompt takes them (`icl_prompt.ref_text_ids`)
    block: Tensor  # (frames, H): the reference code block, on the talker's device, in its dtype
    # Code2Wav's stream state after the reference codes (`SlotDecoder.start_from`); None until a request of the voice
    # first reaches the decoder.
    decoder_state: list[Tensor] | None = None
    reference_queued: bool = False  # the engine loop has asked the decoder for `decoder_state`

    @property
    def frames(self) -> int:
        return int(self.codes.shape[0])

    def holds(self, ref: IclReference) -> bool:
        """The same reference (a key reused for other codes or text is a new voice, not a stale hit)."""
        return self.text == ref.text and self.codes.shape == ref.codes.shape and torch.equal(self.codes, ref.codes)


def check_icl_request(
    request: SynthesisRequest,
    tokenizer: TextTokenizer,
    language: str,
    text_tokens: int,
    max_prompt: int,
    codebook_size: int,
) -> list[int]:
    """An ICL request's reference transcript ids, after the checks submit makes (ValueError naming what is wrong):
    codes inside the codebook, and a prompt that fits `max_prompt` positions (the prefill's and the KV cache's room
    for the prompt). A refusal the client can cause starts with the request field that can fix it: `text` in
    non-streaming mode (the prompt holds the whole text), `voice_mode` in streaming-text mode (the prompt holds the
    reference alone, whatever the text: only x-vector mode or a shorter reference helps)."""
    icl = request.icl
    bad = (icl.codes < 0) | (icl.codes >= codebook_size)
    if bool(bad.any()):
        raise ValueError(f"icl: reference codes must be in [0, {codebook_size}), got {int(icl.codes[bad][0])}")
    ref_ids = ref_text_ids(tokenizer, icl.text)
    if not ref_ids:
        raise ValueError("icl: the reference transcript has no tokens")
    n = icl_prompt_len(language, len(ref_ids), text_tokens, icl.frames, request.non_streaming_text)
    if n > max_prompt:
        ref = f"the voice's reference ({icl.frames} frames, a transcript of {len(ref_ids)} tokens)"
        limit = f"the limit is {max_prompt} (max_text_tokens plus the prompt's fixed rows)"
        if request.non_streaming_text:
            raise ValueError(
                f"text: {text_tokens} tokens with {ref} make an ICL prompt of {n} positions; {limit}: "
                'use a shorter text or voice_mode "xvector"'
            )
        raise ValueError(
            f"voice_mode: {ref} makes an ICL prompt of {n} positions in streaming-text mode; {limit}: "
            'use voice_mode "xvector" or a shorter reference'
        )
    return ref_ids


def stream_prefill_ids(request: SynthesisRequest, ref_ids: list[int] | None) -> int:
    """Committed target-text ids a request with a `text_stream` waits for in the queue before its prefill (or the
    end of its text, whichever comes first).

    An x-vector prompt holds the first text token. An ICL prompt in streaming-text mode holds the reference
    transcript and then the first frames + 1 - transcript tokens of the target text beside the reference code block
    (`icl_prompt.icl_prefill_tokens`), so an ICL voice's first audio waits for that much text: no more than the
    first token when the transcript has at least as many tokens as the reference has frames. Every later frame step
    reads the next token, as for an x-vector row."""
    if request.icl is None or ref_ids is None:
        return 1
    return max(1, icl_prefill_tokens(len(ref_ids), request.icl.frames))


class IclCache:
    """Least recently used `IclVoice`s by key, at most `capacity`; counts its hits and misses."""

    def __init__(self, capacity: int = ICL_CACHE_VOICES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {capacity}")
        self.capacity = capacity
        self._voices: collections.OrderedDict[str, IclVoice] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._voices)

    def __contains__(self, key: str) -> bool:
        return key in self._voices

    def voice(self, ref: IclReference, ref_ids: list[int], make_block: Callable[[Tensor], Tensor]) -> IclVoice:
        """The voice of `ref`, built (`make_block(codes)` gives its code block) when it is not held yet."""
        held = self._voices.get(ref.key)
        if held is not None and held.holds(ref):
            self.hits += 1
            self._voices.move_to_end(ref.key)
            return held
        self.misses += 1
        codes = ref.codes.detach().to("cpu")
        voice = IclVoice(ref.key, codes, ref.text, list(ref_ids), make_block(codes))
        self._voices[ref.key] = voice
        self._voices.move_to_end(ref.key)
        while len(self._voices) > self.capacity:
            self._voices.popitem(last=False)
        return voice
