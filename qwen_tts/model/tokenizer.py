"""Qwen2 byte-level BPE text tokenizer built from `vocab.json` + `merges.txt` + `tokenizer_config.json`.

Reimplements what transformers 4.57.3 `Qwen2TokenizerFast` builds from the slow files (`Qwen2Converter` in
convert_slow_tokenizer.py: NFC normalizer, Qwen2 split regex + ByteLevel(add_prefix_space=False, use_regex=False),
ByteLevel decoder; `added_tokens_decoder` entries are added tokens, never split) with the `tokenizers` library
only, and the chat framing of qwen-tts 0.1.1 IM `_build_assistant_text` / MQ `generate` (ids[:3] role, ids[3:-5] text).
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

QWEN2_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
CHAT_TEMPLATE = "<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"
ROLE_LEN = 3  # "<|im_start|>", "assistant", "\n"
TAIL_LEN = 5  # "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n"
# Unicode categories of a character that may follow a stable cut after a letter or a digit: punctuation, symbols,
# separators, numbers (and, after a digit, letters); and the controls below. Never a mark (NFC composes a mark with
# the character before it) or an unassigned character (a newer Unicode may call it a letter).
_AFTER_LETTER = frozenset("PSZN")
_CONTROLS = frozenset("\t\n\r")


def _read_merges(path: Path) -> list[tuple[str, str]]:
    merges = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        line = line.strip()
        if not line or (i == 0 and line.startswith("#version:")):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{i + 1}: a merge needs two symbols, got {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


class TextTokenizer:
    """Text -> ids for the talker's text track. No transformers at run time."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        # Characters of the added tokens: a cut before one of them could split an added token written in the text.
        self._added_chars = frozenset("".join(t.content for t in tokenizer.get_added_tokens_decoder().values()))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> TextTokenizer:
        root = Path(path)
        for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
            if not (root / name).is_file():
                raise FileNotFoundError(f"{root / name}: not found (tokenizer files of a Qwen3-TTS checkpoint)")
        vocab = json.loads((root / "vocab.json").read_text(encoding="utf-8"))
        bpe = BPE(
            vocab=vocab,
            merges=_read_merges(root / "merges.txt"),
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
        tok = Tokenizer(bpe)
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()

        config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
        added = sorted(((int(i), d) for i, d in config.get("added_tokens_decoder", {}).items()), key=lambda x: x[0])
        for token_id, d in added:
            token = AddedToken(
                d["content"],
                single_word=d.get("single_word", False),
                lstrip=d.get("lstrip", False),
                rstrip=d.get("rstrip", False),
                normalized=d.get("normalized", not d.get("special", False)),
                special=d.get("special", False),
            )
            if token.special:
                tok.add_special_tokens([token])
            else:
                tok.add_tokens([token])
            got = tok.token_to_id(d["content"])
            if got != token_id:
                raise ValueError(f"{root}: added token {d['content']!r} got id {got}, tokenizer_config says {token_id}")
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, s: str) -> list[int]:
        """Plain encoding: no special-token insertion (added tokens written in `s` are still matched whole)."""
        return self._tok.encode(s, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def chat_ids(self, text: str) -> list[int]:
        """The whole framed sequence '<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n'."""
        return self.encode(CHAT_TEMPLATE.format(text=text))

    def text_ids(self, text: str) -> list[int]:
        """The text part as the official package gets it: the framed sequence minus 3 leading and 5 trailing ids."""
        return self.chat_ids(text)[ROLE_LEN:-TAIL_LEN]

    def stable_prefix(self, text: str) -> int:
        """The length of the longest prefix of `text` whose ids stay a prefix of the ids of any text that starts with
        `text` (0: none): `text_ids(text[:n]) == text_ids(text + more)[:len(text_ids(text[:n]))]` for every `more`.
        A streamed text commits these ids and keeps the rest until more text or its end arrives.

        A cut before `text[c]` (0 < c < len(text)) is stable when `text[c]` is no character of an added token (no
        added token written in the text can span it) and either
          - `text[c]` is a space and `text[c - 1]` is no whitespace, or
          - `text[c - 1]` is a letter and `text[c]` is punctuation, a symbol, a separator, a number, tab or newline,
          - `text[c - 1]` is a number and `text[c]` is one of those or a letter.
        Why: NFC normalization does not reach across such a cut (`text[c]` is a starter that composes with nothing
        before it), and with QWEN2_SPLIT_REGEX the pieces before the cut are the same in both texts: the piece that
        holds `text[c - 1]` ends at `c` (a run of letters stops at a non-letter, a number is a piece of its own, a run
        of punctuation stops at a space and takes only newlines after it), no piece before it reads past `c` (the one
        lookahead, in whitespace-only pieces, stays inside the prefix: `text[c - 1]` is no whitespace), and the pieces
        after the cut start at `c`. BPE merges only within a piece, so the ids of the pieces before the cut are the
        same; the framing around the text is the same in front and a special token behind.
        """
        for c in range(len(text) - 1, 0, -1):
            nxt, prev = text[c], text[c - 1]
            if nxt in self._added_chars:
                continue
            if nxt == " " and not prev.isspace():
                return c
            follows = nxt in _CONTROLS or unicodedata.category(nxt)[0] in _AFTER_LETTER
            if prev.isalpha() and follows:
                return c
            if unicodedata.category(prev)[0] == "N" and (follows or nxt.isalpha()):
                return c
        return 0
