"""An ICL voice over HTTP on the real native engine (tiny checkpoint, in process): the audio a client receives is
exactly the reference loop's: the codes of `generate_codes` with the voice's reference codes and transcript, decoded
after the reference and cut (`decode_icl`), streamed or whole; `voice_mode: "xvector"` on the same voice gives the
x-vector loop's audio instead. The voice's reference is decoded once (the engine's per-voice cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from icl_helpers import write_icl_voice

from qwen_tts.engine_api import EngineSettings
from qwen_tts.engines.native import NativeEngine
from qwen_tts.model.icl_prompt import decode_icl
from qwen_tts.model.reference_loop import generate_codes
from qwen_tts.voices import load_profile
from server_helpers import in_process

HOP = 1920
FRAMES = 12
TEXT = "An ICL voice, heard over HTTP."


def loop_audio(model, text: str, x: torch.Tensor, ref_codes=None, ref_text=None, seed: int = 5) -> np.ndarray:
    """What the reference loop gives for a greedy request of FRAMES frames (end-of-speech held off)."""
    codes = generate_codes(model.talker, model.config, model.tokenizer, text, x, max_frames=FRAMES,
                           min_new_tokens=FRAMES + 1, greedy=True, seed=seed, ref_codes=ref_codes,
                           ref_text=ref_text)  # fmt: skip
    assert codes.shape == (FRAMES, 16)
    with torch.inference_mode():
        if ref_codes is None:
            return model.code2wav(codes.T[None])[0].numpy()
        wav = decode_icl(model.code2wav, ref_codes, codes)
    return wav[len(wav) - FRAMES * HOP :].numpy()  # a stream starts at ref * 1920 (tests/reference/README.md)


def body(**extra) -> dict:
    fixed = {"max_new_tokens": FRAMES, "min_new_tokens": FRAMES, "temperature": 0.0, "seed": 5}
    return {"speaker_id": "iris", "text": TEXT, "response_format": "f32le", **fixed, **extra}


@pytest.mark.parametrize("voice_mode", ["auto", "icl", "xvector"])
async def test_an_icl_voice_over_http_is_the_reference_loops_audio(tiny_qwen3tts, tmp_path, voice_mode) -> None:
    model = tiny_qwen3tts
    path = write_icl_voice(tmp_path / "voices", "iris", model.config.xvector_dim, frames=40, text="What iris said.")
    profile = load_profile(path)
    if voice_mode == "xvector":
        expected = loop_audio(model, TEXT, profile.x_vector)
    else:
        expected = loop_audio(model, TEXT, profile.x_vector, profile.ref_codes.long(), profile.ref_text)
    cfg = EngineSettings(model_path=str(model.path), device="cpu", dtype="float32", max_slots=2, warmup=False)
    engine = NativeEngine(cfg, model=model)
    async with in_process(engine, profiles_dir=tmp_path / "voices") as s:
        mode = "xvector" if voice_mode == "xvector" else "icl"
        streamed = await s.client.post("/synthesize/stream", json=body(voice_mode=voice_mode))
        assert streamed.status_code == 200, streamed.text
        assert streamed.headers["x-voice-mode"] == mode
        np.testing.assert_allclose(np.frombuffer(streamed.content, "<f4"), expected, rtol=1.3e-6, atol=1e-5)
        whole = await s.client.post("/synthesize", json=body(voice_mode=voice_mode, response_format="pcm"))
        assert whole.status_code == 200, whole.text
        assert whole.headers["x-voice-mode"] == mode
        pcm = np.frombuffer(whole.content, "<i2").astype(np.int32)
        assert pcm.size == FRAMES * HOP
        assert int(np.abs(pcm - np.round(np.clip(expected, -1, 1) * 32767)).max()) <= 1  # int16 rounding
        assert engine._runner.icl.misses == (0 if voice_mode == "xvector" else 1)  # the voice's reference, once
