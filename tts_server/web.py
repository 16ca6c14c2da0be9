"""The page at `/`: pick a voice, type, hear it streamed, see time to first audio and the real-time factor, download
the result; where the server manages voices (TTS_VOICE_UPLOAD), add and delete voices.

One static file (`static/index.html`, no build step) that uses only the public API: the voices, the languages and
whether voices may be managed all come from it, none is written into the page. It carries no secret, so it is
served without a key; the API calls it makes send the key typed into the page."""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

WEB_PATHS = ("/",)

router = APIRouter()


@cache
def page() -> str:
    return files("tts_server").joinpath("static/index.html").read_text(encoding="utf-8")


def _hashes(tag: str, html: str) -> str:
    """CSP source expressions allowing exactly the page's own inline <tag> blocks."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)


@cache
def security_headers() -> dict[str, str]:
    """The page runs only its own inline script and style, talks only to this origin, plays blob: audio, and may not
    be framed (clickjacking: it holds an API key field)."""
    html = page()
    csp = "; ".join(
        (
            "default-src 'none'",
            f"script-src {_hashes('script', html)}",
            f"style-src {_hashes('style', html)}",
            "connect-src 'self'",
            "media-src blob:",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )
    return {
        "Content-Security-Policy": csp,
        "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index() -> HTMLResponse:
    return HTMLResponse(page(), headers={"Cache-Control": "no-cache", **security_headers()})
