"""The page at `/` (tts_server/static/index.html) and the API docs pages.

Without a browser (httpx over ASGI): the page is served without a key and writes no voice or language into itself,
`/languages` lists what synthesis accepts, `/docs` and `/redoc` reference only assets this server serves.

In a real headless Chromium (Debian's `chromium`, driven by Playwright; no browser is downloaded), over real server
processes: synthesize with the demo voice, hear it streamed through Web Audio to its end, read time to first audio
and the real-time factor off the page, pick any of the model's languages, download the result as a WAV file; on a
server with no `demo` voice and voice management on, start with no voices (the page says how to enrol one, Speak is
off), then pick up voices enrolled by hand, speak with the first one and delete voices after a confirm; `/docs` and
`/redoc` render with no request to another host. Screenshots go to test-output/web/ (TTS_TEST_OUTPUT overrides the
folder)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from qwen_tts.model.model_paths import resolve_model_path
from server_helpers import REPO_ROOT, demo_env, in_process, server_process, write_voice

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
OUTPUT = Path(os.environ.get("TTS_TEST_OUTPUT", REPO_ROOT / "test-output")) / "web"
FRAME = 1920
CAP = 20  # frames: 1.6 s of audio, played in real time by the page


async def test_the_page_is_served_without_a_key_and_uses_only_the_public_api(tmp_path: Path) -> None:
    from qwen_tts.engines.fake import FakeEngine

    write_voice(tmp_path, "alice", 16)
    async with in_process(FakeEngine(), profiles_dir=tmp_path, api_keys=["key-for-the-page-test"]) as s:
        r = await s.client.get("/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "<title>Qwen3-TTS server</title>" in r.text
        assert (await s.client.get("/speakers")).status_code == 401  # the API behind it still needs the key
    script = r.text.split("<script>")[1]
    for path in ('"/languages"', '"/v1/audio/speech"', '"/v1/audio/voices"', '"/v1/audio/voices/"'):
        assert path in script
    assert "/synthesize" not in script  # the page speaks the OpenAI route only
    # Nothing the server decides is written into the page: the voices and the languages come from the API.
    assert "demo" not in r.text and "<option" not in r.text


async def test_languages_lists_what_synthesis_accepts(tmp_path: Path) -> None:
    from qwen_tts.engines.fake import FakeEngine

    write_voice(tmp_path, "alice", 16)
    engine = FakeEngine(languages=("auto", "english", "italian"))
    async with in_process(engine, profiles_dir=tmp_path) as s:
        r = await s.client.get("/languages")
        assert r.status_code == 200
        assert r.json() == {"languages": ["Auto", "English", "Italian"], "default": "Auto"}
        body = {"model": "qwen3-tts", "input": "Hi.", "voice": "alice", "response_format": "pcm"}
        for name in r.json()["languages"]:
            ok = await s.client.post("/v1/audio/speech", json={**body, "language": name, "max_new_tokens": 2})
            assert ok.status_code == 200, (name, ok.text)
        refused = await s.client.post("/v1/audio/speech", json={**body, "language": "French"})
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "unsupported_language"


ASSET_TYPES = {".js": ("text/javascript", "application/javascript"), ".css": ("text/css",), ".png": ("image/png",)}


@pytest.mark.parametrize(("path", "assets"), [("/docs", 3), ("/redoc", 2)])
async def test_the_docs_pages_load_only_assets_this_server_serves(path: str, assets: int) -> None:
    from qwen_tts.engines.fake import FakeEngine

    async with in_process(FakeEngine()) as s:
        r = await s.client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert not re.search(r"https?:|//[a-z]", r.text, flags=re.I), r.text  # no other host, no protocol-relative URL
        assert r.headers["content-security-policy"] == "img-src 'self' data:"  # nor an image the page script adds
        referenced = re.findall(r'(?:src|href)="([^"]+)"', r.text)
        assert len(referenced) == assets and all(u.startswith("/docs/assets/") for u in referenced), referenced
        for url in referenced:
            asset = await s.client.get(url)
            assert asset.status_code == 200, url
            assert asset.headers["content-type"].split(";")[0] in ASSET_TYPES[Path(url).suffix], asset.headers
            assert len(asset.content) > 1000, url
        assert "'/openapi.json'" in r.text or '"/openapi.json"' in r.text  # the schema is this server's
        assert (await s.client.get("/docs/assets/missing.js")).status_code == 404


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory):
    """The demo checkpoint and its `demo` voice, voice management off (the default)."""
    root = tmp_path_factory.mktemp("web")
    resolve_model_path("demo", demo_dir=root / "demo-tiny")
    env = demo_env(root, TTS_MAX_NEW_TOKENS=str(CAP), TTS_REQUEST_TIMEOUT="120")
    with server_process(env, root / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def managed_server(tmp_path_factory: pytest.TempPathFactory):
    """A checkpoint served by its folder (as a real one is: no `demo` voice is written), an empty profiles folder,
    voice management on (TTS_VOICE_UPLOAD=true)."""
    root = tmp_path_factory.mktemp("web-managed")
    checkpoint = resolve_model_path("demo", demo_dir=root / "demo-tiny")
    env = {
        "TTS_MODEL_PATH": str(checkpoint),
        "TTS_PROFILES_DIR": str(root / "voices"),
        "TTS_VOICE_UPLOAD": "true",
        "TTS_MAX_NEW_TOKENS": str(CAP),
        "TTS_REQUEST_TIMEOUT": "120",
    }
    (root / "voices").mkdir()
    with server_process(env, root / "server.log") as srv:
        srv.profiles = root / "voices"
        yield srv


@contextlib.contextmanager
def chromium(tmp_path: Path) -> Iterator:
    """A page in a fresh headless Chromium profile that may play audio without a gesture; its console is collected
    in `page.console`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=CHROMIUM,
            headless=True,
            accept_downloads=True,
            args=[*CHROMIUM_FLAGS, "--autoplay-policy=no-user-gesture-required"],
        )
        try:
            page = context.new_page()
            page.console = []
            page.on("console", lambda m: page.console.append(f"{m.type}: {m.text}"))
            yield page
        finally:
            context.close()


def wait_status(page, *texts: str, timeout: float = 30_000) -> str:
    """Wait until #status reads one of `texts` or is an error; the status."""
    page.wait_for_function(
        "(texts) => texts.includes(document.getElementById('status').textContent)"
        " || document.getElementById('status').className === 'error'",
        arg=list(texts),
        timeout=timeout,
    )
    status = page.text_content("#status")
    assert status in texts, (status, page.console)
    return status


def speak_and_check(page, voice: str, tmp_path: Path) -> int:
    """Click Speak, wait until the result has played through, download it; check figures and file; the samples."""
    page.click("#speak")
    wait_status(page, "played", timeout=60_000)
    samples = int(page.evaluate("() => document.body.dataset.samples"))
    assert 0 < samples <= CAP * FRAME and samples % FRAME == 0
    played_until = float(page.evaluate("() => document.body.dataset.played"))
    assert played_until >= samples / 24000  # the audio clock ran through the whole result
    ttfa = page.text_content("#ttfa")
    assert ttfa.endswith(" ms") and 0 < int(ttfa.removesuffix(" ms")) < 60_000
    assert float(page.text_content("#rtf")) > 0
    assert page.is_visible("#result")  # the whole result, for replay
    # ... and for download: a WAV file named after the voice, the same samples as played.
    with page.expect_download() as info:
        page.click("#download")
    download, name = info.value, info.value.suggested_filename
    assert re.fullmatch(rf"qwen3-tts-{voice}-\d{{8}}-\d{{6}}\.wav", name), name
    saved = tmp_path / name
    download.save_as(saved)
    wav = saved.read_bytes()
    assert wav[:4] == b"RIFF" and wav[8:16] == b"WAVEfmt "
    channels, rate, bits = struct.unpack("<HI", wav[22:28]) + struct.unpack("<H", wav[34:36])
    assert (channels, rate, bits) == (1, 24000, 16)
    assert wav[36:40] == b"data" and struct.unpack("<I", wav[40:44])[0] == samples * 2 == len(wav) - 44
    assert any(struct.unpack(f"<{samples}h", wav[44:]))  # not silence
    return samples


needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium; .ci/run does)"
)


@needs_chromium
def test_the_page_plays_a_streamed_result_in_headless_chromium(demo_server, tmp_path: Path) -> None:
    languages = httpx.get(demo_server.url + "/languages").json()["languages"]
    assert len(languages) == 11 and {"Auto", "English", "Italian", "Portuguese", "Russian"} <= set(languages)
    OUTPUT.mkdir(parents=True, exist_ok=True)
    with chromium(tmp_path) as page:
        requests: list[str] = []
        sent: list[dict] = []
        page.on("request", lambda r: requests.append(r.url.removeprefix(demo_server.url)))
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/audio/speech") else None)
        page.goto(demo_server.url + "/")
        wait_status(page, "ready")
        assert page.input_value("#voice") == "demo"
        # Every language of the served model, from the server, its default selected.
        assert page.eval_on_selector_all("#language option", "os => os.map(o => o.value)") == languages
        assert page.input_value("#language") == "Auto"
        assert page.is_hidden("#upload") and page.is_hidden("#delete")  # this server does not manage voices
        assert page.is_hidden("#novoices") and page.is_enabled("#speak")
        page.select_option("#language", "Italian")
        page.fill("#text", "Hello from the demo voice.")
        speak_and_check(page, "demo", tmp_path)
        page.screenshot(path=str(OUTPUT / "page-played.png"), full_page=True)
        assert sent == [
            {"model": "qwen3-tts", "input": "Hello from the demo voice.", "voice": "demo", "language": "Italian",
             "response_format": "pcm", "speed": 1}
        ]  # fmt: skip
        api = [u for u in requests if u != "/" and not u.startswith("blob:")]  # blob: the page's own WAV
        assert set(api) == {"/languages", "/v1/audio/voices", "/v1/audio/speech"}, api
        # The page's own script and style run under its Content-Security-Policy, and nothing it does is refused.
        assert not [m for m in page.console if "Content Security Policy" in m], page.console

        # A server that reports uploads gets the upload control (the feature check, on stubbed answers), and
        # the upload is the voices API's multipart form: name, audio_sample, ref_text.
        uploads: list[bytes] = []

        def voices_api(route) -> None:
            if route.request.method == "POST":
                uploads.append(route.request.post_data_buffer)
                route.fulfill(status=201, json={"id": "newvoice", "object": "voice"})
            else:
                route.fulfill(json={"object": "list", "voices": ["demo"], "data": [], "upload_enabled": True})

        page.route("**/v1/audio/voices", voices_api)
        page.reload()
        wait_status(page, "ready")
        page.wait_for_selector("#upload", state="visible", timeout=10_000)
        assert page.is_visible("#delete")
        clip = tmp_path / "clip.wav"
        clip.write_bytes(b"RIFF-not-really-a-wav")
        page.fill("#upname", "newvoice")
        page.set_input_files("#upfile", str(clip))
        page.fill("#uptext", "what the clip says")
        page.click("#upsend")
        page.wait_for_function("() => document.getElementById('upstatus').textContent === 'added newvoice'")
        assert len(uploads) == 1
        form = uploads[0]
        for part in (b'name="name"', b"newvoice", b'name="audio_sample"; filename="clip.wav"', b'name="ref_text"'):
            assert part in form, part
        # (the intercepted copy of a multipart body carries file parts empty: only the text parts are checked)
        assert b"what the clip says" in form and b"Content-Type: audio/wav" in form
    assert (OUTPUT / "page-played.png").stat().st_size > 1000


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory: pytest.TempPathFactory):
    """The fake backend (sine tones, one 80 ms frame per character of text, 10 ms a frame) with its `demo` voice and a
    key: the WebSocket session's text streaming, which the fake engine honours."""
    root = tmp_path_factory.mktemp("web-fake")
    env = demo_env(root, TTS_BACKEND="fake", TTS_API_KEYS="page-ws-key-123")
    with server_process(env, root / "server.log") as srv:
        yield srv


@needs_chromium
def test_the_page_speaks_as_i_type_over_the_websocket_and_stop_barges_in(fake_server, tmp_path: Path) -> None:
    with chromium(tmp_path) as page:
        sockets: list[str] = []
        frames: list[str] = []

        def on_socket(ws) -> None:
            sockets.append(ws.url)
            ws.on("framesent", lambda payload: frames.append(payload if isinstance(payload, str) else "<bytes>"))

        page.on("websocket", on_socket)
        page.goto(fake_server.url + "/")
        page.fill("#apikey", "page-ws-key-123")
        page.dispatch_event("#apikey", "change")
        wait_status(page, "ready")
        page.fill("#text", "")
        page.check("#live")
        wait_status(page, "live: type, Enter ends the utterance")
        assert page.is_visible("#stop") and page.is_hidden("#speak")
        page.type("#text", "Hello there, friend", delay=20)  # keystrokes: finished words go out as they end
        page.keyboard.press("Enter")  # the rest, and end
        page.wait_for_function("() => document.body.dataset.liveDone === 'eos'", timeout=30_000)
        typed = len("Hello there, friend")
        assert int(page.evaluate("() => document.body.dataset.liveSamples")) == typed * FRAME
        page.wait_for_function(f"() => Number(document.body.dataset.livePlayed) === {typed * FRAME}")
        assert page.text_content("#ttfa").endswith(" ms")
        sent = [json.loads(f) for f in frames]
        assert sent[0] == {"type": "auth", "token": "page-ws-key-123"}  # the key as the first message
        assert sent[1] == {"type": "start", "voice": "demo", "response_format": "pcm", "language": "Auto"}
        texts = [m["text"] for m in sent if m["type"] == "text"]
        assert "".join(texts) == "Hello there, friend" and len(texts) >= 3  # word by word, not all at once
        assert sent[-1] == {"type": "end"}

        # A long utterance, cut off with Stop while it plays: a barge-in.
        page.fill("#text", "")
        page.type("#text", "x" * 60 + " ", delay=1)
        page.wait_for_function("() => Number(document.body.dataset.livePlayed || 0) > 0", timeout=30_000)
        page.click("#stop")
        page.wait_for_function("() => document.body.dataset.liveDone === 'cancelled'", timeout=10_000)
        assert {"type": "cancel"} in [json.loads(f) for f in frames]
        assert sockets == [fake_server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"]
        assert not [m for m in page.console if "Content Security Policy" in m], page.console
        page.screenshot(path=str(OUTPUT / "page-live.png"), full_page=True)
    fake_server.wait_idle(10)


@needs_chromium
def test_an_answer_to_a_voice_list_asked_before_the_key_was_typed_does_not_overwrite_the_keyed_one(
    fake_server, tmp_path: Path
) -> None:
    """The page asks for voices on load, with no key; the user types the key and it asks again. The first answer
    (401) is held back until the second has been shown: the page keeps the keyed answer."""
    with chromium(tmp_path) as page:
        held: list = []

        def voices(route) -> None:
            if "authorization" in route.request.headers:
                route.continue_()
            else:
                held.append(route)

        page.route("**/v1/audio/voices", voices)
        page.goto(fake_server.url + "/")
        deadline = time.monotonic() + 10
        while not held:
            assert time.monotonic() < deadline, "the page did not ask for voices on load"
            page.wait_for_timeout(20)
        assert page.text_content("#status") == "loading voices"
        page.fill("#apikey", "page-ws-key-123")
        page.dispatch_event("#apikey", "change")
        wait_status(page, "ready")
        with page.expect_response(lambda r: r.url.endswith("/v1/audio/voices") and r.status == 401):
            held[0].continue_()
        page.evaluate("() => new Promise((done) => setTimeout(done, 200))")  # the page has read the late answer
        assert page.text_content("#status") == "ready" and page.get_attribute("#status", "class") == ""
        assert page.input_value("#voice") == "demo" and page.is_enabled("#speak")


def _wait_speakers(server, count: int) -> None:
    deadline = time.monotonic() + 15
    while server.health()["speakers"] != count:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)


@needs_chromium
def test_the_page_works_with_any_voices_and_deletes_them(managed_server, tmp_path: Path) -> None:
    srv = managed_server
    OUTPUT.mkdir(parents=True, exist_ok=True)
    with chromium(tmp_path) as page:
        speech: list[str] = []
        page.on("request", lambda r: speech.append(r.post_data) if r.url.endswith("/v1/audio/speech") else None)
        page.goto(srv.url + "/")
        # No voices at all: the page says so and how to enrol one (here also by upload), and Speak is off.
        wait_status(page, "no voices on this server yet")
        assert page.is_visible("#novoices") and page.is_visible("#novoices-upload")
        assert page.is_hidden("#novoices-noupload")
        assert "extract_speaker_embedding.py" in page.text_content("#novoices")
        assert page.is_disabled("#speak") and page.is_disabled("#voice") and page.is_hidden("#delete")
        assert page.is_visible("#upload")
        page.screenshot(path=str(OUTPUT / "page-no-voices.png"), full_page=True)
        page.evaluate("() => speak()")  # even called directly, nothing is sent without a voice
        assert page.text_content("#status") == "no voice selected: enrol one first"
        assert speech == []

        # Voices enrolled by hand (as the extractor writes them), none of them `demo`: the first is selected.
        dim = srv.health()["model"]["xvector_dim"]
        for seed, name in enumerate(("bob", "alice")):
            write_voice(srv.profiles, name, dim, seed=seed)
        _wait_speakers(srv, 2)
        page.reload()
        wait_status(page, "ready")
        assert page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)") == ["alice", "bob"]
        assert page.input_value("#voice") == "alice"
        assert page.is_hidden("#novoices") and page.is_enabled("#speak") and page.is_visible("#delete")
        page.fill("#text", "Hello from Alice.")
        speak_and_check(page, "alice", tmp_path)
        assert len(speech) == 1 and '"voice":"alice"' in speech[0]

        # Delete asks first; declined, nothing changes.
        page.once("dialog", lambda d: d.dismiss())
        page.click("#delete")
        assert page.input_value("#voice") == "alice" and (srv.profiles / "alice.safetensors").exists()
        # Accepted: the profile is gone, the list is refreshed and the next voice selected.
        messages: list[str] = []
        page.once("dialog", lambda d: (messages.append(d.message), d.accept()))
        page.click("#delete")
        wait_status(page, "deleted alice")
        assert messages and '"alice"' in messages[0]
        assert page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)") == ["bob"]
        assert page.input_value("#voice") == "bob" and not (srv.profiles / "alice.safetensors").exists()
        # The last one: back to no voices.
        page.once("dialog", lambda d: d.accept())
        page.click("#delete")
        wait_status(page, "no voices on this server yet")
        assert page.is_visible("#novoices") and page.is_disabled("#speak") and page.is_hidden("#delete")
        assert httpx.get(srv.url + "/v1/audio/voices").json()["voices"] == []
        assert len(speech) == 1
        assert not [m for m in page.console if "Content Security Policy" in m], page.console


@needs_chromium
@pytest.mark.parametrize(("path", "rendered"), [("/docs", ".opblock"), ("/redoc", "[data-section-id]")])
def test_the_docs_render_offline(demo_server, tmp_path: Path, path: str, rendered: str) -> None:
    with chromium(tmp_path) as page:
        foreign: list[str] = []

        def only_this_server(route) -> None:
            if route.request.url.startswith(demo_server.url) or route.request.url.startswith(("data:", "blob:")):
                route.continue_()
            else:
                foreign.append(route.request.url)
                route.abort()

        page.route("**/*", only_this_server)
        page.goto(demo_server.url + path)
        page.wait_for_selector(rendered, timeout=30_000)
        page.wait_for_load_state("networkidle")
        assert "/v1/audio/speech" in page.inner_text("body")
        assert "/languages" in page.inner_text("body")
        page.screenshot(path=str(OUTPUT / f"docs{path.replace('/', '-')}.png"))
        refused = [m for m in page.console if "Content Security Policy" in m]
    assert foreign == []
    # The one thing the policy stops: ReDoc's logo from its maker's CDN.
    assert all("cdn.redoc.ly" in m for m in refused) and (path == "/redoc") == bool(refused), refused
