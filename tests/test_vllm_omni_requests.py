"""The vLLM-Omni backend's pure translation layer (no vLLM needed): speaker-vector validation, the stage-0 payload,
sampling, finish reasons and the cumulative-audio tail."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch

from qwen_tts.engine_api import FRAME_SAMPLES, FinishReason, SynthesisRequest
from qwen_tts.engines.checkpoint import FiniteCheck
from qwen_tts.engines.vllm_omni.requests import (
    AudioTail,
    additional_information,
    finish_reason,
    stage0_finish_reason,
    stage0_sampling,
    validate_xvector,
)
from qwen_tts.icl import IclReference
from server_helpers import REPO_ROOT, VO_PYTHON, needs_vllm_omni


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


def test_a_finite_check_passed_in_is_the_one_used() -> None:
    """The engine hands its FiniteCheck: a vector it passed is not checked again until written to."""
    calls: list[torch.Tensor] = []
    check = FiniteCheck()

    def counted(t: torch.Tensor) -> bool:
        calls.append(t)
        return check(t)

    x = torch.randn(32)
    assert torch.equal(validate_xvector(x, 32, counted), x)
    assert torch.equal(validate_xvector(x, 32, counted), x)
    assert len(calls) == 2 and len(check._seen) == 1
    x[5] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        validate_xvector(x, 32, counted)


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


# --- ICL voices: vLLM-Omni's own in-context form, with the codes computed at enrolment ---------------------------
ICL_CODES = torch.randint(0, 2048, (40, 16), generator=torch.Generator().manual_seed(1))


def _icl_request(non_streaming: bool = True) -> SynthesisRequest:
    ref = IclReference(codes=ICL_CODES, text="What the clip says.", key="sha256:k")
    return SynthesisRequest(text="Hi there.", xvector=torch.ones(32), non_streaming_text=non_streaming, icl=ref)


def test_an_icl_request_is_vllm_omnis_in_context_prompt_with_precomputed_codes() -> None:
    x = torch.linspace(-1, 1, 32)
    fast = additional_information(_icl_request(), x, "english", "tensor")
    assert fast["x_vector_only_mode"] == [False] and fast["ref_spk_embedding"] is x
    assert fast["voice_clone_prompt"] == [{"icl_mode": True}]
    assert fast["ref_text"] == ["What the clip says."] and fast["ref_code_length"] == [40]
    (codes,) = fast["codes"].values()
    assert list(fast["codes"]) == ["precomputed_ref"] and codes.dtype == torch.int64 and torch.equal(codes, ICL_CODES)
    slow = additional_information(_icl_request(False), x, "auto", "list")
    (prompt,) = slow["voice_clone_prompt"]
    assert prompt["icl_mode"] is True and prompt["ref_spk_embedding"] == pytest.approx(x.tolist())
    assert slow["non_streaming_mode"] == [False] and torch.equal(slow["codes"]["precomputed_ref"], ICL_CODES)
    assert "ref_spk_embedding" not in slow
    plain = additional_information(SynthesisRequest(text="Hi.", xvector=x), x, "auto", "tensor")
    assert plain["x_vector_only_mode"] == [True] and not {"codes", "ref_text", "voice_clone_prompt"} & set(plain)


_VO_CHECK = """
import json, sys, torch
from qwen_tts.engine_api import SynthesisRequest
from qwen_tts.engines.checkpoint import FiniteCheck
from qwen_tts.icl import IclReference
from qwen_tts.engines.vllm_omni.requests import additional_information
from vllm_omni.data_entry_keys import deserialize_payload, serialize_payload
from vllm_omni.model_executor.models.qwen3_tts.prompt_embeds_builder import (
    Qwen3TTSPromptEmbedsBuilder, resolve_x_vector_only)
codes = torch.randint(0, 2048, (40, 16), generator=torch.Generator().manual_seed(1))
x, out = torch.ones(32), []
tok = lambda s: list(range(len(s)))
for transport in ("tensor", "list"):
    for non_streaming in (True, False):
        for icl in (None, IclReference(codes=codes, text="Ref words.", key="k")):
            req = SynthesisRequest(text="Hello there.", xvector=x, non_streaming_text=non_streaming, icl=icl)
            info = additional_information(req, x, "english", transport)
            back = deserialize_payload(serialize_payload(info))
            est = Qwen3TTSPromptEmbedsBuilder.estimate_prompt_len_from_additional_information(
                info, task_type="Base", tokenize_prompt=tok, codec_language_id={"english": 7}, spk_is_dialect=None)
            ref = (back.get("codes") or {}).get("precomputed_ref")
            out.append([transport, non_streaming, icl is not None, resolve_x_vector_only(back), est,
                        ref is not None and torch.equal(ref, codes)])
print(json.dumps(out))
"""


@needs_vllm_omni()
def test_vllm_omni_reads_our_icl_payload_as_in_context_with_the_reference_in_its_prompt() -> None:
    """Through vLLM-Omni's own functions: the payload survives its request serialisation with the codes as a tensor,
    its mode resolution says in-context, and its prompt-length estimate counts the reference's 1 + 40 codec
    positions and the transcript's tokens beside the x-vector prompt's."""
    r = subprocess.run([str(VO_PYTHON), "-c", _VO_CHECK], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 8
    for transport, non_streaming, icl, xvector_only, _, codes_intact in rows:
        assert xvector_only is (not icl) and codes_intact is icl, (transport, non_streaming)
    by = {(t, n, i): length for t, n, i, _, length, _ in rows}
    ref_ids = len("<|im_start|>assistant\nRef words.<|im_end|>\n") - 5  # the stand-in tokenizer's, less the 5 stripped
    for transport in ("tensor", "list"):
        # Non-streaming: the text block grows by the transcript's ids, and the codec block by the 40 frames after its
        # bos (which takes the x-vector prompt's bos position).
        assert by[(transport, True, True)] - by[(transport, True, False)] == ref_ids + 40
        # Streaming: the codec block (bos + 40 frames) summed with the first 41 text positions, in place of the
        # x-vector prompt's one text + bos position; the rest of the text trails.
        assert by[(transport, False, True)] == by[(transport, False, False)] - 1 + 41
