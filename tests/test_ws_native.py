"""The WebSocket session end to end on the native engine with the tiny demo checkpoint (in process): text streamed
in word pieces while the talker reads it token by token (streaming-text mode), audio out, and a barge-in that leaves
the engine idle. Needs the native engine's text_stream support (qwen_tts/engines/native)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from qwen_tts.engine_api import EngineSettings
from qwen_tts.engines.native import NativeEngine
from qwen_tts.model.model_paths import resolve_model_path
from qwen_tts.voices import ensure_demo_voice
from server_helpers import in_process
from ws_helpers import AsgiWebSocket, done_pcm, end_paced

CAP = 40  # frames per utterance: short audio keeps it fast on CPU
PIECES = ["Hello", " from", " the", " demo", " voice", ",", " word", " by", " word", "."]


async def test_a_streamed_utterance_and_a_barge_in_on_the_native_engine(tmp_path: Path) -> None:
    model = resolve_model_path("demo", demo_dir=tmp_path / "demo-tiny")
    ensure_demo_voice(tmp_path / "voices", model)
    engine = NativeEngine(EngineSettings(model_path=str(model), max_slots=2, max_queue=2, max_frames=256))
    async with in_process(engine, profiles_dir=tmp_path / "voices", max_concurrent=2, max_queue=2) as s:
        ws = AsgiWebSocket(s.app)
        await ws.connect()
        assert (await ws.event(timeout=30))["type"] == "session"
        await ws.send_json({"type": "start", "voice": "demo", "max_new_tokens": CAP, "min_new_tokens": 10, "seed": 5})
        assert (await ws.event(timeout=30))["type"] == "started"
        await ws.send_json({"type": "text", "text": PIECES[0]})
        # The text has not ended: the engine holds the row for the next text token instead of finishing on what it
        # has (an engine that ignored the stream would be done with "Hello" long before this wait is over).
        seen: list = []
        with contextlib.suppress(asyncio.TimeoutError):
            while True:
                seen.append(await ws.next(timeout=3.0))
        assert not [x for x in seen if isinstance(x, dict) and x["type"] in ("done", "error")], seen
        # "Hello" may still grow ("Hellos"): no token of it is committed yet, so the request waits in the engine's
        # queue for its first token rather than holding a slot.
        assert (engine.num_running, engine.num_waiting) == (0, 1)
        done, rest = await end_paced(ws, PIECES[1:], 0.05)
        seen += rest
        assert done["finish_reason"] in ("eos", "budget"), done
        done_pcm(done, seen, CAP)
        assert done["text_chars"] == sum(map(len, PIECES))

        # Barge-in while the text is still open: the engine request is cancelled and its row freed.
        await ws.send_json({"type": "start", "voice": "demo", "max_new_tokens": 200, "text": "A long answer"})
        await ws.event(timeout=30)
        await ws.send_json({"type": "text", "text": " that goes on and on"})
        await ws.until("audio", timeout=120)
        t0 = time.monotonic()
        await ws.send_json({"type": "cancel"})
        done, _ = await ws.until("done", timeout=30)
        assert done["finish_reason"] == "cancelled" and done["frames"] < 200
        while engine.num_running or s.runtime.admission.active:
            assert time.monotonic() - t0 < 10, "the cancelled request is still running"
            await asyncio.sleep(0.01)
        await ws.close()
