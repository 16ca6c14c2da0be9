#!/usr/bin/env bash
# The development environment: .venv with the project in place (editable) and its `dev` extra (the test and lint
# tools, and the speed extra whose tests run). scripts/test.sh runs it; scripts/install.sh does the work
# (idempotent: it re-runs only when its inputs change). On a machine without an NVIDIA GPU torch is the CPU build
# (TORCH_VARIANT / TORCH_SPEC / TORCH_INDEX_URL override: scripts/venv_torch.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/install.sh --extras dev --editable "${VENV:-.venv}"
