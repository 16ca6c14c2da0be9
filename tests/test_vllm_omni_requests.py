"""The vLLM-Omni backend's pure translation layer (no vLLM needed): speaker-vector validation, the stage-0 payload,
sampling, finish reasons and the cumulative-audio tail."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwen_tts.engine_api import FRAME_SAMPLES, FinishReason, SynthesisRequest
from qwen_tts.engines.vllm_omni.requests import (
    AudioTail,
    additional_information,
    finish_reason,
    stage0_finish_reason,
    stage0_sampling,
    validate_xvector,
)


@pytest.mark.parametrize(
    ("x", "message"),
    [
        ([0.1] * 32, "must be a torch.Tensor"),
        (np.ones(32, np.float32), "must be a torch.Tensor"),
        (torch.ones(32, dtype=torch.int64), "floating point"),
        (torch.ones(31), "shape (32,)"),
        (torch.ones(2, 16), "shape (32,)"),
        (torch.full((32,), float("nan")), "NaN or Inf"),
        (torch.full((32,), float("inf")), "NaN or Inf"),
    ],
)
def test_bad_speaker_vectors_are_refused_before_submit(x, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_xvector(x, 32)


def test_a_good_vector_becomes_contiguous_float32_on_the_host() -> None:
    x = torch.arange(64, dtype=torch.float64)[::2]
    out = validate_xvector(x, 32)
    assert out.dtype == torch.float32 and out.is_contiguous() and out.device.type == "cpu"
    assert torch.equal(out, x.float())


def test_payload_for_both_transports() -> None:
    x = torch.linspace(-1, 1, 32)
    req = SynthesisRequest(text="Hi there.", xvector=x, non_streaming_text=False)
    fast = additional_information(req, x, "english", "tensor")
    assert fast["ref_spk_embedding"] is x and "voice_clone_prompt" not in fast
    assert fast["text"] == ["Hi there."] and fast["task_type"] == ["Base"] and fast["x_vector_only_mode"] == [True]
    assert fast["language"] == ["English"] and fast["non_streaming_mode"] == [False]
    slow = additional_information(req, x, "auto", "list")
    assert "ref_spk_embedding" not in slow and slow["language"] == ["Auto"]
    (prompt,) = slow["voice_clone_prompt"]
    assert prompt["ref_spk_embedding"] == pytest.approx(x.tolist()) and all(
        type(v) is float for v in prompt["ref_spk_embedding"]
    )


def test_sampling_maps_our_options_and_asks_one_token_past_the_budget() -> None:
    x = torch.ones(32)
    s = stage0_sampling(SynthesisRequest(text="a", xvector=x, temperature=0.7, top_k=20, top_p=0.8, seed=5), 100)
    assert s.kwargs() == dict(
        temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05, max_tokens=101, min_tokens=2, seed=5
    )
    g = stage0_sampling(SynthesisRequest(text="a", xvector=x, greedy=True, min_frames=500, seed=5), 40)
    assert (g.temperature, g.top_k, g.top_p, g.seed, g.min_tokens, g.max_tokens) == (0.0, -1, 1.0, None, 40, 41)


def test_finish_reasons() -> None:
    assert finish_reason("stop", 10, 40) is FinishReason.EOS
    assert finish_reason("length", 39, 40) is FinishReason.BUDGET
    assert finish_reason(None, 40, 40) is FinishReason.BUDGET


def test_stage0_finish_reason_from_either_versions_metrics() -> None:
    # vLLM-Omni 0.30 reports stage 0's reason; it wins over the token count.
    assert stage0_finish_reason({"0": {"finish_reason": "stop", "num_tokens_out": 41}}, 41) == "stop"
    assert stage0_finish_reason({"0": {"finish_reason": "length", "num_tokens_out": 7}}, 41) == "length"
    # 0.26 reports only the tokens stage 0 produced: max_tokens of them is a length stop.
    assert stage0_finish_reason({"0": {"num_tokens_out": 41}, "1": {"num_tokens_out": 0}}, 41) == "length"
    assert stage0_finish_reason({"0": {"num_tokens_out": 17}}, 41) == "stop"
    # Nothing usable: unknown, and finish_reason() falls back on the frame count.
    for metrics in (None, {}, {"1": {"finish_reason": "stop"}}, {"0": {"num_tokens_out": 0}}, {"0": "x"}, []):
        assert stage0_finish_reason(metrics, 41) is None
    assert finish_reason(stage0_finish_reason({"0": {"num_tokens_out": 17}}, 41), 16, 40) is FinishReason.EOS


def test_audio_tail_hands_out_only_new_samples_up_to_the_budget() -> None:
    tail = AudioTail(frame_budget=3)
    full = np.arange(5 * FRAME_SAMPLES, dtype=np.float32)
    a = tail.new(torch.from_numpy(full[:FRAME_SAMPLES]))
    b = tail.new(full[: 2 * FRAME_SAMPLES + 10])
    c = tail.new(full[: 2 * FRAME_SAMPLES + 10])  # nothing new
    d = tail.new(torch.from_numpy(full))  # past the budget: cut at 3 frames
    assert [len(a), len(b), len(c), len(d)] == [FRAME_SAMPLES, FRAME_SAMPLES + 10, 0, FRAME_SAMPLES - 10]
    np.testing.assert_array_equal(np.concatenate([a, b, c, d]), full[: 3 * FRAME_SAMPLES])
    assert tail.frames == 3 and tail.new(None).size == 0
