"""Every route and field, in process, on the real NativeEngine with the tiny demo checkpoint."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import wave
from pathlib import Path

import av
import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio
import soundfile as sf

from qwen_tts.engine_api import EngineSettings, SynthesisRequest
from qwen_tts.engines.native import NativeEngine
from qwen_tts.languages import describe_languages
from qwen_tts.model.model_paths import resolve_model_path
from qwen_tts.voices import ensure_demo_voice
from server_helpers import InProcess, in_process
from tts_server.audio_encoding import to_int16
from tts_server.long_text import split_text

pytestmark = pytest.mark.asyncio(loop_scope="module")

SR = 24000
FRAME = 1920
CAP = 24  # frames per request in these tests: short audio keeps the module fast


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model_path("demo", demo_dir=tmp_path_factory.mktemp("model") / "demo-tiny")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(demo_model: Path, tmp_path_factory: pytest.TempPathFactory):
    voices = tmp_path_factory.mktemp("voices")
    ensure_demo_voice(voices, demo_model)
    engine = NativeEngine(EngineSettings(model_path=str(demo_model), max_slots=4, max_queue=8, max_frames=256))
    async with in_process(engine, profiles_dir=voices, max_concurrent=4, max_queue=8, max_new_tokens=256) as s:
        yield s


def _body(**extra) -> dict:
    return {"speaker_id": "demo", "text": "Hello from the demo voice.", "max_new_tokens": CAP, "seed": 7, **extra}


def _wav(data: bytes, dtype: str = "float32") -> np.ndarray:
    x, sr = sf.read(io.BytesIO(data), dtype=dtype)
    assert sr == SR
    return x


def _int16(data: bytes) -> np.ndarray:
    """A lossless file's samples exactly as written (int16), without a float round trip."""
    return _wav(data, "int16")


async def test_synthesize_returns_a_wav_with_the_seed_headers(server: InProcess) -> None:
    r = await server.client.post("/synthesize", json=_body(), headers={"x-request-id": "abc-1"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/wav"
    assert r.headers["x-request-id"] == "abc-1"
    assert r.headers["x-sample-rate"] == "24000"
    assert float(r.headers["x-latency"]) > 0
    x = _wav(r.content)
    assert len(x) > 0 and len(x) % FRAME == 0 and len(x) <= CAP * FRAME
    assert float(r.headers["x-audio-duration"]) == pytest.approx(len(x) / SR, abs=1e-3)
    assert r.headers["x-finish-reason"] in ("eos", "budget")


async def test_same_seed_gives_the_same_audio_and_another_seed_differs(server: InProcess) -> None:
    a = await server.client.post("/synthesize", json=_body(response_format="pcm"))
    b = await server.client.post("/synthesize", json=_body(response_format="pcm"))
    c = await server.client.post("/synthesize", json=_body(response_format="pcm", seed=8))
    assert a.content == b.content
    assert a.content != c.content


async def test_temperature_zero_is_greedy_and_needs_no_seed(server: InProcess) -> None:
    body = _body(temperature=0.0)
    del body["seed"]
    a = await server.client.post("/synthesize", json=body)
    b = await server.client.post("/synthesize", json=body)
    assert a.status_code == 200 and a.content == b.content


def _aac(data: bytes) -> np.ndarray:
    """An ADTS (`aac`) body decoded by FFmpeg: float32 mono samples."""
    with av.open(io.BytesIO(data), format="aac") as container:
        assert container.streams.audio[0].sample_rate == SR
        return np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])


@pytest.mark.parametrize(
    ("fmt", "media_type"),
    [("wav", "audio/wav"), ("pcm", "audio/L16"), ("flac", "audio/flac"), ("mp3", "audio/mpeg"), ("opus", "audio/ogg"),
     ("aac", "audio/aac")],
)  # fmt: skip
async def test_every_response_format_decodes_to_the_same_length(server: InProcess, fmt: str, media_type: str) -> None:
    ref = _int16((await server.client.post("/synthesize", json=_body())).content)
    r = await server.client.post("/synthesize", json=_body(response_format=fmt))
    assert r.status_code == 200 and r.headers["content-type"] == media_type
    if fmt == "pcm":
        np.testing.assert_array_equal(np.frombuffer(r.content, "<i2"), ref)
    elif fmt == "flac":
        np.testing.assert_array_equal(_int16(r.content), ref)
    elif fmt == "aac":  # 1024 samples of priming and the last frame's padding, nothing lost
        assert len(ref) <= len(_aac(r.content)) < len(ref) + 0.1 * SR
    else:  # lossy: codec delay/padding only
        assert abs(len(_wav(r.content)) - len(ref)) <= 0.1 * SR


async def test_synthesize_wav_has_a_length_correct_header(server: InProcess) -> None:
    r = await server.client.post("/synthesize", json=_body())
    assert int(r.headers["content-length"]) == len(r.content)
    assert int.from_bytes(r.content[4:8], "little") == len(r.content) - 8
    with wave.open(io.BytesIO(r.content)) as w:
        assert w.getnframes() == len(_int16(r.content)) > 0


async def test_max_new_tokens_caps_the_audio_length(server: InProcess) -> None:
    r = await server.client.post("/synthesize", json=_body(max_new_tokens=4, response_format="pcm"))
    assert r.status_code == 200
    assert 0 < len(r.content) // 2 <= 4 * FRAME


async def test_min_new_tokens_equal_to_max_fixes_the_length(server: InProcess) -> None:
    r = await server.client.post("/synthesize", json=_body(min_new_tokens=10, max_new_tokens=10, response_format="pcm"))
    assert r.status_code == 200 and len(r.content) == 2 * 10 * FRAME
    assert r.headers["x-finish-reason"] == "budget"


async def test_min_new_tokens_above_max_is_refused(server: InProcess) -> None:
    r = await server.client.post("/synthesize", json=_body(min_new_tokens=30, max_new_tokens=10))
    assert r.status_code == 422
    assert r.json()["error"]["message"] == "min_new_tokens: 30 is above max_new_tokens (10)"


async def test_text_over_the_engine_token_limit_is_synthesized_in_pieces(server: InProcess) -> None:
    # 3500 characters, > 1024 tokens: one engine request would be refused; sentence pieces are not (long_text.py).
    text = "A long story. " * 250
    r = await server.client.post("/synthesize", json=_body(text=text, max_new_tokens=2, response_format="pcm"))
    assert r.status_code == 200, r.text
    pieces = split_text(text)
    assert len(pieces) == 12
    # max_new_tokens caps the whole request, not each piece (issue 46): 2 frames in all (min_new_tokens is 2).
    assert len(r.content) // 2 == 2 * FRAME and r.headers["x-finish-reason"] == "budget"
    assert server.runtime.admission.active == 0


async def test_language_is_case_insensitive_and_auto_by_default(server: InProcess) -> None:
    for language in ("English", "ENGLISH", "auto", "Auto"):
        r = await server.client.post("/synthesize", json=_body(language=language))
        assert r.status_code == 200, (language, r.text)


async def test_iso_639_1_codes_are_the_language_they_name(server: InProcess) -> None:
    named = await server.client.post("/synthesize", json=_body(language="English", response_format="pcm"))
    auto = await server.client.post("/synthesize", json=_body(language="auto", response_format="pcm"))
    assert named.content != auto.content  # the language reaches the prompt: a wrong mapping would show
    for code in ("en", "EN", "en-GB", "en_US"):
        r = await server.client.post("/synthesize", json=_body(language=code, response_format="pcm"))
        assert r.status_code == 200 and r.content == named.content, code
    speech = await server.client.post("/v1/audio/speech", json=_speech(language="en", response_format="pcm"))
    assert speech.status_code == 200 and speech.content == named.content


async def test_an_unknown_language_code_lists_the_accepted_ones(server: InProcess) -> None:
    r = await server.client.post("/synthesize", json=_body(language="xx"))
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["param"] == "language" and error["code"] == "unsupported_language"
    accepted = describe_languages(server.runtime.engine.languages)
    assert error["message"] == (
        f"language: 'xx' is not supported (one of: {accepted}; a name in any case or its ISO 639-1 code)"
    )
    assert "English (en)" in accepted and "Chinese (zh)" in accepted and accepted.startswith("Auto, ")


async def test_stream_is_float32_and_equals_the_whole_file(server: InProcess) -> None:
    whole = await server.client.post("/synthesize", json=_body(response_format="pcm"))
    r = await server.client.post("/synthesize/stream", json=_body())
    assert r.status_code == 200
    assert r.headers["x-audio-format"] == "f32le" and r.headers["x-sample-rate"] == "24000"
    assert float(r.headers["x-time-to-first-audio"]) > 0
    pcm = np.frombuffer(r.content, "<f4")
    assert len(pcm) % FRAME == 0
    np.testing.assert_array_equal(to_int16(pcm), np.frombuffer(whole.content, "<i2"))


async def test_stream_formats_pcm_and_wav(server: InProcess) -> None:
    whole = await server.client.post("/synthesize", json=_body(response_format="pcm"))
    pcm = await server.client.post("/synthesize/stream", json=_body(response_format="pcm"))
    assert pcm.content == whole.content
    wav = await server.client.post("/synthesize/stream", json=_body(response_format="wav"))
    assert wav.headers["content-type"] == "audio/wav"
    np.testing.assert_array_equal(_int16(wav.content), np.frombuffer(whole.content, "<i2"))


async def test_seed_stream_field_false_is_the_whole_file_and_true_is_the_stream(server: InProcess) -> None:
    """The seed's /synthesize body carries `stream`: false gives the same file as without it, true answers exactly
    as /synthesize/stream does (its headers, its default float32 format, or pcm/wav when asked)."""
    whole = await server.client.post("/synthesize", json=_body())
    off = await server.client.post("/synthesize", json=_body(stream=False))
    assert off.status_code == 200 and off.headers["content-type"] == "audio/wav"
    assert off.content == whole.content

    stream = await server.client.post("/synthesize/stream", json=_body())
    on = await server.client.post("/synthesize", json=_body(stream=True))
    assert on.status_code == 200, on.text
    assert on.headers["x-audio-format"] == "f32le" and on.headers["content-type"] == "application/octet-stream"
    assert float(on.headers["x-time-to-first-audio"]) > 0
    assert len(on.content) > 0 and on.content == stream.content
    np.testing.assert_array_equal(to_int16(np.frombuffer(on.content, "<f4")), _int16(whole.content))

    pcm = await server.client.post("/synthesize", json=_body(stream=True, response_format="pcm"))
    assert pcm.headers["x-audio-format"] == "pcm"
    np.testing.assert_array_equal(np.frombuffer(pcm.content, "<i2"), _int16(whole.content))


async def test_seed_stream_field_refusals_name_the_field(server: InProcess) -> None:
    r = await server.client.post("/synthesize", json=_body(stream=True, response_format="mp3"))
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["param"] == "response_format"
    assert (
        error["message"].startswith('with "stream": true, response_format:')
        and "'f32le', 'pcm' or 'wav'" in error["message"]
    )
    r = await server.client.post("/synthesize", json=_body(stream="yes"))
    assert r.status_code == 422 and r.json()["error"]["param"] == "stream"


async def test_speakers_lists_ids_with_width_and_file(server: InProcess) -> None:
    r = await server.client.get("/speakers")
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == 1
    (demo,) = body["speakers"]
    assert demo["id"] == "demo" and demo["file"] == "demo.safetensors"
    assert demo["dim"] == server.runtime.engine.xvector_dim and demo["model"] == "demo"


async def test_health_and_ready(server: InProcess, demo_model: Path) -> None:
    health = (await server.client.get("/health")).json()
    assert health["status"] == "ok" and health["ready"] is True
    # The top level is what an operator reads (docs/api.md); the engine's whole description is under "engine" only.
    assert set(health) == {
        "status", "ready", "model", "backend", "speakers", "running", "waiting", "admitted", "uptime_s",
        "engine_restarts", "engine",
    }  # fmt: skip
    dim = server.runtime.engine.xvector_dim
    name = demo_model.name  # the checkpoint folder's name (the engine here is given its path, not "demo")
    assert health["model"] == {"name": name, "size": "tiny", "xvector_dim": dim, "device": "cpu", "dtype": "float32"}
    assert health["speakers"] == 1 and health["backend"] == "native"
    engine = health["engine"]
    assert {k: engine[k] for k in health["model"]} == health["model"]  # the summary is taken from it
    assert engine["max_slots"] == 4 and engine["cuda_graphs"] is False  # and it has the engine's own keys
    assert "path" not in engine and not any(str(v).startswith("/") for v in engine.values())  # public: no paths
    assert (await server.client.get("/ready")).json() == {"status": "ready"}


async def test_metrics_count_requests_and_latencies(server: InProcess) -> None:
    await server.client.post("/synthesize", json=_body())
    text = (await server.client.get("/metrics")).text
    assert 'tts_http_requests_total{route="/synthesize",status="200"}' in text
    assert 'tts_syntheses_total{outcome="ok"}' in text
    for name in (
        "tts_time_to_first_audio_seconds_count",
        "tts_queue_time_seconds_count",
        "tts_real_time_factor_count",
        "tts_time_to_engine_seconds_count",
    ):
        line = next(x for x in text.splitlines() if x.startswith(name))
        assert float(line.split()[-1]) >= 1, line
    assert "tts_requests_running 0.0" in text and "tts_requests_waiting 0.0" in text


async def test_openapi_documents_the_routes_and_bodies(server: InProcess) -> None:
    spec = (await server.client.get("/openapi.json")).json()
    for path in ("/synthesize", "/synthesize/stream", "/v1/audio/speech", "/speakers", "/health", "/ready"):
        assert path in spec["paths"], path
    schema = spec["paths"]["/synthesize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(schema["properties"]) >= {"speaker_id", "text", "language", "response_format", "seed"}
    # Every reference resolves from the document's root (what ReDoc and code generators follow): nested models
    # are components, not `$defs` left inside a body's schema.
    refs: list[str] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            assert "$defs" not in node, sorted(node)
            refs.extend([node["$ref"]] if isinstance(node.get("$ref"), str) else [])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(spec)
    components = spec["components"]["schemas"]
    assert "InlineReference" in components and "#/components/schemas/InlineReference" in refs
    for ref in refs:
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in components, ref


# --- OpenAI-compatible route ------------------------------------------------------------------------------
def _speech(**extra) -> dict:
    return {"model": "tts-1", "voice": "demo", "input": "Hello from the demo voice.", "max_new_tokens": CAP,
            "seed": 7, **extra}  # fmt: skip


async def test_openai_speech_defaults_to_mp3(server: InProcess) -> None:
    r = await server.client.post("/v1/audio/speech", json=_speech())
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
    assert len(_wav(r.content)) > 0


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "opus", "aac"])
async def test_openai_speech_formats_match_synthesize(server: InProcess, fmt: str) -> None:
    ref = np.frombuffer((await server.client.post("/synthesize", json=_body(response_format="pcm"))).content, "<i2")
    r = await server.client.post("/v1/audio/speech", json=_speech(response_format=fmt))
    assert r.status_code == 200, r.text
    if fmt == "pcm":
        np.testing.assert_array_equal(np.frombuffer(r.content, "<i2"), ref)
    elif fmt in ("wav", "flac"):
        np.testing.assert_array_equal(_int16(r.content), ref)
    elif fmt == "aac":
        assert r.headers["content-type"] == "audio/aac"
        assert len(ref) <= len(_aac(r.content)) < len(ref) + 0.1 * SR
    else:
        assert abs(len(_wav(r.content)) - len(ref)) <= 0.1 * SR


async def test_openai_sdk_saves_a_wav_with_its_true_length(server: InProcess, tmp_path: Path) -> None:
    """The documented `speech.create(..., response_format="wav").write_to_file(...)`: the saved file states its real
    length to Python's wave, libsndfile and sox (a streaming header's 0xFFFFFFFF reads as 2**31-1 frames, 89,478 s)."""
    ref = np.frombuffer((await server.client.post("/synthesize", json=_body(response_format="pcm"))).content, "<i2")
    extra = {"seed": 7, "max_new_tokens": CAP}
    transport = httpx.ASGITransport(app=server.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver/v1") as http:
        sdk = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        speech = await sdk.audio.speech.create(
            model="tts-1", voice="demo", input="Hello from the demo voice.", response_format="wav", extra_body=extra
        )
    assert int(speech.response.headers["content-length"]) == len(speech.content)
    path = tmp_path / "hello.wav"
    speech.write_to_file(path)
    with wave.open(str(path)) as w:
        assert (w.getnframes(), w.getframerate(), w.getnchannels()) == (len(ref), SR, 1)
    assert sf.info(str(path)).frames == len(ref)
    np.testing.assert_array_equal(sf.read(str(path), dtype="int16")[0], ref)
    if shutil.which("sox") is None:
        pytest.skip("sox is not installed (CI installs the apt package 'sox')")
    samples = subprocess.run(["sox", "--i", "-s", str(path)], capture_output=True, text=True, check=True).stdout
    assert int(samples) == len(ref)


async def test_openai_sse_wav_is_the_streamed_form(server: InProcess) -> None:
    """Asked for as a stream, wav keeps the streaming header (its length is unknown when the header leaves)."""
    ref = np.frombuffer((await server.client.post("/synthesize", json=_body(response_format="pcm"))).content, "<i2")
    r = await server.client.post("/v1/audio/speech", json=_speech(response_format="wav", stream_format="sse"))
    events = [json.loads(line[len("data: ") :]) for line in r.text.split("\n\n") if line.startswith("data: ")]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert audio[4:8] == b"\xff\xff\xff\xff" and audio[40:44] == b"\xff\xff\xff\xff"
    np.testing.assert_array_equal(np.frombuffer(audio[44:], "<i2"), ref)


async def test_openai_aac_streams_and_decodes_to_the_length(server: InProcess) -> None:
    ref = np.frombuffer((await server.client.post("/synthesize", json=_body(response_format="pcm"))).content, "<i2")
    async with server.client.stream("POST", "/v1/audio/speech", json=_speech(response_format="aac")) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/aac"
        assert "content-length" not in r.headers  # chunked: sent as it is encoded
        data = b"".join([part async for part in r.aiter_bytes()])
    decoded = _aac(data)
    assert len(ref) <= len(decoded) < len(ref) + 0.1 * SR
    # AAC at 64 kb/s keeps the waveform's level: the same RMS within 1 dB (priming delay aside).
    ref_rms = np.sqrt(np.mean((ref / 32767.0) ** 2))
    assert abs(20 * np.log10(np.sqrt(np.mean(decoded**2)) / ref_rms)) < 1.0


async def test_openai_voice_may_be_an_object(server: InProcess) -> None:
    r = await server.client.post("/v1/audio/speech", json=_speech(voice={"id": "demo"}, response_format="pcm"))
    assert r.status_code == 200 and len(r.content) > 0


async def test_openai_sse_stream_carries_base64_deltas_then_done(server: InProcess) -> None:
    ref = (await server.client.post("/synthesize", json=_body(response_format="pcm"))).content
    r = await server.client.post("/v1/audio/speech", json=_speech(response_format="pcm", stream_format="sse"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: ") :]) for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["output_tokens"] == len(ref) // 2 // FRAME
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert audio == ref


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"response_format": "m4a"}, "response_format", "'mp3', 'opus', 'aac', 'flac', 'wav' or 'pcm'"),
        ({"speed": 0.1}, "speed", "greater than or equal to 0.25"),
        ({"speed": 9.0}, "speed", "less than or equal to 4"),
        ({"instructions": "whisper"}, "instructions", "not supported by Base"),
        ({"stream_format": "chunks"}, "stream_format", "'audio' or 'sse'"),
        ({"input": "x" * 4097}, "input", "4097 characters, the limit is 4096"),
        ({"voice": "../etc"}, "voice", "speaker id must be"),
        ({"voice": "alloy"}, "voice", "unknown speaker 'alloy'"),
        ({"model": ""}, "model", "at least 1 character"),
        ({"extra_field": 1}, "extra_field", "unknown field"),
    ],
)
async def test_openai_speech_refuses_clearly(server: InProcess, extra: dict, param: str, fragment: str) -> None:
    r = await server.client.post("/v1/audio/speech", json=_speech(**extra))
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["param"] == param


async def test_openai_speed_one_is_accepted(server: InProcess) -> None:
    r = await server.client.post("/v1/audio/speech", json=_speech(speed=1.0, response_format="pcm"))
    assert r.status_code == 200


async def test_openai_models_lists_the_served_model(server: InProcess) -> None:
    body = (await server.client.get("/v1/models")).json()
    assert body["object"] == "list" and body["data"][0]["id"] == "qwen3-tts"


@pytest.mark.parametrize(
    ("body", "engine_options"),
    [
        ({"temperature": 0}, {"temperature": 0.0, "greedy": True}),
        ({"top_k": 1}, {"top_k": 1}),  # codebook 0 argmax, residual codes still sampled
        ({"temperature": 0.4, "top_k": 3, "seed": 11}, {"temperature": 0.4, "top_k": 3, "seed": 11}),
        ({"language": "German", "min_new_tokens": 20}, {"language": "German", "min_frames": 20}),
    ],
)
async def test_body_options_reach_the_engine(server: InProcess, body: dict, engine_options: dict) -> None:
    r = await server.client.post("/synthesize", json=_body(response_format="pcm", **body))
    assert r.status_code == 200, r.text
    got = np.frombuffer(r.content, dtype="<i2")
    # The same request submitted to the engine directly, with the options spelled out as the engine takes them:
    # the server's defaults are TTS_TEMPERATURE=0.9 and TTS_TOP_K=50.
    opts = {"temperature": 0.9, "top_k": 50, "seed": 7, "max_frames": CAP, **engine_options}
    req = SynthesisRequest(text=_body()["text"], xvector=server.runtime.voices.get("demo"), **opts)
    expected = to_int16(await server.runtime.engine.submit(req).collect())
    assert got.shape == expected.shape and got.size > 0
    np.testing.assert_array_equal(got, expected)
    # And the options matter: the server's defaults give other audio.
    default = await server.client.post("/synthesize", json=_body(response_format="pcm"))
    assert not np.array_equal(np.frombuffer(default.content, dtype="<i2"), got)


async def test_greedy_audio_is_the_same_whatever_the_seed(server: InProcess) -> None:
    a = await server.client.post("/synthesize", json=_body(response_format="pcm", temperature=0, seed=1))
    b = await server.client.post("/synthesize", json=_body(response_format="pcm", temperature=0, seed=2))
    assert a.status_code == b.status_code == 200
    assert a.content == b.content


async def test_every_synthesize_answer_has_a_documented_media_type(server: InProcess) -> None:
    documented = server.app.openapi()["paths"]["/synthesize"]["post"]["responses"]["200"]["content"]
    for extra in ({}, {"stream": True}, {"stream": True, "response_format": "pcm"}, {"response_format": "flac"}):
        r = await server.client.post("/synthesize", json=_body(**extra))
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].split(";")[0] in documented, (extra, r.headers["content-type"])
