#!/usr/bin/env bash
# Create .venv and install the project with its dev extras. Idempotent: re-runs only when pyproject.toml changed.
# On a machine without an NVIDIA GPU it installs a CPU build of torch first (TORCH_SPEC / TORCH_INDEX_URL override).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec=${TORCH_SPEC:-torch}
  else
    spec=${TORCH_SPEC:-torch==2.13.0}  # the CPU build on our dev and CI machines
  fi
  echo "setup: installing $spec"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${PIP[@]}" install "$spec" --index-url "$TORCH_INDEX_URL"
  else
    "${PIP[@]}" install "$spec"
  fi
fi

stamp="$VENV/.project-installed"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing the project and its dependencies"
  "${PIP[@]}" install -e ".[dev]"
  echo "$want" > "$stamp"
fi
