"""Streamed text: the TextStream interface, the tokenizer's stable prefixes (committed ids are always a prefix of the
whole text's ids) and the text track's rows (the same bits whether the text after them is known or not)."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest
import torch

from qwen_tts.model.prompt import TEXT_TRACK_GROUP, build_prompt, text_track_rows
from qwen_tts.model.tokenizer import ROLE_LEN, TextTokenizer
from qwen_tts.text_stream import TextSnapshot, TextStream, TextStreamClosedError

FULL_TOKENIZER = Path(
    os.environ.get("QWEN_TTS_FULL_TOKENIZER_DIR")
    or Path(__file__).resolve().parents[1].parent / "shared" / "tools" / "full_size_tokenizer"
)

# ------------------------------------------------------------------ TextStream


def test_push_appends_and_each_push_and_the_end_raise_the_version():
    s = TextStream()
    assert s.snapshot() == TextSnapshot("", False, 0)
    s.push("Hello, ")
    s.push("")  # nothing new: no new version
    s.push("world.")
    assert s.snapshot() == TextSnapshot("Hello, world.", False, 2)
    assert s.version == 2 and not s.ended
    s.end()
    s.end()  # harmless, no new version
    assert s.snapshot() == TextSnapshot("Hello, world.", True, 3)
    assert s.ended


def test_initial_text_counts_as_a_version():
    assert TextStream("Hi").snapshot() == TextSnapshot("Hi", False, 1)


def test_push_after_end_and_non_text_are_refused():
    s = TextStream("a")
    with pytest.raises(TypeError, match="must be str, not bytes"):
        s.push(b"b")
    s.end()
    with pytest.raises(TextStreamClosedError, match="ended"):
        s.push("b")
    assert s.snapshot().text == "a"


def test_listeners_are_called_after_every_push_and_the_end_until_removed():
    s = TextStream()
    seen: list[TextSnapshot] = []

    def listener() -> None:
        seen.append(s.snapshot())  # called outside the stream's lock: reading it does not deadlock

    s.add_listener(listener)
    s.push("a")
    s.push("")
    s.push("b")
    s.remove_listener(listener)
    s.remove_listener(listener)  # removing twice is harmless
    s.push("c")
    assert seen == [TextSnapshot("a", False, 1), TextSnapshot("ab", False, 2)]
    s.add_listener(listener)
    s.end()
    assert seen[-1] == TextSnapshot("abc", True, 4)


def test_concurrent_pushes_all_land_and_versions_count_them():
    s = TextStream()

    def producer(ch: str) -> None:
        for _ in range(500):
            s.push(ch)

    threads = [threading.Thread(target=producer, args=(ch,)) for ch in "xyz"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = s.snapshot()
    assert sorted(snap.text) == sorted("xyz" * 500) and snap.version == 1500


# ------------------------------------------------------------------ stable prefixes


def tokenizers(tiny_checkpoint: Path) -> list[TextTokenizer]:
    out = [TextTokenizer.from_pretrained(tiny_checkpoint)]
    if (FULL_TOKENIZER / "vocab.json").is_file():
        out.append(TextTokenizer.from_pretrained(FULL_TOKENIZER))
    return out


# Characters that stress the split regex and NFC: letters and marks that compose (e + U+0301), Hangul jamo that
# compose, CJK with its punctuation, digits of two scripts, contractions, newlines after punctuation, runs of
# spaces, non-breaking and ideographic spaces, a zero-width joiner, a keycap mark after a digit, and the characters
# of added tokens (an added token may be written in the text).
ALPHABET = [
    *"aeiKstlmdr'.,!?;:-()\"  \n\t\r0123456789",
    *("\u0301", "\u0308", "\u1100", "\u1161", "\u11a8", "é", "你", "好", "。", "，", "「"),
    *("\u00a0", "\u3000", "\u200d", "\u20e3", "٣"),
    *("<|im_end|>", "<tts_pad>", "<|", "|>", "_", "'s", "'ll"),
]


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def test_committed_ids_are_always_a_prefix_of_the_whole_texts_ids(tiny_checkpoint):
    rng = random.Random(49)
    texts = [random_text(rng, rng.randint(1, 40)) for _ in range(300)]
    texts += ["Hello, world. How are you?", "It's 2024 and we'll see.\n\nNext line", "你好世界。今天天气很好，是吧？"]
    for tok in tokenizers(tiny_checkpoint):
        cuts = 0
        for whole in texts:
            ids = tok.text_ids(whole)
            for k in range(1, len(whole) + 1):
                c = tok.stable_prefix(whole[:k])
                assert 0 <= c < k or c == 0
                if c:
                    cuts += 1
                    part = tok.text_ids(whole[:c])
                    assert ids[: len(part)] == part, (whole, k, c)
        assert cuts > 1000  # the property was tested on many cuts, not vacuously


def test_stable_prefix_cuts_before_the_last_space_and_keeps_the_unfinished_word(tiny_checkpoint):
    tok = TextTokenizer.from_pretrained(tiny_checkpoint)
    assert tok.stable_prefix("Hello") == 0  # the word may go on
    assert tok.stable_prefix("Hello ") == 5  # the space joins the next word: cut before it
    assert tok.stable_prefix("Hello, wor") == 6
    assert tok.stable_prefix("Hello,") == 5  # after a letter, before punctuation
    assert tok.stable_prefix("end.\n") == 3  # punctuation may take the newlines after it: cut before it
    assert tok.stable_prefix("你好。今") == 2  # CJK: no spaces, cut after the letters, before the punctuation
    assert tok.stable_prefix("x<|im_end|") == 0  # an added token may be being written: never cut inside it
    assert tok.stable_prefix("e\u0301") == 0  # a mark composes with the letter before it


# ------------------------------------------------------------------ the text track


def test_text_track_rows_do_not_depend_on_the_text_after_them(tiny_qwen3tts):
    m = tiny_qwen3tts
    pad = m.config.tts_pad_token_id
    ids = m.tokenizer.text_ids("The quick brown fox jumps over the lazy dog, and then some more words to go long.")
    assert len(ids) > 3 * TEXT_TRACK_GROUP
    with torch.inference_mode():
        whole = text_track_rows(m.talker, ids, 0, pad)
        assert whole.shape == (len(ids), m.config.talker.hidden_size)
        rng = random.Random(0)
        for _ in range(40):
            known = rng.randint(1, len(ids))
            start = rng.randint(0, known - 1)
            part = text_track_rows(m.talker, ids[:known], start, pad)
            assert torch.equal(part, whole[start:known]), (start, known)
        assert text_track_rows(m.talker, ids, len(ids), pad).shape == (0, m.config.talker.hidden_size)
        # Close to the official grouping (the whole text in one projection): the same values up to rounding.
        torch.testing.assert_close(whole, m.talker.embed_text(torch.tensor(ids)))


def test_streaming_prompt_trailing_is_the_text_track_then_end_of_text(tiny_qwen3tts):
    m = tiny_qwen3tts
    ids = m.tokenizer.chat_ids("Streaming text, one token per step, long enough for two groups of rows.")
    text = ids[ROLE_LEN:-5]
    x = torch.randn(m.config.talker.hidden_size)
    with torch.inference_mode():
        p = build_prompt(m.config, m.talker, text, ids[:ROLE_LEN], x, "auto", non_streaming=False)
        rows = text_track_rows(m.talker, text[1:], 0, m.config.tts_pad_token_id)
    assert torch.equal(p.trailing, torch.cat((rows, p.end[None])))
