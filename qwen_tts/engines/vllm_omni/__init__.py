"""The vLLM-Omni backend: our engine interface over vLLM-Omni's AsyncOmni two-stage pipeline (Talker -> Code2Wav).

Needs vllm + vllm-omni + the vllm-omni-myfi plugins in the running environment (`scripts/setup_vllm_omni.sh` on CPU);
importing this package does not import them.
"""

from .engine import VllmOmniConfig, VllmOmniEngine

__all__ = ["VllmOmniConfig", "VllmOmniEngine"]
