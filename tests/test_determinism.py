"""A request's output does not depend on what runs beside it (docs/security.md, "Determinism").

The same request runs alone, then first in a batch with three others (other voices, texts and seeds): its codes
are the same, and with `batch_invariant_decode` its int16 audio is too, sample for sample. With the default batched
Code2Wav decode the audio may round differently (tests/test_hardening_process.py bounds that on the CPU). On the
CPU with the tiny checkpoint, and on CUDA with the engine's fast path where a GPU is present.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from qwen_tts.engine_api import EngineSettings, SynthesisRequest
from qwen_tts.engines.native import NativeEngine

TEXTS = [
    "The same request, alone and in company.",
    "Another voice says something else entirely, at its own length.",
    "A third one, shorter.",
    "And a fourth request that runs beside the first for a while, then leaves.",
]
FRAMES = 48
OTHERS = 3

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


def pcm(x: np.ndarray) -> np.ndarray:
    """The int16 samples a client gets."""
    return np.round(np.clip(x, -1.0, 1.0) * 32767.0).astype(np.int16)


def request(dim: int, i: int, seed: int) -> SynthesisRequest:
    x = torch.randn(dim, generator=torch.Generator().manual_seed(1000 + i))
    return SynthesisRequest(
        text=TEXTS[i % len(TEXTS)], xvector=x, seed=seed + i, max_frames=FRAMES, min_frames=FRAMES, return_codes=True
    )


@pytest.mark.parametrize("invariant", [False, True], ids=["batched-decode", "invariant-decode"])
@pytest.mark.parametrize("device", DEVICES)
async def test_a_request_alone_and_batched_gives_the_same_codes_and_with_invariant_decode_the_same_audio(
    tiny_checkpoint: Path, device: str, invariant: bool
) -> None:
    trials = 10 if device == "cuda" else 2
    cfg = EngineSettings(
        model_path=str(tiny_checkpoint), device=device, max_slots=OTHERS + 1, batch_invariant_decode=invariant
    )
    engine = NativeEngine(cfg)
    await engine.start()
    try:
        dim = engine.xvector_dim
        for t in range(trials):
            alone = engine.submit(request(dim, 0, 100 * t))
            audio_alone = await alone.collect()
            batch = [engine.submit(request(dim, i, 100 * t)) for i in range(OTHERS + 1)]
            audio_batched = await asyncio.gather(*(h.collect() for h in batch))
            assert torch.equal(torch.cat(alone.codes), torch.cat(batch[0].codes)), f"trial {t}"
            assert audio_alone.shape == audio_batched[0].shape
            if invariant:
                assert np.array_equal(pcm(audio_alone), pcm(audio_batched[0])), f"trial {t}"
    finally:
        await engine.stop()
