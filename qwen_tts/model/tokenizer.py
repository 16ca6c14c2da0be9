"""Qwen2 byte-level BPE text tokenizer built from `vocab.json` + `merges.txt` + `tokenizer_config.json`.

Reimplements what transformers 4.57.3 `Qwen2TokenizerFast` builds from the slow files (`Qwen2Converter` in
convert_slow_tokenizer.py: NFC normalizer, Qwen2 split regex + ByteLevel(add_prefix_space=False, use_regex=False),
ByteLevel decoder; `added_tokens_decoder` entries are added tokens, never split) with the `tokenizers` library
only, and the chat framing of qwen-tts 0.1.1 IM `_build_assistant_text` / MQ `generate` (ids[:3] role, ids[3:-5] text).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

QWEN2_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
CHAT_TEMPLATE = "<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"
ROLE_LEN = 3  # "<|im_start|>", "assistant", "\n"
TAIL_LEN = 5  # "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n"


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
