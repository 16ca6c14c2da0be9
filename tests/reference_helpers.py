"""The official package's recorded outputs (tests/reference/*.pt) in the parity tests: loading a fixture only where it
belongs to the checkpoint our writer produces today, and comparing our prompts with the recorded ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from qwen_tts.model.random_checkpoint import weights_digest
from qwen_tts.model.tokenizer import ROLE_LEN, TAIL_LEN


def require_recorded_checkpoint(checkpoint: Path, digest: str, fixture: str, regenerate: str) -> None:
    """Fail, asking for `regenerate`, where the checkpoint's weights are not the ones `fixture` was recorded on."""
    if weights_digest(checkpoint) != digest:
        pytest.fail(
            f"the {checkpoint.name} checkpoint the writer produces differs from the one {fixture} was recorded on "
            f"(qwen_tts/model/random_checkpoint.py changed?). Regenerate the fixture in the reference venv: {regenerate}"
        )


def load_reference_fixture(path: Path, tiny_checkpoint: Path, regenerate: str) -> dict:
    """The recorded official outputs at `path`, after checking they belong to the tiny checkpoint (seed 0) the
    writer produces today."""
    fx = torch.load(path, weights_only=True)
    meta = fx["meta"]
    assert (meta["size"], meta["seed"]) == ("tiny", 0), f"{path.name} is for {meta['size']} seed {meta['seed']}"
    require_recorded_checkpoint(tiny_checkpoint, meta["weights_digest"], path.name, regenerate)
    return fx


def prompt_args(model, case: dict, xvector: torch.Tensor) -> tuple:
    """`build_prompt`'s arguments before the ICL reference for a recorded case: config and talker, the text's chat
    ids (the text part, the role part), the x-vector, the language and the text mode."""
    ids = model.tokenizer.chat_ids(case["text"])
    text_ids, role_ids = ids[ROLE_LEN:-TAIL_LEN], ids[:ROLE_LEN]
    return model.config, model.talker, text_ids, role_ids, xvector, case["language"], case["non_streaming"]


def _track(trailing: torch.Tensor, pad: torch.Tensor, steps: int) -> torch.Tensor:
    """The text-track rows added to decode steps 0..steps-1: the trailing rows, then tpad."""
    return torch.stack([trailing[k] if k < len(trailing) else pad for k in range(steps)])


def assert_prompt_matches(prompt, case: dict, label: str) -> None:
    """Our prompt against the recorded one: the prefill, and the text track of the decode steps (past the longer
    trailing part, into tpad)."""
    assert_close(prompt.prefill, case["prefill"], msg=lambda m: f"{label} prefill: {m}")
    steps = max(len(case["trailing"]), len(prompt.trailing)) + 2
    ours, theirs = _track(prompt.trailing, prompt.pad, steps), _track(case["trailing"], case["pad"], steps)
    assert_close(ours, theirs, msg=lambda m: f"{label} text track: {m}")
