"""An in-context-learning (ICL) voice's reference: the clip's codec codes and its transcript, enrolled once.

A request that carries an `IclReference` is cloned in ICL mode: the reference transcript goes into the prompt before
the target text, the reference codes (summed over the 16 code embeddings) after the codec prefix, and the x-vector
stays where it is in x-vector mode. The output audio is the decode of the reference codes followed by the generated
codes, with the reference part cut, so the engine keeps Code2Wav's stream state after the reference codes.

`key` names the reference for the engine's per-voice cache (what every request of that voice would otherwise
recompute); two references with the same key must hold the same codes and text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["NUM_CODEBOOKS", "IclReference"]

NUM_CODEBOOKS = 16  # the 12 Hz codec's codebooks per frame


@dataclass(frozen=True, eq=False)
class IclReference:
    codes: torch.Tensor  # (T, NUM_CODEBOOKS) int64: the reference clip's 12 Hz codes
    text: str  # the reference clip's transcript
    key: str  # the voice's reference, for the engine's per-voice cache (a profile's content hash)

    def __post_init__(self) -> None:
        codes = self.codes
        if codes.dim() != 2 or codes.shape[1] != NUM_CODEBOOKS or codes.shape[0] < 1:
            raise ValueError(f"ICL reference codes must be (frames >= 1, {NUM_CODEBOOKS}), got {tuple(codes.shape)}")
        if codes.dtype != torch.int64:
            raise ValueError(f"ICL reference codes must be int64, got {codes.dtype}")
        if not self.text.strip():
            raise ValueError("an ICL reference needs its transcript")
        if not self.key:
            raise ValueError("an ICL reference needs a cache key")

    @property
    def frames(self) -> int:
        return int(self.codes.shape[0])
