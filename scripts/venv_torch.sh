# shellcheck shell=bash
# Sourced by scripts/install.sh: `venv_torch VENV LABEL` creates the venv VENV (with $PYTHON) if it is missing,
# installs torch into it unless it is there, and sets PIP to VENV's pip. Which build:
#
#   TORCH_VARIANT    auto (default): cuda where `nvidia-smi -L` lists a GPU, else cpu. Set it where there is
#                    nothing to detect: a container build (the Dockerfile sets it).
#   TORCH_SPEC       what to install (default torch==2.13.0, the build our dev and CI machines use).
#   TORCH_INDEX_URL  the one index torch comes from (default: cuda, pip's own indexes; cpu, see below).
#
# cpu never asks pip's default index for torch: PyPI's Linux torch is the CUDA build (18 nvidia-* packages, about
# 5.5 GB). Unless TORCH_INDEX_URL says where, the CPU build comes from a wheel already on this machine (pip's
# find-links: PIP_FIND_LINKS or pip.conf, looked up without network) or else from PyTorch's CPU index
# (TORCH_CPU_INDEX_URL), which holds no CUDA builds; if neither has it, it stops and says what to do.
# Either variant is checked after the install: cpu needs torch.version.cuda None and no nvidia-* package, cuda a
# torch.version.cuda.
TORCH_CPU_INDEX_URL=${TORCH_CPU_INDEX_URL:-https://download.pytorch.org/whl/cpu}

# Prints the version of a CPU build (a +cpu version) of SPEC among pip's find-links (no index, no network), or
# nothing.
local_cpu_torch() {
  local venv=$1 spec=$2 report
  report=$(mktemp)
  if "${PIP[@]}" install --dry-run --no-index --no-deps --ignore-installed --report "$report" "$spec" \
    >/dev/null 2>&1; then
    "$venv/bin/python" - "$report" <<'PY'
import json
import sys

for item in json.load(open(sys.argv[1], encoding="utf-8"))["install"]:
    if item["metadata"]["name"].lower() == "torch" and item["metadata"]["version"].endswith("+cpu"):
        print(item["metadata"]["version"])
PY
  fi
  rm -f "$report"
}

# Exits 1 unless VENV's torch is of VARIANT (cpu: torch.version.cuda is None and no nvidia-* package is installed).
torch_check() {
  local venv=$1 label=$2 variant=$3
  PYTHONWARNINGS=ignore "$venv/bin/python" - "$label" "$variant" <<'PY'
import sys
from importlib.metadata import distributions

import torch

label, variant = sys.argv[1:]
nvidia = sorted({d.metadata["Name"] for d in distributions() if d.metadata["Name"].lower().startswith("nvidia-")})
if variant == "cpu" and (torch.version.cuda is not None or nvidia):
    sys.exit(
        f"{label}: this environment's torch {torch.__version__} is a CUDA build (CUDA {torch.version.cuda}; "
        f"{len(nvidia)} nvidia-* packages) on a machine set up for CPU. Remove the environment and run again, "
        f"with TORCH_VARIANT=cuda if the GPU build is what you want."
    )
if variant == "cuda" and torch.version.cuda is None:
    sys.exit(
        f"{label}: this environment's torch {torch.__version__} has no CUDA; set TORCH_SPEC / TORCH_INDEX_URL to "
        f"a CUDA build (https://pytorch.org/get-started/locally/)."
    )
PY
}

venv_torch() {
  local venv=$1 label=$2 spec variant=${TORCH_VARIANT:-auto} found source
  local -a index=()
  if [ "$variant" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      variant=cuda
    else
      variant=cpu
    fi
  fi
  case "$variant" in
    cpu | cuda) ;;
    *)
      echo "$label: TORCH_VARIANT must be auto, cpu or cuda, not '$variant'" >&2
      return 1
      ;;
  esac
  # shellcheck disable=SC2034  # read by scripts/install.sh
  TORCH_VARIANT_USED=$variant
  if [ ! -x "$venv/bin/python" ]; then
    echo "$label: creating $venv with $($PYTHON --version)"
    "$PYTHON" -m venv "$venv"
  fi
  PIP=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  if "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    return 0
  fi
  spec=${TORCH_SPEC:-torch==2.13.0}
  source="pip's indexes"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    index=(--index-url "$TORCH_INDEX_URL")
    source=$TORCH_INDEX_URL
  elif [ "$variant" = cpu ]; then
    found=$(local_cpu_torch "$venv" "$spec")
    if [ -n "$found" ]; then
      spec="torch==$found"  # with its +cpu label: no index can answer this with a CUDA build
      source="a wheel on this machine"
    else
      index=(--index-url "$TORCH_CPU_INDEX_URL")
      source=$TORCH_CPU_INDEX_URL
    fi
  fi
  echo "$label: installing $spec ($variant build, from $source)"
  if ! "${PIP[@]}" install "${index[@]}" "$spec"; then
    if [ "$variant" = cpu ]; then
      cat >&2 <<EOF
$label: could not install a CPU build of $spec from $source. Nothing was taken from PyPI's default
index, whose Linux torch is the CUDA build (about 5.5 GB). Do one of:
  - set TORCH_INDEX_URL to an index that has the CPU build (a mirror of $TORCH_CPU_INDEX_URL), or put the
    CPU wheel in a directory pip looks in (PIP_FIND_LINKS=DIR); TORCH_SPEC picks the version;
  - install a CPU build of torch into $venv yourself, then run this again;
  - set TORCH_VARIANT=cuda to install the CUDA build instead.
EOF
    fi
    return 1
  fi
  torch_check "$venv" "$label" "$variant"
}
