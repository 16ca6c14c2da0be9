"""Long input (tts_server/long_text.py): sentence splitting, pieces synthesized in order with one seed, the next
piece submitted while the current one decodes, click-free joins, on the fake engine (exact samples) and on the
native engine with the tiny demo checkpoint (the real decoder)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from test_server_errors import _call_and_disconnect, _cut_short

from qwen_tts.engine_api import FRAME_SAMPLES, EngineSettings, FinishReason, RequestHandle, SynthesisRequest
from qwen_tts.engines.fake import FakeEngine
from qwen_tts.engines.native import NativeEngine
from qwen_tts.model.model_paths import resolve_model_path
from qwen_tts.voices import ensure_demo_voice
from server_helpers import demo_server, in_process, write_voice
from tts_server.long_text import FADE_SAMPLES, MIN_PIECE_BYTES, PIECE_BYTES, PieceChain, split_text

_EN_SENTENCES = [
    "The lighthouse keeper climbed the stairs at dusk.",
    "Dr. Lane had left a note on the table, folded twice.",
    "Was the storm coming from the west, or from the sea?",
    "Nobody in the village could say for sure!",
    "She counted 3.5 miles of coastline before the fog rolled in.",
    "Each evening the lamp turned, and the ships answered with their horns; the rhythm never changed.",
]
_ZH_SENTENCES = [
    "灯塔看守人在黄昏时爬上了楼梯。",
    "桌子上放着一张对折了两次的纸条。",
    "暴风雨是从西边来的，还是从海上来的？",
    "村子里没有人能说得清楚！",
    "雾气涌来之前，她数了三公里半的海岸线。",
    "每天晚上灯都会转动，船只用汽笛回应；这个节奏从未改变。",
]


def english_text(chars: int = 4000) -> str:
    paragraphs, out, i = [], [], 0
    while sum(len(p) + 2 for p in paragraphs) + sum(len(s) + 1 for s in out) < chars:
        out.append(_EN_SENTENCES[i % len(_EN_SENTENCES)])
        i += 1
        if i % 7 == 0:
            paragraphs.append(" ".join(out))
            out = []
    paragraphs.append(" ".join(out))
    return "\n\n".join(p for p in paragraphs if p)[:chars].rstrip()


def chinese_text(chars: int = 4000) -> str:
    paragraphs, i = [], 0
    while sum(len(p) + 1 for p in paragraphs) < chars:
        paragraphs.append("".join(_ZH_SENTENCES[(i + k) % len(_ZH_SENTENCES)] for k in range(9)))
        i += 1
    return "\n".join(paragraphs)[:chars]


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


# --- splitting --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "language"), [(english_text(), "english"), (chinese_text(), "chinese")])
def test_pieces_keep_every_character_in_order_within_the_limit(text: str, language: str) -> None:
    assert len(text) >= 3990
    pieces = split_text(text, language)
    assert len(pieces) > 5
    assert all(0 < len(p.encode()) <= PIECE_BYTES for p in pieces)
    assert _squash("".join(pieces)) == _squash(text)


def test_pieces_end_at_sentence_ends() -> None:
    for text, language, ends in [
        (english_text(), "english", ".?!"),
        (chinese_text(), "chinese", "。？！"),
        (chinese_text(), "auto", "。？！"),
    ]:
        pieces = split_text(text, language)
        assert all(p[-1] in ends for p in pieces[:-1]), [p[-12:] for p in pieces if p[-1] not in ends]


def test_abbreviations_and_decimals_do_not_end_a_sentence() -> None:
    pieces = split_text("Dr. Lane walked 3.5 miles. " * 3 + "x" * 10, "english", limit=60)
    assert pieces[0] == "Dr. Lane walked 3.5 miles. Dr. Lane walked 3.5 miles."


def test_a_sentence_longer_than_a_piece_is_cut_at_clauses_then_spaces() -> None:
    long_sentence = ", ".join(f"clause number {i} goes here" for i in range(30)) + "."
    pieces = split_text(long_sentence, "english", limit=100)
    assert all(len(p) <= 100 for p in pieces)
    assert all(p.endswith(",") for p in pieces[:-1])
    words = " ".join(["word"] * 100)
    assert all(len(p) <= 30 for p in split_text(words, "english", limit=30))
    assert split_text("字" * 250, "chinese", limit=300) == ["字" * 100, "字" * 100, "字" * 50]


def test_short_text_is_one_piece() -> None:
    assert split_text("Hello there. How are you?", "english") == ["Hello there. How are you?"]


# --- the chain on the fake engine: exact samples -------------------------------------------------------------
def _spy_submissions(engine) -> tuple[list[RequestHandle], list[bool]]:
    """Record every submitted handle, and for each one after the first whether the one before it was still
    running (had not finished) when it was submitted."""
    handles: list[RequestHandle] = []
    overlapped: list[bool] = []
    submit = engine.submit

    def spy(request: SynthesisRequest) -> RequestHandle:
        if handles:
            overlapped.append(handles[-1].stats.finish_reason is None)
        handle = submit(request)
        handles.append(handle)
        return handle

    engine.submit = spy
    return handles, overlapped


def _next_piece_gate(spied: dict[str, list], pieces: int):
    """A fault hook (the engine's loop calls it at the top of each busy turn) that keeps the piece the chain is on
    from finishing before the chain has had the chance to submit the next: once that piece has produced audio and
    every piece before it has finished (when the chain submits the next), the loop waits until the next is submitted
    or 5 s pass. The overlap is then the chain's doing, not the event loop's luck on a busy machine; a chain that
    waited for the piece's end would find it still running after the 5 s and the overlap check fails."""

    def gate() -> None:
        handles = spied.get("handles") or []
        k = len(handles) - 1
        if k < 0 or k + 1 >= pieces:
            return
        if handles[k].stats.first_audio_at is None or handles[k].stats.finish_reason is not None:
            return
        if any(h.stats.finish_reason is None for h in handles[:k]):
            return
        deadline = time.monotonic() + 5.0
        while len(handles) == k + 1 and time.monotonic() < deadline:
            time.sleep(0.001)

    return gate


# Pieces of one length (8 frames: more than one chunk): each piece then ends after the one before it, so the
# chain's cap of two pieces in the engine never delays a submission past the end of the piece before. An engine
# capped at 8 frames a request gives each piece exactly 8 with this (max_new_tokens caps the whole request).
_EIGHT = {"min_new_tokens": 8}


def _expected_fake(engine: FakeEngine, requests: list[SynthesisRequest]) -> np.ndarray:
    ramp = np.arange(FADE_SAMPLES, dtype=np.float32) / FADE_SAMPLES
    parts = []
    for i, req in enumerate(requests):
        x = engine.tone(req, 0, engine.frames_for(req)).copy()
        if i > 0:
            x[:FADE_SAMPLES] *= ramp
        if i < len(requests) - 1:
            x[-FADE_SAMPLES:] *= ramp[::-1]
        parts.append(x)
    return np.concatenate(parts)


@pytest.mark.parametrize("text_of", [english_text, chinese_text])
async def test_a_4000_character_text_streams_its_pieces_in_order_with_one_seed(text_of, tmp_path: Path) -> None:
    text = text_of()
    engine = FakeEngine(frames_per_char=0.05, frame_delay=0.01, max_frames=8)
    write_voice(tmp_path, "alice", 16)
    handles, overlapped = _spy_submissions(engine)
    async with in_process(engine, profiles_dir=tmp_path) as s:
        body = {"speaker_id": "alice", "text": text, "seed": 11, **_EIGHT}
        async with s.client.stream("POST", "/synthesize/stream", json=body) as r:
            assert r.status_code == 200, await r.aread()
            got = np.frombuffer(await r.aread(), "<f4")
    pieces = split_text(text, "auto")
    assert [h.request.text for h in handles] == pieces
    assert {h.request.seed for h in handles} == {11}
    assert all(overlapped) and len(overlapped) == len(pieces) - 1
    expected = _expected_fake(engine, [h.request for h in handles])
    np.testing.assert_allclose(got, expected, atol=1e-6)


async def test_openai_speech_takes_the_4096_character_limit(tmp_path: Path) -> None:
    engine = FakeEngine(frames_per_char=0.01)
    write_voice(tmp_path, "alice", 16)
    async with in_process(engine, profiles_dir=tmp_path) as s:
        text = english_text(4096)
        body = {"model": "m", "input": text, "voice": "alice", "response_format": "pcm"}
        r = await s.client.post("/v1/audio/speech", json=body)
        assert r.status_code == 200, r.text
        assert len(engine.submitted) == len(split_text(text)) > 10
        r = await s.client.post("/v1/audio/speech", json={**body, "input": text + " more"})
        assert r.status_code == 422 and "the limit is 4096" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/synthesize", "/synthesize/stream"])
async def test_a_client_leaving_mid_chain_cancels_every_piece(path: str, tmp_path: Path) -> None:
    engine = FakeEngine(frames_per_char=0.1, frame_delay=0.01)
    write_voice(tmp_path, "alice", 16)
    text = english_text(2000)
    async with in_process(engine, profiles_dir=tmp_path) as s:
        body = {"speaker_id": "alice", "text": text}
        await _call_and_disconnect(s.app, path, body, disconnect_after=0.15)
        submitted = len(engine.submitted)
        await asyncio.sleep(0.3)  # a chain still running would submit its next piece by now
        assert len(engine.submitted) == submitted < len(split_text(text))
        assert engine.num_running == 0 and s.runtime.admission.active == 0
        assert set(engine.cancelled) <= {r.request_id for r in engine.submitted} and engine.cancelled


async def test_a_failing_piece_cuts_the_stream_and_stops_the_chain(tmp_path: Path) -> None:
    engine = FakeEngine(frames_per_char=0.02, frame_delay=0.001)
    write_voice(tmp_path, "alice", 16)
    paragraphs = english_text(3000).split("\n\n")
    paragraphs[2] = "[fail] " + paragraphs[2]
    text = "\n\n".join(paragraphs)
    async with in_process(engine, profiles_dir=tmp_path) as s:
        sent = await _call_and_disconnect(s.app, "/synthesize/stream", {"speaker_id": "alice", "text": text}, None)
        assert _cut_short(sent)
        failing = next(i for i, p in enumerate(split_text(text)) if "[fail]" in p)
        assert len(engine.submitted) <= failing + 2  # nothing submitted after the failure was seen
        assert s.runtime.admission.active == 0
        assert 'tts_syntheses_total{outcome="error"} 1.0' in (await s.client.get("/metrics")).text


# --- the chain on the native engine: the real decoder ---------------------------------------------------------
@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model_path("demo", demo_dir=tmp_path_factory.mktemp("model") / "demo-tiny")


@pytest.mark.parametrize(("text_of", "language"), [(english_text, "English"), (chinese_text, "Chinese")])
async def test_long_text_on_the_native_engine_joins_without_clicks(
    text_of, language: str, demo_model: Path, tmp_path: Path
) -> None:
    ensure_demo_voice(tmp_path, demo_model)
    text = text_of()
    pieces = split_text(text, language)
    spied: dict[str, list] = {}
    gate = _next_piece_gate(spied, len(pieces))
    engine = NativeEngine(EngineSettings(model_path=str(demo_model), max_slots=4, max_frames=8), fault_hook=gate)
    async with in_process(engine, profiles_dir=tmp_path) as s:
        handles, overlapped = _spy_submissions(engine)  # after the warm-up request
        spied["handles"] = handles
        body = {"speaker_id": "demo", "text": text, "language": language, "seed": 5, **_EIGHT}
        async with s.client.stream("POST", "/synthesize/stream", json=body) as r:
            assert r.status_code == 200, await r.aread()
            got = np.frombuffer(await r.aread(), "<f4")
    assert [h.request.text for h in handles] == pieces and all(overlapped)
    lengths = [h.stats.samples for h in handles]
    assert all(n > 0 for n in lengths)
    assert len(got) == sum(lengths) <= sum(h.stats.frame_budget for h in handles) * FRAME_SAMPLES
    joins = np.cumsum(lengths)[:-1]
    steps = np.abs(np.diff(got))
    inside = np.ones(len(steps), bool)
    for j in joins:  # the decoder's own: every sample step away from the joins' fades
        inside[max(0, j - FADE_SAMPLES - 1) : j + FADE_SAMPLES] = False
    own = steps[inside].max()
    assert own > 0
    at_joins = np.array([abs(float(got[j]) - float(got[j - 1])) for j in joins])
    assert at_joins.max() <= own
    assert np.abs(got[joins]).max() == 0.0  # each piece starts from silence


# --- paragraphs packed into pieces (issue 46, item 5) -----------------------------------------------------------
def test_many_short_paragraphs_make_few_pieces() -> None:
    text = "Hi.\n\n" * 819  # 4095 characters: one piece per paragraph made 819 engine requests
    pieces = split_text(text, "english")
    assert len(pieces) == 11
    assert all(len(p.encode()) <= PIECE_BYTES for p in pieces)
    assert all(len(p.encode()) >= MIN_PIECE_BYTES for p in pieces[:-1])
    assert sum(p.count("Hi.") for p in pieces) == 819
    assert split_text("First.\n\nSecond.\n\n\n\nThird.", "english") == ["First.\nSecond.\nThird."]


def test_a_paragraph_break_is_the_preferred_cut() -> None:
    para = [f"Paragraph {i} holds one sentence of exactly sixty bytes in it." for i in range(10)]
    assert all(len(p) == 60 for p in para)
    pieces = split_text("\n\n".join(para), "english")
    # Four whole paragraphs fit in 300 bytes (with the newlines), a fifth does not: every cut is a paragraph break.
    assert pieces == ["\n".join(para[0:4]), "\n".join(para[4:8]), "\n".join(para[8:10])]
    # Paragraphs of over 150 bytes: two do not fit in one piece, and each is big enough to stand alone.
    long = [f"Sentence {i} goes on a while. " * 6 for i in range(3)]
    assert all(150 < len(p.strip()) < 200 for p in long)
    assert split_text("\n\n".join(long), "english") == [p.strip() for p in long]


def test_a_piece_too_small_to_stand_alone_takes_the_next_paragraphs_first_sentences() -> None:
    sentences = [f"This is sentence number {i} of the long paragraph. " for i in range(12)]
    text = "Title.\n\n" + "".join(sentences)
    pieces = split_text(text, "english")
    assert pieces[0].startswith("Title.\nThis is sentence number 0")
    assert 250 < len(pieces[0].encode()) <= PIECE_BYTES and pieces[0].endswith("paragraph.")
    assert _squash("".join(pieces)) == _squash(text)


# --- one frame cap for the whole request (issue 46, item 5) ---------------------------------------------------------
def _chain_pieces(n: int, chars: int) -> list[str]:
    return [f"{i:03d}" + "x" * (chars - 3) for i in range(n)]


async def _run_chain(engine: FakeEngine, pieces: list[str], max_frames: int | None, **request) -> tuple:
    await engine.start()
    req = SynthesisRequest(text=" ".join(pieces), xvector=torch.ones(16), seed=3, max_frames=max_frames, **request)
    handles, _ = _spy_submissions(engine)
    chain = PieceChain(engine, req, pieces)
    audio = await chain.collect()
    await asyncio.sleep(0.05)  # let cancelled pieces end
    await engine.stop()
    return chain, handles, audio


def _fake_pieces_audio(engine: FakeEngine, requests: list[SynthesisRequest], frames: list[int]) -> np.ndarray:
    """What a chain yields when piece i contributes its first frames[i] frames: faded in after the first piece,
    faded out before every piece that follows and at a cut that is not the chain's last piece."""
    ramp = np.arange(FADE_SAMPLES, dtype=np.float32) / FADE_SAMPLES
    parts = []
    for i, (req, f) in enumerate(zip(requests, frames, strict=True)):
        x = engine.tone(req, 0, f).copy()
        if i > 0:
            x[:FADE_SAMPLES] *= ramp
        x[-FADE_SAMPLES:] *= ramp[::-1]
        parts.append(x)
    return np.concatenate(parts)


async def test_max_frames_caps_the_whole_chain_not_each_piece() -> None:
    # Eight pieces of 400 characters at 0.1 frames a character: 40 frames each, 320 uncapped. The cap is 50.
    engine = FakeEngine(frames_per_char=0.1, frame_delay=0.002)
    pieces = _chain_pieces(8, 400)
    chain, handles, audio = await _run_chain(engine, pieces, max_frames=50)
    assert audio.shape[0] == 50 * FRAME_SAMPLES  # 4.0 s, not 8 x 40 frames
    assert chain.stats.finish_reason is FinishReason.BUDGET
    assert chain.stats.frames == 50 and chain.stats.samples == 50 * FRAME_SAMPLES
    assert chain.stats.frame_budget == 50
    # Piece 0 (40 frames) and the first 10 of piece 1 are heard. Piece 1 was submitted with what was left then,
    # and cancelled once pieces 0 and 1 together reached the cap (it runs beside piece 0, so that was before
    # piece 0 ended and piece 2 could be submitted): piece 2 never was.
    assert [h.request.text for h in handles] == pieces[:2]
    assert handles[0].request.max_frames == 50
    assert handles[1].request.max_frames == 50 - 3  # submitted once piece 0's first chunk (3 frames) was out
    assert handles[1].stats.finish_reason is FinishReason.CANCELLED
    assert 10 <= handles[1].stats.frames < 40
    np.testing.assert_allclose(audio, _fake_pieces_audio(engine, [h.request for h in handles], [40, 10]), atol=1e-6)


async def test_nothing_is_submitted_once_no_frame_is_left() -> None:
    engine = FakeEngine(frames_per_char=0.1, frame_delay=0.002)  # the first chunk is 3 frames
    pieces = _chain_pieces(5, 300)
    chain, handles, audio = await _run_chain(engine, pieces, max_frames=3)
    assert len(handles) == 1 and audio.shape[0] == 3 * FRAME_SAMPLES
    assert chain.stats.finish_reason is FinishReason.BUDGET and chain.submitted == 1


async def test_min_equal_to_max_fixes_the_length_of_the_whole_request() -> None:
    engine = FakeEngine(frames_per_char=0.01, frame_delay=0.002)  # 3 frames a piece without min_frames
    pieces = _chain_pieces(6, 300)
    chain, handles, audio = await _run_chain(engine, pieces, max_frames=20, min_frames=20)
    assert audio.shape[0] == 20 * FRAME_SAMPLES
    assert chain.stats.finish_reason is FinishReason.BUDGET
    assert len(handles) == 2 and handles[1].request.max_frames == 17  # then cancelled: piece 0 alone made 20


async def test_a_chain_under_its_cap_plays_every_piece_whole() -> None:
    engine = FakeEngine(frames_per_char=0.02, frame_delay=0.002)
    pieces = _chain_pieces(4, 300)  # 6 frames each, 24 in all
    chain, handles, audio = await _run_chain(engine, pieces, max_frames=24)
    assert len(handles) == 4 and audio.shape[0] == 24 * FRAME_SAMPLES
    assert handles[0].request.max_frames == 24 and all(h.request.max_frames < 24 for h in handles[1:])
    assert chain.stats.finish_reason is FinishReason.EOS  # the cap was exactly enough: nothing was cut


async def test_the_server_caps_a_4096_character_request_at_max_new_tokens(tmp_path: Path) -> None:
    engine = FakeEngine(frames_per_char=0.1, frame_delay=0.001)
    write_voice(tmp_path, "alice", 16)
    text = english_text(4096)
    async with in_process(engine, profiles_dir=tmp_path) as s:
        body = {"speaker_id": "alice", "text": text, "max_new_tokens": 50, "response_format": "pcm"}
        r = await s.client.post("/synthesize", json=body)
        assert r.status_code == 200, r.text
        assert len(r.content) == 50 * FRAME_SAMPLES * 2  # int16
        assert r.headers["x-finish-reason"] == "budget"
        assert float(r.headers["x-audio-duration"]) == pytest.approx(4.0)
        # Each later piece got at most the frames the pieces before it had not yet used: the engine made at
        # most one piece's allowance more than the cap, and 4 of the 20 pieces were ever submitted.
        pieces = split_text(text)
        allowances = [r.max_frames for r in engine.submitted]
        assert len(pieces) == 20 and len(engine.submitted) == len(allowances) <= 4
        assert allowances[0] == 50 and all(a < 50 for a in allowances[1:])


@pytest.mark.slow
def test_a_real_server_caps_a_long_request_at_max_new_tokens(tmp_path: Path) -> None:
    """Issue 46, item 5, against `python inference_server.py` on the demo checkpoint: with max_new_tokens=50 a
    4096-character request gave 64 s of audio (16 pieces of 50 frames), and "Hi.\\n\\n" x 819 made 819 pieces."""
    # Debug logging: the chain's summary line (pieces submitted, frames, finish reason).
    with demo_server(tmp_path, TTS_LOG_LEVEL="debug") as srv, httpx.Client(base_url=srv.url, timeout=300) as c:
        for text, pieces in [(english_text(4096), 20), ("Hi.\n\n" * 819, 11)]:
            assert len(text) >= 4095 and len(split_text(text)) == pieces
            body = {"speaker_id": "demo", "text": text, "max_new_tokens": 50, "seed": 1, "response_format": "pcm"}
            r = c.post("/synthesize", json=body)
            assert r.status_code == 200, r.text
            samples = len(r.content) // 2
            assert 0 < samples <= 50 * FRAME_SAMPLES  # at most 4.0 s: 50 frames of 80 ms
            assert float(r.headers["x-audio-duration"]) <= 4.0
            assert r.headers["x-finish-reason"] == "budget"
            summary = re.compile(
                rf"request {r.headers['x-request-id']}: (\d+) of (\d+) pieces submitted, (\d+) frames \(cap 50\), budget"
            )
            deadline = time.monotonic() + 5
            while not (found := summary.search(srv.log())):
                assert time.monotonic() < deadline, srv.log()[-3000:]
                time.sleep(0.05)
            submitted, total, frames = (int(g) for g in found.groups())
            assert total == pieces and 1 <= submitted <= 4 and frames * FRAME_SAMPLES == samples
        assert srv.terminate(timeout=30) == 0
