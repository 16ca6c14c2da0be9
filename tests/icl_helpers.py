"""ICL voices in tests: profiles written with reference codes."""

from __future__ import annotations

from pathlib import Path

import torch

from qwen_tts import icl_profile
from qwen_tts.icl import NUM_CODEBOOKS
from qwen_tts.voices import VoiceProfile, profile_path, save_profile


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
