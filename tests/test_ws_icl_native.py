"""The WebSocket session with an ICL voice on the native engine and the tiny demo checkpoint (in process): text
streamed in fragments (mid-word too) while the talker reads it, audio out. The voice's reference has more frames
than its transcript has tokens, so the prompt holds the first target tokens and the request waits for them; the
events say voice_mode icl, and the audio is the engine's for the same utterance with its whole text."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch
from icl_helpers import write_icl_voice

from qwen_tts.engine_api import EngineSettings, SynthesisRequest
from qwen_tts.engines.native import NativeEngine
from qwen_tts.model.config import ModelConfig
from qwen_tts.model.icl_prompt import decode_icl, icl_prefill_tokens, ref_text_ids
from qwen_tts.model.model_paths import resolve_model_path
from server_helpers import in_process
from tts_server.audio_encoding import to_int16
from ws_helpers import AsgiWebSocket, done_pcm, end_paced

CAP = 30  # frames per utterance: short audio keeps it fast on CPU
PIECES = ["Hel", "lo from", " the IC", "L voice", ", word by wo", "rd, then", " a", " little more", "."]
REF_FRAMES, REF_TEXT = 16, "Hi."


async def test_a_streamed_utterance_with_an_icl_voice_on_the_native_engine(tmp_path: Path) -> None:
    model = resolve_model_path("demo", demo_dir=tmp_path / "demo-tiny")
    dim = ModelConfig.from_pretrained(model).xvector_dim
    write_icl_voice(tmp_path / "voices", "anna", dim, frames=REF_FRAMES, text=REF_TEXT, seed=3)
    engine = NativeEngine(EngineSettings(model_path=str(model), max_slots=2, max_queue=2, max_frames=256))
    submitted: list[SynthesisRequest] = []
    submit = engine.submit

    def recording(request: SynthesisRequest):
        submitted.append(request)
        return submit(request)

    engine.submit = recording
    async with in_process(engine, profiles_dir=tmp_path / "voices", max_concurrent=2, max_queue=2) as s:
        tok = engine._runner.tokenizer
        k = icl_prefill_tokens(len(ref_text_ids(tok, REF_TEXT)), REF_FRAMES)
        first_words = len(tok.text_ids("".join(PIECES[:3])))
        assert 0 < first_words < k < len(tok.text_ids("".join(PIECES)))  # the prefill needs more than the first pieces

        ws = AsgiWebSocket(s.app)
        await ws.connect()
        assert (await ws.event(timeout=30))["type"] == "session"
        start = {"type": "start", "voice": "anna", "max_new_tokens": CAP, "min_new_tokens": 10, "seed": 5}
        await ws.send_json(start)
        started = await ws.event(timeout=30)
        assert started["type"] == "started" and started["voice_mode"] == "icl", started
        for piece in PIECES[:3]:
            await ws.send_json({"type": "text", "text": piece})
        deadline = time.monotonic() + 30
        while engine.num_waiting == 0:  # submitted to the engine with the first visible text
            assert time.monotonic() < deadline, "the utterance never reached the engine"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        # Fewer than k target tokens so far: the request waits in the engine's queue for its prompt's text.
        assert (engine.num_running, engine.num_waiting) == (0, 1)
        done, seen = await end_paced(ws, PIECES[3:], 0.03)
        assert done["voice_mode"] == "icl" and done["finish_reason"] in ("eos", "budget"), done
        pcm = done_pcm(done, seen, CAP)
        await ws.close()

        # The same utterance with its whole text (streaming-text mode, the same seed and settings), straight to the
        # engine: the same codes, so the same audio; and that audio is the reference + codes decoded and cut.
        (streamed,) = [r for r in submitted if r.text_stream is not None]  # (the warm-up request aside)
        assert streamed.icl is not None and streamed.text_stream is not None and not streamed.non_streaming_text
        text = streamed.text_stream.snapshot().text
        assert text == "".join(PIECES)
        whole = dataclasses.replace(streamed, text=text, text_stream=None, return_codes=True)
        handle = submit(whole)
        audio = await handle.collect()
        codes = torch.cat(handle.codes)
        assert handle.stats.frames == done["frames"] == len(codes)
        with torch.inference_mode():
            wav = decode_icl(engine._runner._code2wav, streamed.icl.codes, codes).numpy()
        np.testing.assert_allclose(audio, wav[len(wav) - len(audio) :], rtol=1.3e-6, atol=1e-5)
        assert np.abs(pcm.astype(np.int32) - to_int16(audio).astype(np.int32)).max() <= 1
    assert engine._runner.icl.misses == 1  # one voice, its code block built once
