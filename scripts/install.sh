#!/usr/bin/env bash
# Install the project into a virtual environment: the one install recipe. scripts/serve.sh, scripts/setup.sh
# (the dev environment), scripts/setup_ray.sh, the Dockerfile and tests/test_install.py all run it.
#
#   scripts/install.sh [--extras LIST] [--editable] [--project DIR|WHEEL] [--pin SPEC]... VENV
#
#   VENV        the environment, created with $PYTHON (default python3) if it does not exist
#   --extras    comma-separated extras of pyproject.toml (dev: the test and lint tools; ray; speed; vllm); none
#               by default: a serving environment gets the runtime dependencies only
#   --editable  install the checkout in place (pip -e), for a development checkout
#   --project   what to install: a source directory or a built wheel (default: the checkout holding this script)
#   --pin SPEC  hold a dependency to SPEC (e.g. ray==2.60.0), as a pip constraint; repeatable
#
# Steps: torch first, the CPU build on a machine without an NVIDIA GPU (scripts/venv_torch.sh: TORCH_VARIANT,
# TORCH_SPEC, TORCH_INDEX_URL); then the project, with torch held to the build just installed so no dependency
# can replace it; then checks (torch is still of that variant, the console scripts exist).
# Idempotent: with the same inputs (pyproject.toml or the wheel, these scripts, the options) and no extra beyond
# those already installed it does nothing; the key is kept in VENV/.qwen3-tts-installed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
label=install

extras=""
editable=0
project=$(dirname "$here")
pins=()
venv=""
while [ $# -gt 0 ]; do
  case "$1" in
    --extras) extras=${2:?--extras needs a list}; shift 2 ;;
    --editable) editable=1; shift ;;
    --project) project=${2:?--project needs a path}; shift 2 ;;
    --pin) pins+=("${2:?--pin needs a requirement}"); shift 2 ;;
    -h | --help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "$label: unknown option $1 (see --help)" >&2; exit 2 ;;
    *)
      [ -z "$venv" ] || { echo "$label: one VENV only (got $venv and $1)" >&2; exit 2; }
      venv=$1; shift ;;
  esac
done
[ -n "$venv" ] || { echo "$label: usage: scripts/install.sh [options] VENV (see --help)" >&2; exit 2; }
if [ -d "$project" ]; then
  project=$(cd "$project" && pwd)
  inputs="$project/pyproject.toml"
elif [ -f "$project" ] && [ "$editable" = 0 ]; then
  project=$(cd "$(dirname "$project")" && pwd)/$(basename "$project")
  inputs=$project
else
  echo "$label: --project must be a source directory (or, without --editable, a wheel): $project" >&2
  exit 2
fi

# Extras as a sorted, de-duplicated list; the key names everything else the result depends on.
extras=$(tr ',' '\n' <<<"$extras" | sed '/^$/d' | sort -u | paste -sd, -)
key=$(cat "$inputs" "$here/install.sh" "$here/venv_torch.sh" | sha256sum | cut -d' ' -f1)
key="$key editable=$editable project=$project pins=${pins[*]:-} torch=${TORCH_VARIANT:-auto},${TORCH_SPEC:-}"
stamp="$venv/.qwen3-tts-installed"
if [ -f "$stamp" ] && [ -x "$venv/bin/python" ] && [ "$(sed -n 1p "$stamp")" = "$key" ]; then
  have=$(sed -n 2p "$stamp")
  missing=$(comm -23 <(tr ',' '\n' <<<"$extras" | sed '/^$/d') <(tr ',' '\n' <<<"$have" | sed '/^$/d' | sort -u))
  if [ -z "$missing" ]; then
    exit 0
  fi
  extras=$(printf '%s\n%s\n' "$extras" "$have" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)
fi

# shellcheck source=scripts/venv_torch.sh
source "$here/venv_torch.sh"
venv_torch "$venv" "$label"
torch_version=$(PYTHONWARNINGS=ignore "$venv/bin/python" -c "import torch; print(torch.__version__)")
constraints="$venv/.qwen3-tts-constraints.txt"
printf '%s\n' "torch==$torch_version" "${pins[@]}" >"$constraints"

target=$project
[ -z "$extras" ] || target="${project}[${extras}]"
echo "$label: installing ${target#"$(dirname "$project")/"} into $venv (torch $torch_version held)"
if [ "$editable" = 1 ]; then
  "${PIP[@]}" install -c "$constraints" -e "$target"
else
  "${PIP[@]}" install -c "$constraints" "$target"
fi

torch_check "$venv" "$label" "$TORCH_VARIANT_USED"
for script in qwen3-tts-server qwen3-tts-extract qwen3-tts-batch; do
  [ -x "$venv/bin/$script" ] || { echo "$label: $venv/bin/$script was not installed" >&2; exit 1; }
done
printf '%s\n%s\n' "$key" "$extras" >"$stamp"
