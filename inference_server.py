"""Qwen3-TTS voice-cloning HTTP server: `python inference_server.py`, the same as the `qwen3-tts-server` command
(flags, TTS_* variables, a .env file: `--help`).

A thin entry point over `tts_server` (command line, app factory, routes, admission, auth, metrics) and `qwen_tts`
(the engine). Also usable as `uvicorn --factory inference_server:create_app`.
"""

from __future__ import annotations

import sys

from fastapi import FastAPI

from tts_server import app as _app
from tts_server.cli import main

__all__ = ["create_app", "main"]


def create_app(*args, **kwargs) -> FastAPI:
    """`tts_server.app.create_app` for `uvicorn --factory`: the app starts its own engine and, once it is up,
    freezes the start-up heap out of full garbage collections as `python inference_server.py` does."""
    kwargs.setdefault("freeze_heap", True)
    return _app.create_app(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
