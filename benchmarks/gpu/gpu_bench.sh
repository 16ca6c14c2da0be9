#!/usr/bin/env bash
# On the GPU machine: install the carried wheels (benchmarks/gpu/gpu_wheels.sh put them in .whl/) into /tmp/site-*
# folders, then run the whole benchmark (benchmarks/e2e/bench_gpu.py) with the right Python paths. Extra arguments go
# to the benchmark (say --sizes 1.7b --profile, or --parts reference,peer).
#
# Baselines run when their scripts sit in $TOOLS_DIR (default .whl/tools/: reference_baseline.py, peer_baseline.py
# and full_size_tokenizer/, which also gives our full-size checkpoints the real text tokenizer) and their wheels
# in .whl/reference/ and .whl/peer/. JSON goes to $OUT/bench_gpu.json when $OUT is set, else bench_out/.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
WHL=${WHEEL_DIR:-.whl}
TOOLS=${TOOLS_DIR:-$WHL/tools}
SITE=${SITE_PREFIX:-/tmp/site}
OUT_DIR=${OUT:-bench_out}

install() {  # install <wheel folder> <target>: true when the target is usable
  local dir=$1 target=$2
  compgen -G "$dir/*.whl" >/dev/null || return 1
  if [ ! -f "$target/.installed" ]; then
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$target" "$dir"/*.whl
    touch "$target/.installed"
  fi
}

t0=$(date +%s)
install "$WHL/server" "$SITE-server" || { echo "gpu_bench: no wheels in $WHL/server (run benchmarks/gpu/gpu_wheels.sh)" >&2; exit 2; }
args=()
if [ -f "$TOOLS/reference_baseline.py" ] && install "$WHL/reference" "$SITE-reference"; then
  args+=(--reference-script "$TOOLS/reference_baseline.py" --reference-site "$SITE-reference")
fi
if [ -f "$TOOLS/peer_baseline.py" ] && install "$WHL/peer" "$SITE-peer"; then
  args+=(--peer-script "$TOOLS/peer_baseline.py" --peer-site "$SITE-peer")
fi
if [ -d "$TOOLS/full_size_tokenizer" ]; then
  args+=(--tokenizer-dir "$TOOLS/full_size_tokenizer")
fi
echo "gpu_bench: wheels installed in $(($(date +%s) - t0)) s; baselines: ${args[*]:-none}" >&2

export PYTHONPATH="$SITE-server:$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
# The device runs a command for at most 600 s: stop starting parts after 500 s so the table still prints.
exec "$PY" benchmarks/e2e/bench_gpu.py --time-budget-s "${TIME_BUDGET_S:-500}" "${args[@]}" \
  --out "$OUT_DIR/bench_gpu.json" "$@"
