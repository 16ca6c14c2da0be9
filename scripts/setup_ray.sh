#!/usr/bin/env bash
# Create .venv-ray: the project with its `ray` extra (Ray Serve), for scripts/serve_ray.sh and the Ray tests.
# Ray is heavy, so it lives in its own venv, not in .venv. Idempotent and keyed: it reinstalls only when
# pyproject.toml or this script changed (the key is kept in .venv-ray/.ray-installed).
# On a machine without an NVIDIA GPU it installs a CPU build of torch first (TORCH_SPEC / TORCH_INDEX_URL override).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${RAY_VENV:-.venv-ray}
stamp="$VENV/.ray-installed"
want=$(cat pyproject.toml scripts/setup_ray.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup_ray: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec=${TORCH_SPEC:-torch}
  else
    spec=${TORCH_SPEC:-torch==2.13.0}  # the CPU build on our dev and CI machines
  fi
  echo "setup_ray: installing $spec"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${PIP[@]}" install "$spec" --index-url "$TORCH_INDEX_URL"
  else
    "${PIP[@]}" install "$spec"
  fi
fi

echo "setup_ray: installing the project with its ray extra"
"${PIP[@]}" install -e ".[ray]"
echo "$want" > "$stamp"
