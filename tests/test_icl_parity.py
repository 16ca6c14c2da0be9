"""ICL voice cloning: parity with the official qwen-tts 0.1.1 on the tiny random checkpoint, against the fixture.

tests/reference/fixture_icl_tiny.pt was recorded by tests/reference/make_icl_fixture.py in the reference venv (a
`VoiceClonePromptItem` with given reference codes, greedy, EOS held off): the prompt embeddings, the generated codes
and the output audio (decode of reference + generated codes, reference part cut). Float comparisons use the float32
defaults of assert_close; codes are exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference_helpers import assert_prompt_matches, load_reference_fixture, prompt_args
from torch.testing import assert_close

from qwen_tts.model.icl_prompt import (
    decode_icl,
    icl_cut,
    icl_prompt_len,
    prime_stream,
    ref_text_ids,
    reference_block,
)
from qwen_tts.model.prompt import IclRows, build_prompt
from qwen_tts.model.reference_loop import generate_codes

FIXTURE = Path(__file__).parent / "reference" / "fixture_icl_tiny.pt"
REGENERATE = ".venv-ref/bin/python tests/reference/make_icl_fixture.py"
HOP = 1920


@pytest.fixture(scope="module")
def ref(tiny_checkpoint: Path) -> dict:
    return load_reference_fixture(FIXTURE, tiny_checkpoint, REGENERATE)


def _id(case: dict) -> str:
    mode = "nonstream" if case["non_streaming"] else "stream"
    return f"{case['language']}-{mode}-ref{len(case['ref_codes'])}"


def test_the_fixture_covers_both_text_modes_both_languages_and_both_reference_lengths(ref, tiny_qwen3tts):
    cases = ref["cases"]
    assert {c["non_streaming"] for c in cases} == {True, False}
    assert {"english", "chinese"} <= {c["language"] for c in cases}
    # streaming mode: the reference + target text longer than the code block (text trails) and shorter (tpad)
    streamed = [c for c in cases if not c["non_streaming"]]
    assert {len(c["trailing"]) > 1 for c in streamed} == {True, False}


def test_reference_text_ids_match(ref, tiny_qwen3tts):
    for case in ref["cases"]:
        assert ref_text_ids(tiny_qwen3tts.tokenizer, case["ref_text"]) == case["ref_ids"], _id(case)


def test_icl_prompt_embeddings_match(ref, tiny_qwen3tts):
    m = tiny_qwen3tts
    for case in ref["cases"]:
        with torch.inference_mode():
            block = reference_block(m.talker, case["ref_codes"])
            p = build_prompt(*prompt_args(m, case, ref["xvector"]), IclRows(case["ref_ids"], block))
        assert_prompt_matches(p, case, _id(case))


@pytest.fixture(scope="module")
def generated(ref, tiny_qwen3tts) -> list[torch.Tensor]:
    """Our greedy ICL codes for every case, EOS held off as the fixture held it off."""
    m, frames = tiny_qwen3tts, ref["meta"]["frames"]
    return [
        generate_codes(
            m.talker,
            m.config,
            m.tokenizer,
            case["text"],
            ref["xvector"],
            case["language"],
            case["non_streaming"],
            max_frames=frames,
            min_new_tokens=frames,
            repetition_penalty=case["repetition_penalty"],
            ref_codes=case["ref_codes"],
            ref_text=case["ref_text"],
        )
        for case in ref["cases"]
    ]


def test_greedy_icl_codes_identical(ref, generated):
    for case, codes in zip(ref["cases"], generated, strict=True):
        assert codes.shape == case["codes"].shape, _id(case)
        mismatch = (codes != case["codes"]).any(dim=1).nonzero()
        assert mismatch.numel() == 0, f"{_id(case)}: first differing frame {int(mismatch[0])}"


def test_output_audio_is_the_official_decode_and_cut(ref, generated, tiny_qwen3tts):
    for case, codes in zip(ref["cases"], generated, strict=True):
        wav = decode_icl(tiny_qwen3tts.code2wav, case["ref_codes"], codes)
        assert wav.shape == case["audio"].shape, _id(case)
        assert_close(wav, case["audio"], msg=lambda msg, c=case: f"{_id(c)} audio: {msg}")


def test_the_official_cut_keeps_the_last_reference_sample_for_some_lengths(ref):
    """The official cut is int(ref / total * samples); for 31 + 16 frames the product rounds down one sample."""
    for case in ref["cases"]:
        r, g = len(case["ref_codes"]), len(case["codes"])
        cut = icl_cut(r, r + g, (r + g) * HOP)
        assert len(case["audio"]) == (r + g) * HOP - cut, _id(case)
        assert cut == r * HOP - (1 if r == 31 else 0), _id(case)


@pytest.mark.parametrize("chunks", [[1, 3, 5, 7], [16]])
def test_streamed_audio_after_the_primed_reference_is_the_official_audio(ref, generated, tiny_qwen3tts, chunks):
    """A stream primed with the reference codes starts at ref * 1920: the official audio minus the one reference
    sample its cut keeps for some lengths."""
    c2w = tiny_qwen3tts.code2wav
    for case, codes in zip(ref["cases"], generated, strict=True):
        r = len(case["ref_codes"])
        with torch.inference_mode():
            stream = prime_stream(c2w, case["ref_codes"])
            assert int(stream.position) == r
            parts, at = [], 0
            for n in chunks:
                parts.append(c2w.decode_chunk(codes[at : at + n].T[None], stream)[0])
                at += n
        streamed = torch.cat(parts)
        lead = len(case["audio"]) - len(codes) * HOP
        assert lead == (1 if r == 31 else 0)
        assert_close(streamed, case["audio"][lead:], msg=lambda msg, c=case: f"{_id(c)} streamed: {msg}")


def test_the_prompt_length_is_known_before_the_prompt_is_built(ref, tiny_qwen3tts):
    """The engine refuses a reference too long for its cache at submit, from `icl_prompt_len`."""
    for case in ref["cases"]:
        n_text = len(tiny_qwen3tts.tokenizer.text_ids(case["text"]))
        n = icl_prompt_len(
            case["language"], len(case["ref_ids"]), n_text, len(case["ref_codes"]), case["non_streaming"]
        )
        assert n == len(case["prefill"]), _id(case)
