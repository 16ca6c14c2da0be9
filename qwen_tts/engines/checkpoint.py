"""What the backends that serve a checkpoint (native, vLLM-Omni) share of the `Engine` interface."""

from __future__ import annotations

from typing import Any

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
