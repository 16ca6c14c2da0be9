#!/usr/bin/env bash
# Download, for the GPU benchmark machine (Python 3.12, manylinux x86_64, no package index), the wheels of the
# vllm + vllm-omni pair that matches its torch (vllm 0.26.0 + vllm-omni 0.26.0 for torch 2.11) plus a wheel of
# our vllm-omni-myfi plugin, into the git-ignored .whl/vllm/, laid out for carrying (one device call carries at
# most 64 MiB including the repository tree):
#   .whl/vllm/parts/vllm.partNN  the vllm wheel (~300 MB) cut into 50 MiB parts, one device call each;
#   .whl/vllm/small/             every other wheel (the small dependencies, vllm_omni, the plugin) and
#                                order.txt: the wheel file names in install order, the vllm wheel's name and
#                                sha256 last (benchmarks/gpu/gpu_vllm_omni_bench.sh joins the parts and checks them).
# The list is one NAME==VERSION a line, in install order, vllm last (comments and blank lines ignored); packages
# published only as an sdist (antlr4-python3-runtime) are built into a wheel here with `pip wheel --no-deps`.
# Platform tags up to manylinux_2_31 (llguidance 1.7.6 has no older build; the machine's glibc takes it).
#
#   VLLM_OMNI_WHEELS=path/wheels.txt bash benchmarks/gpu/gpu_vllm_omni_wheels.sh
#
# Prints each part's size and what the last part's call carries. docs/history/benchmarks-diary.md (vLLM-Omni on the GPU) lists
# the device calls.
set -euo pipefail
cd "$(dirname "$0")/../.."

LIST=${VLLM_OMNI_WHEELS:-${1:-}}
if [ -z "$LIST" ] || [ ! -f "$LIST" ]; then
  echo "usage: VLLM_OMNI_WHEELS=path/wheels.txt bash benchmarks/gpu/gpu_vllm_omni_wheels.sh" >&2
  exit 2
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
DEST=${WHEEL_DIR:-.whl}/vllm
PYV=${PY_VERSION:-3.12}   # the GPU machine's Python
PART_SIZE=${PART_SIZE:-50M}
LIMIT_MIB=64              # what one device call may carry, tree included
SDIST_ONLY=" antlr4-python3-runtime antlr4_python3_runtime "

PIP=("$PY" -m pip --disable-pip-version-check -q)
quiet() {  # run a pip command, showing its output only when it fails (the mirror warnings are noise)
  local log
  log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}

mapfile -t specs < <(grep -v '^\s*#' "$LIST" | sed 's/#.*//; s/\s*$//' | grep -v '^$')
[ "${#specs[@]}" -gt 0 ] || { echo "gpu_vllm_omni_wheels: no wheels listed in $LIST" >&2; exit 2; }
case "${specs[-1]}" in
  vllm==*) ;;
  *) echo "gpu_vllm_omni_wheels: the list's last line must be vllm==VERSION, got ${specs[-1]}" >&2; exit 2 ;;
esac

rm -rf "$DEST"
mkdir -p "$DEST/small" "$DEST/parts" "$DEST/download"
order=()
for spec in "${specs[@]}"; do
  name=${spec%%==*}
  before=$(ls "$DEST/download")
  if [[ "$SDIST_ONLY" == *" $name "* ]]; then
    quiet "${PIP[@]}" wheel --no-deps -w "$DEST/download" "$spec"
  else
    quiet "${PIP[@]}" download --no-deps --only-binary=:all: \
      --python-version "$PYV" --implementation cp --abi "cp${PYV/./}" --abi abi3 --abi none \
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d "$DEST/download" "$spec"
  fi
  new=$(comm -13 <(echo "$before") <(ls "$DEST/download"))
  [ "$(echo "$new" | grep -c '\.whl$')" = 1 ] || { echo "gpu_vllm_omni_wheels: $spec gave: ${new:-nothing}" >&2; exit 1; }
  order+=("$new")
done
echo "gpu_vllm_omni_wheels: ${#order[@]} wheels downloaded"

quiet "${PIP[@]}" wheel --no-deps -w "$DEST/download" ./vllm-omni-myfi
plugin=$(cd "$DEST/download" && ls vllm_omni_myfi-*.whl)
rm -rf vllm-omni-myfi/build

vllm_whl=${order[-1]}
for whl in "${order[@]::${#order[@]}-1}" "$plugin"; do
  mv "$DEST/download/$whl" "$DEST/small/"
done
{
  printf '%s\n' "${order[@]::${#order[@]}-1}" "$plugin"
  echo "vllm $vllm_whl $(sha256sum "$DEST/download/$vllm_whl" | cut -d' ' -f1)"
} >"$DEST/small/order.txt"
split -b "$PART_SIZE" -d -a 2 "$DEST/download/$vllm_whl" "$DEST/parts/vllm.part"
rm -rf "$DEST/download"

mib() { du -cb --apparent-size "$@" | tail -1 | awk '{printf "%.1f", $1 / 1048576}'; }
tree=$(git ls-files -z | du -cb --apparent-size --files0-from=- | tail -1 | awk '{printf "%.1f", $1 / 1048576}')
extras=()
for d in .whl/server .whl/tools; do [ -d "$d" ] && extras+=("$d"); done
last=$(ls "$DEST/parts" | tail -1)
echo "gpu_vllm_omni_wheels: $vllm_whl in $(ls "$DEST/parts" | wc -l) parts ($(mib "$DEST/parts") MiB):"
for f in "$DEST"/parts/*; do echo "  $f $(mib "$f") MiB"; done
echo "gpu_vllm_omni_wheels: $DEST/small $(mib "$DEST/small") MiB ($(ls "$DEST/small"/*.whl | wc -l) wheels + order.txt)"
for d in "${extras[@]}"; do echo "gpu_vllm_omni_wheels: $d $(mib "$d") MiB"; done
echo "gpu_vllm_omni_wheels: repository tree $tree MiB (counted as ${TREE_MIB:-10} MiB below, for what the tree may grow to)"
# Does the last part fit in one call beside everything the benchmark call carries?
awk -v part="$(mib "$DEST/parts/$last")" -v rest="$(mib "$DEST/small" "${extras[@]}")" -v tree="${TREE_MIB:-10}" \
  -v limit="$LIMIT_MIB" -v last="$last" 'BEGIN {
    if (part + rest + tree < limit)
      printf "gpu_vllm_omni_wheels: the last part'"'"'s call can carry %s + small + %s: %.1f MiB\n", last, "server/tools", part + rest + tree
    else
      printf "gpu_vllm_omni_wheels: %s + small + server/tools = %.1f MiB > %d: the parts go in their own calls, then one call carries small + server/tools (%.1f MiB) and runs the benchmark\n", last, part + rest + tree, limit, rest + tree
  }'
