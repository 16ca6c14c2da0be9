"""What the backends that serve a checkpoint (native, vLLM-Omni) share of the `Engine` interface."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from qwen_tts.engine_api import Engine
from qwen_tts.model.config import ModelConfig


class CheckpointEngine(Engine):
    """An engine serving a checkpoint: the x-vector width and the languages are its config's (`_cfg`, read before
    `start`), the model info what the backend gathered (`_model_info`, a copy for each caller)."""

    _cfg: ModelConfig
    _model_info: dict[str, Any]

    @property
    def xvector_dim(self) -> int:
        return self._cfg.xvector_dim

    @property
    def languages(self) -> list[str]:
        return self._cfg.languages

    @property
    def model_info(self) -> dict[str, Any]:
        return dict(self._model_info)


class FiniteCheck:
    """Whether a tensor holds only finite values, remembered per tensor object while it lives and is not written to:
    a voice's x-vector is the one tensor of its profile, checked on its first request, not on every one. A torch
    call on the event loop releases the GIL and must win it back from the engine's threads; in a profile of the
    server under a burst this check was the largest item of the loop's request handling, where a lookup is not."""

    LIMIT = 4096  # tensors remembered before starting over

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ref, int]] = {}  # id -> (the tensor, its version when found finite)

    def __call__(self, x: torch.Tensor) -> bool:
        if x.is_inference():  # no version counter to tell a later write by: checked every time
            return bool(torch.isfinite(x).all())
        seen = self._seen.get(id(x))
        if seen is not None and seen[0]() is x and seen[1] == x._version:
            return True
        if not torch.isfinite(x).all():
            return False
        if len(self._seen) >= self.LIMIT:
            self._seen.clear()
        self._seen[id(x)] = (weakref.ref(x), x._version)
        return True
