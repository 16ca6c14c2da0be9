"""The official package's recorded outputs (tests/reference/*.pt) in the parity tests: loading a fixture only where it
belongs to the checkpoint our writer produces today."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qwen_tts.model.random_checkpoint import weights_digest


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
