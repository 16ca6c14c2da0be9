#!/usr/bin/env bash
# Set up (first run only), then lint, check the import rules (pyproject.toml [tool.importlinter]) and run the
# whole test suite. Extra arguments go to pytest. .venv-ray (scripts/setup_ray.sh) serves the Ray Serve tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_ray.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports --no-cache
exec .venv/bin/python -m pytest "$@"
