#!/usr/bin/env bash
# Create .venv-ray: the project with its `ray` extra (Ray Serve), for scripts/serve_ray.sh and the Ray tests.
# Ray is heavy, so it lives in its own venv, not in .venv. scripts/install.sh does the work (idempotent: it
# reinstalls only when pyproject.toml or the install scripts changed). On a machine without an NVIDIA GPU torch is
# the CPU build (TORCH_VARIANT / TORCH_SPEC / TORCH_INDEX_URL override: scripts/venv_torch.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/install.sh --extras ray --editable "${RAY_VENV:-.venv-ray}"
