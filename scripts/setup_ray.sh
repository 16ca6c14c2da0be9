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
want=$(cat pyproject.toml scripts/setup_ray.sh scripts/venv_torch.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
# shellcheck source=scripts/venv_torch.sh
source scripts/venv_torch.sh
venv_torch "$VENV" setup_ray

echo "setup_ray: installing the project with its ray extra"
"${PIP[@]}" install -e ".[ray]"
echo "$want" > "$stamp"
