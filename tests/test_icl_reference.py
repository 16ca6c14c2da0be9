"""`IclReference` (qwen_tts/icl.py): what an ICL voice's reference must hold."""

from __future__ import annotations

import pytest
import torch

from qwen_tts.engine_api import SynthesisRequest
from qwen_tts.icl import NUM_CODEBOOKS, IclReference


def test_a_reference_holds_int64_codes_of_sixteen_codebooks_a_transcript_and_a_key() -> None:
    codes = torch.randint(0, 2048, (25, NUM_CODEBOOKS))
    ref = IclReference(codes=codes, text="What the clip says.", key="sha256:abc")
    assert ref.frames == 25
    request = SynthesisRequest(text="Hello.", xvector=torch.zeros(8), icl=ref)
    assert request.icl is ref and SynthesisRequest(text="Hello.", xvector=torch.zeros(8)).icl is None


@pytest.mark.parametrize(
    ("codes", "text", "key", "message"),
    [
        (torch.zeros(25, 8, dtype=torch.int64), "t", "k", r"\(frames >= 1, 16\), got \(25, 8\)"),
        (torch.zeros(0, 16, dtype=torch.int64), "t", "k", r"got \(0, 16\)"),
        (torch.zeros(16, dtype=torch.int64), "t", "k", r"got \(16,\)"),
        (torch.zeros(4, 16, dtype=torch.int32), "t", "k", "must be int64, got torch.int32"),
        (torch.zeros(4, 16, dtype=torch.int64), "  ", "k", "needs its transcript"),
        (torch.zeros(4, 16, dtype=torch.int64), "t", "", "needs a cache key"),
    ],
)
def test_a_malformed_reference_is_refused_with_what_is_wrong(codes, text, key, message) -> None:
    with pytest.raises(ValueError, match=message):
        IclReference(codes=codes, text=text, key=key)
