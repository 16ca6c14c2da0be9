# Sourced by the setup scripts: `venv_torch VENV LABEL` creates the venv VENV if it is missing and installs torch
# into it unless it is there: the default build on a machine with an NVIDIA GPU, else the CPU build our dev and CI
# machines use (TORCH_SPEC / TORCH_INDEX_URL override). Sets PIP to VENV's pip. Needs PYTHON.
venv_torch() {
  local venv=$1 label=$2 spec
  if [ ! -x "$venv/bin/python" ]; then
    echo "$label: creating $venv with $($PYTHON --version)"
    "$PYTHON" -m venv "$venv"
  fi
  PIP=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      spec=${TORCH_SPEC:-torch}
    else
      spec=${TORCH_SPEC:-torch==2.13.0}  # the CPU build on our dev and CI machines
    fi
    echo "$label: installing $spec"
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
      "${PIP[@]}" install "$spec" --index-url "$TORCH_INDEX_URL"
    else
      "${PIP[@]}" install "$spec"
    fi
  fi
}
