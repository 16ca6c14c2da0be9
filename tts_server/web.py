"""The page at `/`: pick a voice, type, hear it streamed, see time to first audio and the real-time factor.

One static file (`static/index.html`, no build step) that uses only the public API. It carries no secret, so it
is served without a key; the API calls it makes send the key typed into the page."""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

WEB_PATHS = ("/",)

router = APIRouter()


@cache
def page() -> str:
    return files("tts_server").joinpath("static/index.html").read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index() -> HTMLResponse:
    return HTMLResponse(page(), headers={"Cache-Control": "no-cache"})
