"""The WebSocket speech session (/v1/audio/speech/stream, tts_server/realtime.py), in process over ASGI on the fake
engine (which honours text streams): utterances over one connection, barge-in, every bad message answered with an
error event in the API's shape while the session goes on, limits and deadlines, auth, capacity, and no engine work
left behind. The fake engine speaks one frame (1920 samples) per character received."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from qwen_tts.engine_api import FRAME_SAMPLES, FinishReason, SynthesisRequest
from qwen_tts.engines.fake import FakeEngine
from qwen_tts.text_stream import TextStream
from server_helpers import in_process, metric, write_voice
from ws_helpers import AsgiWebSocket, WsClosed

DIM = 16
KEY = "ws-test-key-123"


@pytest.fixture
def voices(tmp_path: Path) -> Path:
    root = tmp_path / "voices"
    write_voice(root, "alice", DIM, seed=1)
    return root


def assert_error(event: dict[str, Any], code: str, param: str | None = None, fragment: str = "") -> dict[str, Any]:
    """An error event in the API's one shape; its `error`."""
    assert event["type"] == "error", event
    assert set(event) - {"utterance_id", "retry_after"} == {"type", "error", "request_id"}, event
    assert set(event["error"]) == {"message", "type", "param", "code"}, event
    assert event["request_id"], event
    error = event["error"]
    assert error["code"] == code, event
    assert error["param"] == param, event
    assert fragment in error["message"], event
    return error


async def open_session(app: Any, **kwargs: Any) -> tuple[AsgiWebSocket, dict[str, Any]]:
    ws = AsgiWebSocket(app, **kwargs)
    await ws.connect()
    session = await ws.event()
    assert session["type"] == "session"
    return ws, session


async def speak(ws: AsgiWebSocket, fragments: list[str], **start: Any) -> tuple[dict, list[dict], bytes]:
    """One utterance: start, the fragments, end; its done event, audio events and audio bytes."""
    await ws.send_json({"type": "start", "voice": "alice", **start})
    started = await ws.event()
    assert started["type"] == "started", started
    for fragment in fragments:
        await ws.send_json({"type": "text", "text": fragment})
    await ws.send_json({"type": "end"})
    done, seen = await ws.until("done")
    assert done["utterance_id"] == started["utterance_id"]
    events, data = audio_of(seen, started["utterance_id"])
    return done, events, data


def audio_of(seen: list, utterance_id: str) -> tuple[list[dict], bytes]:
    """The audio events of an utterance and their binary frames, checking each frame follows its event."""
    events, data = [], b""
    expect: dict | None = None
    for item in seen:
        if isinstance(item, bytes):
            assert expect is not None and len(item) == expect["bytes"], "a binary frame without its audio event"
            data += item
            expect = None
        elif item.get("type") == "audio" and item["utterance_id"] == utterance_id:
            assert expect is None, "two audio events in a row"
            events.append(item)
            expect = item
    assert expect is None
    return events, data


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


# --- the fake engine's streaming-text mode ---------------------------------------------------------------------------
async def test_the_fake_engine_speaks_the_text_as_it_arrives_and_waits_for_more() -> None:
    engine = FakeEngine(frame_delay=0.001)
    await engine.start()
    stream = TextStream()
    handle = engine.submit(SynthesisRequest(text="", xvector=torch.zeros(DIM), text_stream=stream,
                                            non_streaming_text=False))  # fmt: skip
    chunks: list[np.ndarray] = []

    async def consume() -> None:
        async for chunk in handle:
            chunks.append(chunk)

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.05)
    assert chunks == [] and engine.num_running == 1  # held, waiting for text
    stream.push("Hello")
    await wait_for(lambda: sum(len(c) for c in chunks) == 5 * FRAME_SAMPLES)
    await asyncio.sleep(0.05)
    assert sum(len(c) for c in chunks) == 5 * FRAME_SAMPLES and not task.done()  # no more than the text so far
    stream.push(", world.")
    stream.end()
    await asyncio.wait_for(task, 5)
    assert sum(len(c) for c in chunks) == 13 * FRAME_SAMPLES
    assert handle.stats.finish_reason is FinishReason.EOS and engine.num_running == 0
    with pytest.raises(ValueError, match="non_streaming_text=False"):
        engine.submit(SynthesisRequest(text="", xvector=torch.zeros(DIM), text_stream=TextStream()))
    await engine.stop()


# --- a session -----------------------------------------------------------------------------------------------------
async def test_three_utterances_over_one_connection_in_three_formats(voices: Path) -> None:
    engine = FakeEngine(frame_delay=0.001)
    async with in_process(engine, profiles_dir=voices) as s:
        ws, session = await open_session(s.app)
        assert session["sample_rate"] == 24000 and set(session["formats"]) == {"pcm", "f32le", "opus"}
        assert session["limits"]["max_text_chars"] == 4096
        ids = []
        for fmt, fragments in (("pcm", ["Hel", "lo ", "there."]), ("f32le", ["Good", "bye."]), ("opus", ["Opus!"])):
            done, events, data = await speak(ws, fragments, response_format=fmt, seed=3)
            chars = sum(map(len, fragments))
            assert done["finish_reason"] == "eos" and done["text_chars"] == chars and done["frames"] == chars
            assert done["samples"] == chars * FRAME_SAMPLES == sum(e["samples"] for e in events)
            assert [e["offset"] for e in events] == list(np.cumsum([0] + [e["samples"] for e in events[:-1]]))
            assert done["time_to_first_audio"] is not None and done["time_to_first_audio"] >= 0
            if fmt == "pcm":
                pcm = np.frombuffer(data, "<i2").astype(np.float32) / 32767
                expected = engine.tone(engine.submitted[-1], 0, chars)
                np.testing.assert_allclose(pcm, expected, atol=1.5 / 32767)  # the engine's samples, as int16
            elif fmt == "f32le":
                np.testing.assert_array_equal(np.frombuffer(data, "<f4"), engine.tone(engine.submitted[-1], 0, chars))
            else:
                assert data[:4] == b"OggS" and b"OpusHead" in data[:100]
            ids.append(done["utterance_id"])
        assert len(set(ids)) == 3 and all(i.startswith(session["session_id"]) for i in ids)
        # Each utterance was one streaming-text engine request, its text all that was sent.
        assert [r.text_stream.snapshot().text for r in engine.submitted] == ["Hello there.", "Goodbye.", "Opus!"]
        assert all(r.non_streaming_text is False for r in engine.submitted)
        await ws.send_json({"type": "close"})
        with pytest.raises(WsClosed) as closed:
            await ws.next()
        assert closed.value.message["code"] == 1000
        await asyncio.wait_for(ws.task, 5)
        assert engine.num_running == 0 and s.runtime.admission.active == 0
        page = (await s.client.get("/metrics")).text
        assert metric(page, 'tts_ws_utterances_total{finish_reason="eos"}') == 3
        assert metric(page, 'tts_ws_session_ends_total{reason="client_close"}') == 1
        assert metric(page, "tts_ws_sessions") == 0
        assert metric(page, "tts_ws_text_chars_total") == 25
        assert metric(page, 'tts_syntheses_total{outcome="ok"}') == 3


async def test_initial_text_in_start_and_an_empty_utterance(voices: Path) -> None:
    engine = FakeEngine()
    async with in_process(engine, profiles_dir=voices) as s:
        ws, _ = await open_session(s.app)
        done, _, data = await speak(ws, [" more."], text="Some")
        assert done["text_chars"] == 10 and len(data) == 10 * FRAME_SAMPLES * 2
        # Whitespace only: nothing to say, so no engine work at all, and the slot is given back.
        done, events, _ = await speak(ws, ["  ", "\n"])
        assert done["finish_reason"] == "empty" and done["samples"] == 0 and events == []
        assert len(engine.submitted) == 1 and s.runtime.admission.active == 0
        await ws.close()


async def test_barge_in_stops_the_audio_within_a_step_and_the_next_utterance_starts_at_once(voices: Path) -> None:
    engine = FakeEngine(frame_delay=0.02, chunk_frames=2)  # 40 ms a chunk: 400 frames would take 8 s
    async with in_process(engine, profiles_dir=voices) as s:
        ws, _ = await open_session(s.app)
        await ws.send_json({"type": "start", "voice": "alice"})
        first = (await ws.event())["utterance_id"]
        await ws.send_json({"type": "text", "text": "x" * 400})
        event = await ws.event()
        assert event["type"] == "audio" and event["utterance_id"] == first
        assert len(await ws.next()) == event["bytes"]  # its binary frame
        cancelled_at = time.monotonic()
        await ws.send_json({"type": "cancel"})
        await ws.send_json({"type": "start", "voice": "alice"})  # right behind the cancel
        done, seen = await ws.until("done")
        assert done["utterance_id"] == first and done["finish_reason"] == "cancelled"
        assert time.monotonic() - cancelled_at < 0.5
        events, _ = audio_of(seen, first)
        assert done["samples"] == sum(e["samples"] for e in [event, *events]) < 400 * FRAME_SAMPLES
        assert engine.cancelled == [first]
        started = await ws.event()  # the next utterance, with nothing of the cancelled one in between
        assert started["type"] == "started" and started["utterance_id"] != first
        await wait_for(lambda: engine.num_running == 0)  # the cancelled request left its row within a step
        await wait_for(lambda: s.runtime.admission.active == 1)  # its slot is given back once the engine let go
        await ws.send_json({"type": "text", "text": "Hi."})
        await ws.send_json({"type": "end"})
        done, seen = await ws.until("done")
        assert done["finish_reason"] == "eos" and done["samples"] == 3 * FRAME_SAMPLES
        assert all(not isinstance(x, dict) or x.get("utterance_id") != first for x in seen)
        await ws.close()
        page = (await s.client.get("/metrics")).text
        assert metric(page, 'tts_ws_utterances_total{finish_reason="cancelled"}') == 1
        assert metric(page, 'tts_syntheses_total{outcome="cancelled"}') == 1


# --- bad messages: an error event each, and the session goes on --------------------------------------------------------
BAD_MESSAGES = [
    # (name, messages before, the bad message, code, param, message fragment)
    ("unknown type", [], {"type": "speak"}, "unknown_message_type", "type", '"speak" is not a message type'),
    ("no type", [], {"text": "hi"}, "unknown_message_type", "type", "is not a message type"),
    ("text before start", [], {"type": "text", "text": "hi"}, "no_utterance", "type", "text before start"),
    ("end before start", [], {"type": "end"}, "no_utterance", "type", "end before start"),
    ("oversize fragment", ["start"], {"type": "text", "text": "a" * 65}, "fragment_too_long", "text",
     "65 characters, the limit for one fragment is 64"),
    ("oversize start text", [], {"type": "start", "voice": "alice", "text": "a" * 65}, "fragment_too_long", "text",
     "limit for one fragment is 64"),
    ("wrong voice", [], {"type": "start", "voice": "nobody"}, "unknown_speaker", "voice", "unknown speaker 'nobody'"),
    ("bad voice id", [], {"type": "start", "voice": "../alice"}, "invalid_speaker_id", "voice", "speaker id must be"),
    ("unknown field", [], {"type": "start", "voice": "alice", "temprature": 1}, "invalid_value", "temprature",
     "unknown field (allowed: "),
    ("wrong type", [], {"type": "start", "voice": "alice", "temperature": "0.5"}, "invalid_value", "temperature",
     "valid number"),
    ("bad language", [], {"type": "start", "voice": "alice", "language": "Klingon"}, "unsupported_language",
     "language", "'Klingon' is not supported"),
    ("bad format", [], {"type": "start", "voice": "alice", "response_format": "mp3"}, "invalid_value",
     "response_format", "Input should be"),
    ("speed", [], {"type": "start", "voice": "alice", "speed": 1.5}, "invalid_value", "speed", "only 1.0"),
    ("frame cap", [], {"type": "start", "voice": "alice", "max_new_tokens": 5000}, "invalid_value", "max_new_tokens",
     "limit of 2048"),
    ("start during start", ["start"], {"type": "start", "voice": "alice"}, "utterance_in_progress", "type",
     "is in progress"),
    ("text after end", ["start", "end-later"], {"type": "text", "text": "more"}, "utterance_ended", "type",
     "has ended its text"),
    ("malformed json", [], '{"type": "text", "text": ', "invalid_json", None, "not valid JSON"),
    ("json array", [], "[1, 2]", "invalid_message", None, "JSON object"),
    ("binary frame", [], b"\x00\x01binary", "binary_message", None, "binary frames are not accepted"),
    ("message too large", [], {"type": "text", "text": " " * 2100}, "message_too_large", None,
     "larger than the limit of 2048 bytes (TTS_WS_MAX_MESSAGE_BYTES)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("before", "message", "code", "param", "fragment"),
    [case[1:] for case in BAD_MESSAGES],
    ids=[case[0] for case in BAD_MESSAGES],
)
async def test_a_bad_message_gets_an_error_event_and_the_session_goes_on(
    voices: Path, before: list[str], message: Any, code: str, param: str | None, fragment: str
) -> None:
    engine = FakeEngine(frame_delay=0.001)
    async with in_process(engine, profiles_dir=voices, ws_max_fragment_chars=64, ws_max_message_bytes=2048) as s:
        ws, session = await open_session(s.app)
        if "start" in before:
            await ws.send_json({"type": "start", "voice": "alice", "text": "Hi"})
            assert (await ws.event())["type"] == "started"
        if "end-later" in before:
            await ws.send_json({"type": "end"})  # its audio is still on its way when the bad message comes
        if isinstance(message, bytes):
            await ws.send_bytes(message)
        elif isinstance(message, str):
            await ws.send_text(message)
        else:
            await ws.send_json(message)
        error_event, _ = await ws.until("error")
        assert_error(error_event, code, param, fragment)
        assert error_event["request_id"] == session["session_id"]
        if before:
            await ws.send_json({"type": "end"}) if "end-later" not in before else None
            done, _ = await ws.until("done")
            assert done["finish_reason"] == "eos" and done["samples"] == 2 * FRAME_SAMPLES  # "Hi" only
        done, _, data = await speak(ws, ["Still ", "here."])
        assert done["finish_reason"] == "eos" and len(data) == 11 * FRAME_SAMPLES * 2
        await ws.close()
        assert engine.num_running == 0 and s.runtime.admission.active == 0
        page = (await s.client.get("/metrics")).text
        assert metric(page, f'tts_ws_errors_total{{code="{code}"}}') == 1


async def test_text_beyond_the_utterance_limit_is_refused_and_what_came_before_is_spoken(voices: Path) -> None:
    async with in_process(FakeEngine(), profiles_dir=voices, max_text_chars=20) as s:
        ws, _ = await open_session(s.app)
        await ws.send_json({"type": "start", "voice": "alice", "text": "a" * 15})
        await ws.event()
        await ws.send_json({"type": "text", "text": "b" * 6})
        error, _ = await ws.until("error")
        assert_error(error, "text_too_long", "text", "would have 21 characters, the limit is 20 (TTS_MAX_TEXT_CHARS)")
        assert error["utterance_id"].endswith("-1")
        await ws.send_json({"type": "text", "text": "c" * 5})  # up to the limit is fine
        await ws.send_json({"type": "end"})
        done, _ = await ws.until("done")
        assert done["text_chars"] == 20 and done["samples"] == 20 * FRAME_SAMPLES
        await ws.close()


async def test_a_flood_over_the_text_rate_is_refused_and_the_session_goes_on(voices: Path) -> None:
    engine = FakeEngine(frame_delay=0.001)
    # 50 characters a second, a burst of 2 s (100); the fragment limit (10) is below it.
    async with in_process(engine, profiles_dir=voices, ws_text_chars_per_s=50, ws_max_fragment_chars=10) as s:
        ws, _ = await open_session(s.app)
        await ws.send_json({"type": "start", "voice": "alice"})
        await ws.event()
        for _ in range(20):  # 200 characters at once
            await ws.send_json({"type": "text", "text": "w" * 10})
        await ws.send_json({"type": "end"})
        done, seen = await ws.until("done")
        errors = [e for e in seen if isinstance(e, dict) and e["type"] == "error"]
        assert 9 <= len(errors) <= 11  # about the half beyond the burst
        for e in errors:
            assert_error(e, "rate_limited", "text", "more than 50 characters a second (TTS_WS_TEXT_CHARS_PER_S)")
        assert done["text_chars"] == 10 * (20 - len(errors)) and done["finish_reason"] == "eos"
        await asyncio.sleep(0.3)  # the bucket refills: the next utterance is taken whole
        done, _, _ = await speak(ws, ["Fine."])
        assert done["text_chars"] == 5
        await ws.close()


async def test_a_flood_of_messages_is_refused_past_the_message_rate(voices: Path) -> None:
    async with in_process(FakeEngine(), profiles_dir=voices, ws_messages_per_s=10) as s:
        ws, _ = await open_session(s.app)
        for _ in range(30):
            await ws.send_json({"type": "cancel"})  # harmless with no utterance: only the rate answers
        errors = [await ws.event() for _ in range(10)]
        for e in errors:
            assert_error(e, "rate_limited", None, "more than 10 messages a second (TTS_WS_MESSAGES_PER_S)")
        with pytest.raises(asyncio.TimeoutError):
            await ws.next(timeout=0.3)  # 20 taken (the burst), 10 refused
        await ws.close()


# --- limits and deadlines ----------------------------------------------------------------------------------------------
async def test_a_client_that_does_not_read_its_audio_is_cut_at_the_send_deadline(voices: Path) -> None:
    engine = FakeEngine(frame_delay=0.001)
    async with in_process(engine, profiles_dir=voices, ws_send_timeout=0.3) as s:
        ws, _ = await open_session(s.app)
        await ws.send_json({"type": "start", "voice": "alice", "text": "x" * 500})
        await ws.event()
        ws.reading.clear()  # the client stops reading: the app's next send waits
        t0 = time.monotonic()
        await asyncio.wait_for(ws.task, 5)  # the session ends by itself
        assert 0.3 <= time.monotonic() - t0 < 2.0
        assert engine.cancelled == [engine.submitted[0].request_id]
        await wait_for(lambda: engine.num_running == 0)
        assert s.runtime.admission.active == 0
        page = (await s.client.get("/metrics")).text
        assert metric(page, 'tts_ws_session_ends_total{reason="slow_reader"}') == 1
        assert metric(page, 'tts_syntheses_total{outcome="disconnected"}') == 1


async def test_a_disconnect_mid_utterance_leaves_no_engine_work_running(voices: Path) -> None:
    engine = FakeEngine(frame_delay=0.02)
    async with in_process(engine, profiles_dir=voices) as s:
        ws, _ = await open_session(s.app)
        await ws.send_json({"type": "start", "voice": "alice", "text": "x" * 300})
        await ws.event()
        assert (await ws.event())["type"] == "audio"
        assert isinstance(await ws.next(), bytes)
        assert engine.num_running == 1
        await ws.disconnect()
        await asyncio.wait_for(ws.task, 5)
        await wait_for(lambda: engine.num_running == 0, timeout=1.0)
        assert engine.cancelled == [engine.submitted[0].request_id] and s.runtime.admission.active == 0
        # An utterance still waiting for its first text holds a slot but no engine row: given back too.
        ws, _ = await open_session(s.app)
        await ws.send_json({"type": "start", "voice": "alice"})
        await ws.event()
        assert s.runtime.admission.active == 1
        await ws.disconnect()
        await asyncio.wait_for(ws.task, 5)
        assert s.runtime.admission.active == 0 and len(engine.submitted) == 1
        page = (await s.client.get("/metrics")).text
        assert metric(page, 'tts_ws_utterances_total{finish_reason="disconnected"}') == 2
        assert metric(page, "tts_ws_sessions") == 0


async def test_an_utterance_waiting_too_long_for_text_is_cancelled_and_the_session_stays(voices: Path) -> None:
    engine = FakeEngine()
    async with in_process(engine, profiles_dir=voices, ws_text_timeout=0.3) as s:
        ws, _ = await open_session(s.app)
        await ws.send_json({"type": "start", "voice": "alice", "text": "Wait"})
        utterance = (await ws.event())["utterance_id"]
        error, _ = await ws.until("error", timeout=3)
        assert_error(error, "text_timeout", None, "no text for 0.3 s (TTS_WS_TEXT_TIMEOUT)")
        done, _ = await ws.until("done")
        assert done["utterance_id"] == utterance and done["finish_reason"] == "timeout"
        assert engine.cancelled == [utterance]
        await wait_for(lambda: engine.num_running == 0)
        done, _, _ = await speak(ws, ["Quick."])
        assert done["finish_reason"] == "eos"
        await ws.close()


async def test_an_idle_session_is_closed(voices: Path) -> None:
    async with in_process(FakeEngine(), profiles_dir=voices, ws_idle_timeout=0.3) as s:
        ws, _ = await open_session(s.app)
        error = await ws.event(timeout=3)
        assert_error(error, "idle_timeout", None, "no message for 0.3 s (TTS_WS_IDLE_TIMEOUT)")
        with pytest.raises(WsClosed) as closed:
            await ws.next()
        assert closed.value.message["code"] == 1000
        await asyncio.wait_for(ws.task, 5)


async def test_the_utterances_per_connection_are_limited(voices: Path) -> None:
    async with in_process(FakeEngine(), profiles_dir=voices, ws_max_utterances=2) as s:
        ws, _ = await open_session(s.app)
        for _ in range(2):
            await speak(ws, ["Ok."])
        await ws.send_json({"type": "start", "voice": "alice"})
        assert_error(await ws.event(), "utterance_limit", None, "the limit is 2 (TTS_WS_MAX_UTTERANCES)")
        with pytest.raises(WsClosed) as closed:
            await ws.next()
        assert closed.value.message["code"] == 1008


async def test_sessions_per_client_and_in_all_are_capped_in_the_error_shape(voices: Path) -> None:
    async with in_process(FakeEngine(), profiles_dir=voices, ws_max_sessions_per_client=1, ws_max_sessions=2) as s:
        first, _ = await open_session(s.app)
        with pytest.raises(WsClosed) as refused:
            await AsgiWebSocket(s.app).connect()
        denial = refused.value.message
        assert denial["status"] == 429 and (b"retry-after", b"1") in denial["headers"]
        assert denial["body"]["error"]["code"] == "too_many_sessions"
        assert "TTS_WS_MAX_SESSIONS_PER_CLIENT" in denial["body"]["error"]["message"]
        second, _ = await open_session(s.app, client=("10.0.0.2", 1))
        with pytest.raises(WsClosed) as refused:
            await AsgiWebSocket(s.app, client=("10.0.0.3", 1)).connect()
        assert refused.value.message["status"] == 503
        await first.close()
        third, _ = await open_session(s.app)  # a closed session frees its place
        for ws in (second, third):
            await ws.close()


async def test_a_capacity_refusal_is_an_error_event_with_a_retry_hint(voices: Path) -> None:
    engine = FakeEngine(max_slots=1, max_queue=0)
    async with in_process(engine, profiles_dir=voices, max_concurrent=1, max_queue=0, retry_after=2) as s:
        a, _ = await open_session(s.app)
        b, _ = await open_session(s.app, client=("10.0.0.2", 1))
        await a.send_json({"type": "start", "voice": "alice"})
        assert (await a.event())["type"] == "started"
        await b.send_json({"type": "start", "voice": "alice"})
        refused = await b.event()
        assert_error(refused, "server_overloaded", None, "server is at capacity (1 requests in progress)")
        assert refused["retry_after"] == 2 and refused["error"]["type"] == "rate_limit_error"
        await a.send_json({"type": "text", "text": "Done."})
        await a.send_json({"type": "end"})
        await a.until("done")
        done, _, _ = await speak(b, ["Now", " me."])  # the same connection, once there is room
        assert done["finish_reason"] == "eos"
        for ws in (a, b):
            await ws.close()
        page = (await s.client.get("/metrics")).text
        assert metric(page, 'tts_rejections_total{reason="queue_full"}') == 1


# --- auth --------------------------------------------------------------------------------------------------------------
async def test_a_key_is_required_by_header_or_first_message(voices: Path) -> None:
    async with in_process(FakeEngine(), profiles_dir=voices, api_keys=[KEY], header_timeout=0.5) as s:
        # A wrong Authorization header: the handshake is refused in the error shape.
        with pytest.raises(WsClosed) as refused:
            await AsgiWebSocket(s.app, headers=[(b"authorization", b"Bearer wrong-key-0000")]).connect()
        assert refused.value.message["status"] == 401
        assert refused.value.message["body"]["error"]["code"] == "invalid_api_key"
        # The right header: a session at once.
        ws, _ = await open_session(s.app, headers=[(b"authorization", f"Bearer {KEY}".encode())])
        done, _, _ = await speak(ws, ["Keyed."])
        assert done["finish_reason"] == "eos"
        await ws.close()
        # No header (a browser): the first message carries the key.
        ws = AsgiWebSocket(s.app)
        await ws.connect()
        await ws.send_json({"type": "auth", "token": KEY})
        assert (await ws.event())["type"] == "session"
        done, _, _ = await speak(ws, ["Typed."])
        assert done["finish_reason"] == "eos"
        await ws.close()
        # No header and a wrong key, a message other than auth, or nothing at all: an error event, then the close.
        for first in ({"type": "auth", "token": "not-the-key"}, {"type": "start", "voice": "alice"}, None):
            ws = AsgiWebSocket(s.app)
            await ws.connect()
            if first is not None:
                await ws.send_json(first)
            error = await ws.event(timeout=3)
            assert error["error"]["type"] == "authentication_error" and error["error"]["code"] == "invalid_api_key"
            with pytest.raises(WsClosed) as closed:
                await ws.next()
            assert closed.value.message["code"] == 1008
            await asyncio.wait_for(ws.task, 5)
        assert s.runtime.admission.active == 0
        page = (await s.client.get("/metrics")).text
        assert metric(page, 'tts_ws_session_ends_total{reason="auth"}') == 3


async def test_an_unknown_websocket_path_is_still_refused(voices: Path) -> None:
    async with in_process(FakeEngine(), profiles_dir=voices) as s:
        with pytest.raises(WsClosed) as refused:
            await AsgiWebSocket(s.app, path="/v1/other").connect()
        assert refused.value.message["status"] == 404
