"""The text tokenizer against full-size Qwen2 tokenizer files (vocab.json, merges.txt, tokenizer_config.json).

Their folder is `QWEN_TTS_FULL_TOKENIZER_DIR`, else `shared/tools/full_size_tokenizer` beside the checkout; the
tests skip when neither exists.
"""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

import pytest

from qwen_tts.model.tokenizer import TextTokenizer

TOKENIZER_DIR = Path(
    os.environ.get("QWEN_TTS_FULL_TOKENIZER_DIR")
    or Path(__file__).resolve().parents[1].parent / "shared" / "tools" / "full_size_tokenizer"
)

pytestmark = pytest.mark.skipif(
    not (TOKENIZER_DIR / "vocab.json").is_file(),
    reason=f"full-size tokenizer files not found at {TOKENIZER_DIR} (set QWEN_TTS_FULL_TOKENIZER_DIR)",
)


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def added() -> dict[str, int]:
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    return {d["content"]: int(i) for i, d in config["added_tokens_decoder"].items()}


def test_special_tokens_encode_to_their_single_ids(tok: TextTokenizer, added: dict[str, int]) -> None:
    for name, token_id in (("<|im_start|>", 151644), ("<|im_end|>", 151645), ("<tts_pad>", 151671)):
        assert added[name] == token_id
    for content, token_id in added.items():
        assert tok.encode(content) == [token_id]
        assert tok.encode(f"ab{content}cd") == [*tok.encode("ab"), token_id, *tok.encode("cd")]
    assert tok.vocab_size == max(added.values()) + 1


def test_chat_framing_has_three_role_ids_and_five_tail_ids(tok: TextTokenizer) -> None:
    ids = tok.chat_ids("The quick brown fox.")
    assistant, newline = tok.token_to_id("assistant"), tok.token_to_id("Ċ")
    assert assistant is not None and newline == 198
    assert ids[:3] == [151644, assistant, newline]
    assert ids[-5:] == [151645, newline, 151644, assistant, newline]
    assert tok.text_ids("The quick brown fox.") == ids[3:-5] == tok.encode("The quick brown fox.")


def test_text_ids_slice_the_framed_sequence_even_when_the_text_alone_tokenizes_differently(tok: TextTokenizer) -> None:
    text = "\n\nHello"
    framed = tok.chat_ids(text)
    assert tok.text_ids(text) == framed[3:-5]
    assert tok.decode(framed) == f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "text", ["Grüße, 世界! 🎉 naïve café — ok", "don't you'LL 12345 x\r\ny  z\n\nq", "tab\there  ", "हिन्दी भाषा"]
)
def test_byte_level_round_trip_of_unicode_text(tok: TextTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_input_is_nfc_normalized(tok: TextTokenizer) -> None:
    decomposed = "cafe\u0301"
    assert unicodedata.normalize("NFC", decomposed) != decomposed
    assert tok.encode(decomposed) == tok.encode("caf\u00e9")
