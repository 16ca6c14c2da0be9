#!/usr/bin/env bash
# Set up (first run only) and start the server on $TTS_HOST:$TTS_PORT (default 0.0.0.0:8090).
# With no TTS_MODEL_PATH it serves the built-in tiny demo checkpoint and the demo voice, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python inference_server.py "$@"
