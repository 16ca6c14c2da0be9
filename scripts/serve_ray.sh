#!/usr/bin/env bash
# Set up .venv-ray (first run only) and start the server on Ray Serve on this machine: one replica per GPU
# (one on a machine without GPUs), the proxy on $TTS_HOST:$TTS_PORT (default 0.0.0.0:8090). Arguments go to
# `python -m tts_serve` (--replicas N, --address auto, ...); see docs/deployment.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_ray.sh
exec .venv-ray/bin/python -m tts_serve "$@"
