"""The page at `/` (tts_server/static/index.html) in a real headless Chromium (Debian's `chromium`, driven by
Playwright; no browser is downloaded): synthesize with the demo voice over the real server process, hear it
streamed through Web Audio to its end, read time to first audio and the real-time factor off the page. The
screenshot goes to test-output/web/ (TTS_TEST_OUTPUT overrides the folder)."""

from __future__ import annotations

import os
import re
import shutil
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
    for path in ('"/speakers"', '"/v1/audio/speech"', '"/v1/audio/voices"'):
        assert path in r.text
    assert "/synthesize" not in r.text.split("<script>")[1]  # the page speaks the OpenAI route only


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
    root = tmp_path_factory.mktemp("web")
    resolve_model_path("demo", demo_dir=root / "demo-tiny")
    env = demo_env(root, TTS_MAX_NEW_TOKENS=str(CAP), TTS_REQUEST_TIMEOUT="120")
    with server_process(env, root / "server.log") as srv:
        yield srv


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium; .ci/run does)")
def test_the_page_plays_a_streamed_result_in_headless_chromium(demo_server, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    assert httpx.get(demo_server.url + "/speakers").json()["count"] >= 1
    OUTPUT.mkdir(parents=True, exist_ok=True)
    console: list[str] = []
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a fresh profile
            executable_path=CHROMIUM,
            headless=True,
            args=[*CHROMIUM_FLAGS, "--autoplay-policy=no-user-gesture-required"],
        )
        try:
            page = context.new_page()
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            requests: list[str] = []
            page.on("request", lambda r: requests.append(r.url.removeprefix(demo_server.url)))
            page.goto(demo_server.url + "/")
            page.wait_for_function("() => document.getElementById('status').textContent === 'ready'", timeout=30_000)
            assert page.input_value("#voice") == "demo"
            assert page.is_hidden("#upload")  # this server reports no upload
            page.fill("#text", "Hello from the demo voice.")
            page.click("#speak")
            page.wait_for_function(
                "() => ['played'].includes(document.getElementById('status').textContent)"
                " || document.getElementById('status').className === 'error'",
                timeout=60_000,
            )
            page.screenshot(path=str(OUTPUT / "page-played.png"), full_page=True)
            status = page.text_content("#status")
            assert status == "played", (status, console)
            samples = int(page.evaluate("() => document.body.dataset.samples"))
            assert 0 < samples <= CAP * FRAME and samples % FRAME == 0
            played_until = float(page.evaluate("() => document.body.dataset.played"))
            assert played_until >= samples / 24000  # the audio clock ran through the whole result
            ttfa = page.text_content("#ttfa")
            assert ttfa.endswith(" ms") and 0 < int(ttfa.removesuffix(" ms")) < 60_000
            assert float(page.text_content("#rtf")) > 0
            assert page.is_visible("#result")  # the whole result, for replay or download
            api = [u for u in requests if u != "/" and not u.startswith("blob:")]  # blob: the page's own WAV
            assert set(api) <= {"/speakers", "/v1/audio/voices", "/v1/audio/speech"}, api
            assert "/v1/audio/speech" in api
            # The page's own script and style run under its Content-Security-Policy, and nothing it does is refused.
            assert not [m for m in console if "Content Security Policy" in m], console

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
            page.wait_for_function("() => document.getElementById('status').textContent === 'ready'", timeout=30_000)
            page.wait_for_selector("#upload", state="visible", timeout=10_000)
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
        finally:
            context.close()
    assert (OUTPUT / "page-played.png").stat().st_size > 1000
