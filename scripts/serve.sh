#!/usr/bin/env bash
# Set up .venv (first run only: the project and its runtime dependencies, no test tools; scripts/install.sh) and
# start the server on $TTS_HOST:$TTS_PORT (default 0.0.0.0:8090). With no TTS_MODEL_PATH it serves the built-in
# tiny demo checkpoint and the demo voice, offline. scripts/test.sh adds the dev tools to the same .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --editable .venv
exec .venv/bin/python inference_server.py "$@"
