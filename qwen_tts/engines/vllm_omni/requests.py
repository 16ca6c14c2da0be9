"""Pure translation between our request and vLLM-Omni's (no vLLM import): validation, the stage-0 request
payload, the sampling settings, and the cumulative-audio-to-chunk bookkeeping. Testable without vLLM."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from qwen_tts.engine_api import FRAME_SAMPLES, FinishReason, SynthesisRequest

# How the speaker vector travels to the talker process:
#   tensor: top-level `ref_spk_embedding` tensor, raw bytes over the IPC (needs vllm-omni-myfi's talker);
#   list:   a float list inside `voice_clone_prompt`, which stock vLLM-Omni understands.
SpeakerTransport = Literal["tensor", "list"]

# Where vLLM-Omni's talker finds codec codes computed before the request (`codes` is one of the payload keys it
# serialises tensor by tensor, so the reference travels as raw bytes whatever the speaker transport).
PRECOMPUTED_REF_CODES = "precomputed_ref"

# Our options vLLM-Omni cannot take per request (its residual-codebook sampling is set per deployment by the
# deploy config's `subtalker_sampling_params`).
NOT_PER_REQUEST = ("cp_temperature", "cp_top_k", "cp_top_p")


def validate_xvector(x: Any, dim: int, finite: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
    """A finite float tensor of shape (dim,), or ValueError. A bad vector would kill the talker's engine core.
    `finite`: the finiteness check (an engine's `FiniteCheck`, which remembers the tensors it passed); None: checked
    here."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"xvector must be a torch.Tensor, got {type(x).__name__}")
    if not (x.dtype.is_floating_point):
        raise ValueError(f"xvector must be floating point, got {x.dtype}")
    if x.dim() != 1 or x.shape[0] != dim:
        raise ValueError(f"xvector must have shape ({dim},), got {tuple(x.shape)}")
    if not (finite(x) if finite is not None else bool(torch.isfinite(x).all())):
        raise ValueError("xvector contains NaN or Inf")
    return x.detach().to(device="cpu", dtype=torch.float32).contiguous()


def language_name(language: str) -> str:
    """vLLM-Omni's spelling: 'Auto' or the language name (it lower-cases it for the codec id lookup)."""
    return "Auto" if language == "auto" else language.capitalize()


def additional_information(
    request: SynthesisRequest, xvector: torch.Tensor, language: str, transport: SpeakerTransport
) -> dict[str, Any]:
    """The stage-0 `additional_information` of a Base request (one item, vLLM-Omni's list form): x-vector only, or
    in-context with the request's ICL reference.

    ICL is vLLM-Omni's own voice-clone prompt with nothing for it to compute: `x_vector_only_mode` off and
    `voice_clone_prompt.icl_mode` on, the transcript as `ref_text` (its talker tokenizes it as the official
    package does), the reference codes as precomputed codes (so it never asks for `ref_audio` nor runs its
    encoder), and their length as `ref_code_length` for its prompt-length estimate."""
    icl = request.icl
    info: dict[str, Any] = {
        "text": [request.text],
        "task_type": ["Base"],
        "language": [language_name(language)],
        "instruct": [""],
        "x_vector_only_mode": [icl is None],
        "non_streaming_mode": [bool(request.non_streaming_text)],
    }
    prompt: dict[str, Any] = {}
    if transport == "tensor":
        info["ref_spk_embedding"] = xvector
    else:
        prompt["ref_spk_embedding"] = [float(v) for v in xvector.tolist()]
    if icl is not None:
        prompt["icl_mode"] = True
        info["ref_text"] = [icl.text]
        info["ref_code_length"] = [icl.frames]
        info["codes"] = {PRECOMPUTED_REF_CODES: icl.codes.detach().to("cpu", torch.int64).contiguous()}
    if prompt:
        info["voice_clone_prompt"] = [prompt]
    return info


@dataclass(frozen=True)
class Stage0Sampling:
    """Keyword arguments for stage 0's vllm.SamplingParams, from our options."""

    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    max_tokens: int
    min_tokens: int
    seed: int | None

    def kwargs(self) -> dict[str, Any]:
        return dict(self.__dict__)


def stage0_sampling(request: SynthesisRequest, frame_budget: int) -> Stage0Sampling:
    """Codebook-0 sampling. vLLM-Omni computes a token's residual codes in the step after it, so a request stopped
    by length yields one frame fewer than its tokens: the budget is asked for one token more."""
    greedy = request.greedy or request.temperature <= 0
    return Stage0Sampling(
        temperature=0.0 if greedy else float(request.temperature),
        top_k=-1 if greedy or request.top_k <= 0 else int(request.top_k),
        top_p=1.0 if greedy else float(request.top_p),
        repetition_penalty=float(request.repetition_penalty),
        max_tokens=int(frame_budget) + 1,
        min_tokens=min(int(request.min_frames), int(frame_budget)),
        seed=None if greedy else request.seed,
    )


def stage0_finish_reason(stage_metrics: Any, max_tokens: int) -> str | None:
    """Stage 0's vLLM finish reason ('stop' or 'length') from a finished request's per-stage metrics.

    vLLM-Omni 0.30 reports it (`stage_metrics["0"]["finish_reason"]`); 0.26 does not, so there it is inferred from
    the tokens stage 0 produced (`num_tokens_out`): `max_tokens` of them means it was stopped by length. None when
    neither is there."""
    stage0 = (stage_metrics or {}).get("0") if isinstance(stage_metrics, dict) else None
    if not isinstance(stage0, dict):
        return None
    reason = stage0.get("finish_reason")
    if reason is not None:
        return str(reason)
    tokens = stage0.get("num_tokens_out")
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
        return "length" if tokens >= max_tokens else "stop"
    return None


def finish_reason(stage0_reason: str | None, frames: int, frame_budget: int) -> FinishReason:
    """Stage 0's vLLM finish reason ('stop' at end-of-speech, 'length' at max_tokens) as ours."""
    if stage0_reason == "length" or frames >= frame_budget:
        return FinishReason.BUDGET
    return FinishReason.EOS


class AudioTail:
    """vLLM-Omni streams the whole waveform so far in each output; this hands out only the new samples, capped at
    the frame budget."""

    def __init__(self, frame_budget: int):
        self.sent = 0
        self.limit = frame_budget * FRAME_SAMPLES

    def new(self, cumulative: Any) -> np.ndarray:
        if cumulative is None:
            return np.zeros(0, dtype=np.float32)
        if isinstance(cumulative, torch.Tensor):
            audio = cumulative.detach().to("cpu", torch.float32).reshape(-1).numpy()
        else:
            audio = np.asarray(cumulative, dtype=np.float32).reshape(-1)
        end = min(len(audio), self.limit)
        chunk = audio[self.sent : end] if end > self.sent else np.zeros(0, dtype=np.float32)
        self.sent = max(self.sent, end)
        return np.ascontiguousarray(chunk, dtype=np.float32)

    @property
    def frames(self) -> int:
        return math.ceil(self.sent / FRAME_SAMPLES)
