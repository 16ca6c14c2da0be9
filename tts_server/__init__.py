"""Internals of the HTTP server (settings, app factory, routes, errors, auth, admission, metrics, audio encoding).

The entry point is `cli.main` (the `qwen3-tts-server` command; `inference_server.py` delegates to it).
"""
