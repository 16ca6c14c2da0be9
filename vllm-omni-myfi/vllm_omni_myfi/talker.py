"""The Qwen3-TTS talker with the server's two changes, as a subclass of vLLM-Omni's.

1. Fast path for x-vector-only Base requests: a top-level `ref_spk_embedding` tensor in
   `additional_information` travels as raw bytes (vLLM-Omni serialises top-level tensors; a tensor nested in
   `voice_clone_prompt` cannot be pickled by the multiprocess executor, and a float list costs a Python float
   per element). vLLM-Omni ignores the top-level key and then asks for `ref_audio`; here it is moved into
   `voice_clone_prompt` before the prompt is built.
2. The prompt embeddings follow the model dtype (vLLM-Omni hard-codes bfloat16, which breaks a float32 model
   with `index_copy_(): ... Float and BFloat16`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker import Qwen3TTSTalkerForConditionalGeneration

REF_SPK_EMBEDDING = "ref_spk_embedding"


def promote_ref_spk_embedding(info: dict[str, Any]) -> None:
    """Move a top-level `ref_spk_embedding` tensor into `voice_clone_prompt` (in place).

    A speaker embedding already present in `voice_clone_prompt` wins; the top-level key is always removed.
    """
    spk = info.pop(REF_SPK_EMBEDDING, None)
    if not isinstance(spk, torch.Tensor):
        return
    prompt = info.get("voice_clone_prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], dict) else None
    if not isinstance(prompt, dict):
        prompt = {}
    if prompt.get(REF_SPK_EMBEDDING) is None:
        prompt = {**prompt, REF_SPK_EMBEDDING: spk.reshape(-1)}
    info["voice_clone_prompt"] = [prompt]


class MyfiQwen3TTSTalker(Qwen3TTSTalkerForConditionalGeneration):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        dtype = getattr(vllm_config.model_config, "dtype", None)
        if isinstance(dtype, torch.dtype):
            self._embedding_dtype = dtype
            self._prompt_builder._embedding_dtype = dtype

    def preprocess_batch(self, *, req_ids, model_intermediate_buffer, device) -> None:
        for req_id in req_ids:
            info = model_intermediate_buffer.get(req_id)
            if isinstance(info, dict):
                promote_ref_spk_embedding(info)
                nested = info.get("additional_information")
                if isinstance(nested, dict):
                    promote_ref_spk_embedding(nested)
        super().preprocess_batch(req_ids=req_ids, model_intermediate_buffer=model_intermediate_buffer, device=device)

    def preprocess(self, input_ids: torch.Tensor, input_embeds: torch.Tensor | None, **info_dict: Any):
        promote_ref_spk_embedding(info_dict)
        nested = info_dict.get("additional_information")
        if isinstance(nested, dict):
            nested = dict(nested)
            promote_ref_spk_embedding(nested)
            info_dict["additional_information"] = nested
        return super().preprocess(input_ids, input_embeds, **info_dict)
