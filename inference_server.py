"""Qwen3-TTS voice-cloning HTTP server: `python inference_server.py` (configured by TTS_* variables).

A thin entry point over `tts_server` (app factory, routes, admission, auth, metrics) and `qwen_tts` (the
engine). Also usable as `uvicorn --factory inference_server:create_app`.
"""

from __future__ import annotations

import sys

from tts_server.app import create_app
from tts_server.serve import main

__all__ = ["create_app", "main"]

if __name__ == "__main__":
    sys.exit(main())
