"""The native engine's reading of a request's streamed text (qwen_tts/text_stream.py).

In streaming-text mode the prefill holds the first text token and every frame step adds the next one to the
talker's input (qwen_tts/model/prompt.py: the trailing text, then end-of-text, then tpad). So a request can start
once its first token is known and step frame f once token f + 1 (or the end of the text) is known; until then it
is held: no step, no code, no cache write, no random draw. Its codes are those of the whole text. An ICL prompt
holds the first k target tokens (qwen_tts/model/icl_prompt.py: `icl_prefill_tokens`): it starts once max(k, 1) are
and steps frame f once token f + k is.

Only ids that can no longer change are committed: the ids of the text's stable prefix
(`TextTokenizer.stable_prefix`, which keeps an unfinished word or an added token being written), all of them once
the stream ends. Pure Python; read on the engine's worker thread only.
"""

from __future__ import annotations

from qwen_tts.model.tokenizer import TextTokenizer
from qwen_tts.text_stream import TextStream


class TextTooLongError(ValueError):
    """The committed text grew past the engine's max_text_tokens."""


class TextFeed:
    """The committed ids of one streamed text. `poll` reads what arrived; `ids` only grow, `ended` turns True once."""

    def __init__(self, stream: TextStream, tokenizer: TextTokenizer, max_tokens: int) -> None:
        self.stream = stream
        self._tokenizer = tokenizer
        self._max_tokens = max_tokens
        self._version = -1
        self.ids: list[int] = []
        self.ended = False  # the stream ended: `ids` are the whole text's

    @property
    def stale(self) -> bool:
        """Text or the end arrived since the last poll."""
        return not self.ended and self.stream.version != self._version

    def poll(self) -> bool:
        """Read the stream; True when ids were committed or the text ended. Raises TextTooLongError past the limit."""
        if self.ended:
            return False
        snap = self.stream.snapshot()
        if snap.version == self._version:
            return False
        self._version = snap.version
        tok = self._tokenizer
        text = snap.text if snap.ended else snap.text[: tok.stable_prefix(snap.text)]
        ids = tok.text_ids(text) if text.strip() else []
        if ids[: len(self.ids)] != self.ids:  # stable_prefix's promise broken: a bug, never speak changed text
            raise RuntimeError("the streamed text's committed ids changed")
        if len(ids) > self._max_tokens:
            raise TextTooLongError(
                f"text: the streamed text grew to {len(ids)} tokens, the limit is {self._max_tokens} (max_text_tokens)"
            )
        grew = len(ids) > len(self.ids)
        self.ids = ids
        if snap.ended:
            self.ended = True
            return True
        return grew
