#!/usr/bin/env bash
# Create .venv and install the project with its dev extras. Idempotent: re-runs only when pyproject.toml changed.
# On a machine without an NVIDIA GPU it installs a CPU build of torch first (TORCH_SPEC / TORCH_INDEX_URL override).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
# shellcheck source=scripts/venv_torch.sh
source scripts/venv_torch.sh
venv_torch "$VENV" setup

stamp="$VENV/.project-installed"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing the project and its dependencies"
  "${PIP[@]}" install -e ".[dev]"
  echo "$want" > "$stamp"
fi
