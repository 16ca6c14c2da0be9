"""ICL voices in tests: profiles written with reference codes, and the codec encoder for enrolment tests.

conftest's `reference_encoder` fixture gives the checkpoint's real codec encoder (`qwen_tts.model.codec_encoder`) where that module
exists; where it does not yet, a stand-in for that one call (`StandInCodecEncoder`, patched in place of
`qwen_tts.icl_profile.load_reference_encoder`), so enrolment's own work (the checks, the profile, the route) is tested
either way. The expected codes always come from the same encoder the code under test used.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import torch

from qwen_tts import icl_profile
from qwen_tts.icl import NUM_CODEBOOKS
from qwen_tts.voices import VoiceProfile, profile_path, save_profile

REAL_ENCODER = importlib.util.find_spec("qwen_tts.model.codec_encoder") is not None


def ref_codes(frames: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, icl_profile.CODEBOOK_SIZE, (frames, NUM_CODEBOOKS), generator=torch.Generator().manual_seed(seed)
    )


def write_icl_voice(
    profiles_dir: Path, speaker_id: str, dim: int, *, frames: int = 50, text: str = "What the clip says.", seed: int = 0
) -> Path:
    x = torch.randn(dim, generator=torch.Generator().manual_seed(seed))
    profile = VoiceProfile(x_vector=x, model="test", ref_text=text, ref_codes=ref_codes(frames, seed))
    return save_profile(profile_path(profiles_dir, speaker_id), profile, overwrite=True)


class StandInCodecEncoder:
    """The codec encoder's interface (mono float32 at a rate -> (ceil(N / 1920), 16) int64), its codes a function
    of the samples; every call is recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[np.ndarray, int]] = []

    def encode(self, wav: torch.Tensor | np.ndarray, sample_rate: int) -> torch.Tensor:
        wav = np.asarray(wav, dtype=np.float32)
        self.calls.append((wav.copy(), sample_rate))
        frames = math.ceil(wav.shape[0] / 1920)
        level = np.abs(wav[: frames * 1920]).sum() if wav.size else 0.0
        seed = int(level * 1000) % (2**31)
        return torch.randint(0, icl_profile.CODEBOOK_SIZE, (frames, NUM_CODEBOOKS),
                             generator=torch.Generator().manual_seed(seed))  # fmt: skip
