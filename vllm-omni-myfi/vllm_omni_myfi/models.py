"""Model overrides, registered in every stage process through `vllm_omni.general_plugins`."""

from __future__ import annotations

_TALKER = "vllm_omni_myfi.talker:MyfiQwen3TTSTalker"
# The checkpoint's architecture name and the talker stage's model_arch both resolve to the talker class.
_TALKER_ARCHS = ("Qwen3TTSForConditionalGeneration", "Qwen3TTSTalkerForConditionalGeneration")


def register() -> None:
    """Point the Qwen3-TTS talker architectures at our subclass in vLLM's and vLLM-Omni's registries.

    Idempotent: vLLM-Omni may call general plugins more than once per process.
    """
    from vllm.model_executor.models import ModelRegistry
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    for arch in _TALKER_ARCHS:
        for registry in (ModelRegistry, OmniModelRegistry):
            registry.register_model(arch, _TALKER)
