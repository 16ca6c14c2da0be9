#!/usr/bin/env bash
# On the GPU machine (Python 3.12, torch 2.11 + CUDA 13, no package index): the vllm-omni backend beside the native
# engine in one device call (benchmarks/e2e/bench_vllm_omni.py: 1.7B random weights, 100 frames, 1/16/64 streams).
#
# What it needs there (docs/history/benchmarks-diary.md, "vLLM-Omni on the GPU machine", gives the exact `run` calls):
#   ~/parts/vllm.partNN   the vllm 0.26.0 wheel in parts (benchmarks/gpu/gpu_vllm_omni_wheels.sh cut it), moved there by
#                         the calls before this one, one call each, back to back;
#   .whl/vllm/small/      the other wheels of the vllm + vllm-omni 0.26 set, our vllm-omni-myfi plugin and
#                         order.txt (install order, the vllm wheel's name and sha256), carried by this call;
#   .whl/server/          our server's wheels (benchmarks/gpu/gpu_wheels.sh), carried by this call; only those the
#                         machine and the vllm set lack are installed (soxr...), apart from benchmarks/gpu/gpu_bench.sh's
#                         folder, so transformers keeps the machine's tokenizers;
#   .whl/tools/full_size_tokenizer/  the real Qwen2 tokenizer for the random checkpoint (as the native benchmark),
#                         carried by this call too.
#
# Then: join and check the wheel, install everything with `pip install --no-index --no-deps --target`, write the
# checkpoint (in the background, during the install), run the benchmark with vllm-omni first (its start-up is
# ~270 s there; native after it, if time is left) under a time guard that keeps the whole call under $LIMIT_S
# (default 560) seconds. Meanwhile it checks our deploy config's keys against vLLM-Omni 0.26 itself
# (qwen_tts.engines.vllm_omni.config_keys) and samples GPU memory and load every 5 s.
# Writes to $OUT (else bench_out/): vllm_omni.json, bench.log, setup.log, gpu.csv, config_keys.txt.
#
# Override: LIMIT_S, STAGE_CONFIG (default stage_config_optimized.yaml), CONCURRENCY (1,16,64), FRAMES (100),
# BACKENDS (vllm-omni,native), PARTS_DIR (~/parts), SITE_PREFIX (/tmp/site), PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)

PY=${PYTHON:-python3}
LIMIT_S=${LIMIT_S:-560}
OUT_DIR=${OUT:-bench_out}
PARTS=${PARTS_DIR:-$HOME/parts}
SMALL=.whl/vllm/small
SERVER=.whl/server
TOKENIZER=.whl/tools/full_size_tokenizer
SITE=${SITE_PREFIX:-/tmp/site}
STAGE_CONFIG=${STAGE_CONFIG:-stage_config_optimized.yaml}
mkdir -p "$OUT_DIR"
SETUP_LOG=$OUT_DIR/setup.log
: >"$SETUP_LOG"

trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # background jobs (checkpoint, samplers) end with the script
say() { echo "gpu_vllm_omni_bench: [$(($(date +%s) - T0)) s] $*" | tee -a "$SETUP_LOG"; }
die() { say "$*"; exit 2; }
PIP=("$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir)

for p in "$SMALL/order.txt" "$STAGE_CONFIG" benchmarks/e2e/bench_vllm_omni.py; do
  [ -f "$p" ] || die "$p is missing (carry .whl/vllm/small; run from the repository root)"
done
compgen -G "$SERVER/*.whl" >/dev/null || die "no wheels in $SERVER (carry .whl/server: benchmarks/gpu/gpu_wheels.sh)"
read -r _ vllm_name vllm_sha < <(grep '^vllm ' "$SMALL/order.txt") || die "no vllm line in $SMALL/order.txt"

# 1. The vllm wheel from its parts.
wheel=$HOME/$vllm_name
if [ ! -f "$wheel" ]; then
  compgen -G "$PARTS/vllm.part*" >/dev/null || die "no $PARTS/vllm.part* (carry the parts first)"
  cat "$PARTS"/vllm.part* >"$wheel.tmp"
  got=$(sha256sum "$wheel.tmp" | cut -d' ' -f1)
  [ "$got" = "$vllm_sha" ] || die "joined $(ls "$PARTS" | wc -l) parts: sha256 $got, want $vllm_sha (a part is missing?)"
  mv "$wheel.tmp" "$wheel"
fi
say "vllm wheel joined and checked: $wheel"

# 2. Our server's wheels that neither the machine nor the vllm set has, then the checkpoint in the background.
mapfile -t server_wheels < <("$PY" - "$SMALL/order.txt" "$SERVER"/*.whl <<'EOF'
import importlib.metadata as md
import re
import sys
from pathlib import Path


def project(wheel: str) -> str:
    return re.sub(r"[-_.]+", "-", Path(wheel).name.split("-")[0]).lower()


vllm_set = {project(w) for w in Path(sys.argv[1]).read_text().split() if w.endswith(".whl")}
for wheel in sys.argv[2:]:
    name = project(wheel)
    if name in vllm_set:
        continue
    try:
        md.version(name)  # the machine has it: keep the machine's (transformers checks tokenizers' version)
    except md.PackageNotFoundError:
        print(wheel)
EOF
)
if [ ! -f "$SITE-vllm-server/.installed" ] && [ "${#server_wheels[@]}" -gt 0 ]; then
  "${PIP[@]}" --target "$SITE-vllm-server" "${server_wheels[@]}" >>"$SETUP_LOG" 2>&1 ||
    die "pip install of the server wheels failed (see setup.log)"
  touch "$SITE-vllm-server/.installed"
fi
say "server wheels installed: ${server_wheels[*]##*/}"

CKPT=/tmp/vllm_omni_bench_ckpt/1.7b
tokenizer=""
[ -d "$TOKENIZER" ] && tokenizer=$TOKENIZER
if [ ! -f "$CKPT/.complete" ]; then
  PYTHONPATH="$SITE-vllm-server:$PWD" "$PY" - "$CKPT" "$tokenizer" >>"$SETUP_LOG" 2>&1 <<'EOF' &
import sys
from pathlib import Path

from qwen_tts.model.random_checkpoint import write_random_checkpoint

path = Path(sys.argv[1])
write_random_checkpoint(path, size="1.7b", seed=0, tokenizer_dir=sys.argv[2] or None)
(path / ".complete").touch()
print(f"checkpoint written: {path}")
EOF
  ckpt_pid=$!
fi

# 3. The vllm + vllm-omni 0.26 set in wheels.txt order, vllm after vllm_omni, our plugin last.
if [ ! -f "$SITE-vllm/.installed" ]; then
  mapfile -t small < <(grep -v '^vllm ' "$SMALL/order.txt")
  plugin=${small[-1]}
  wheels=()
  for w in "${small[@]::${#small[@]}-1}"; do wheels+=("$SMALL/$w"); done
  wheels+=("$wheel" "$SMALL/$plugin")
  "${PIP[@]}" --target "$SITE-vllm" "${wheels[@]}" >>"$SETUP_LOG" 2>&1 || die "pip install failed (see setup.log)"
  touch "$SITE-vllm/.installed"
fi
say "vllm set installed into $SITE-vllm"
if [ -n "${ckpt_pid:-}" ]; then
  wait "$ckpt_pid" || die "writing the random checkpoint failed (see setup.log)"
fi
[ -f "$CKPT/.complete" ] || die "no checkpoint at $CKPT"
say "checkpoint ready: $CKPT"

export PYTHONPATH="$SITE-vllm:$SITE-vllm-server:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_USE_FLASHINFER_SAMPLER=0  # flashinfer is not in the set: PyTorch's top-k/top-p sampler instead
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1  # no network there
export PYTHONUNBUFFERED=1

# 4. Beside the benchmark: the deploy config's keys against 0.26's own classes; GPU memory and load.
timeout 180 "$PY" -m qwen_tts.engines.vllm_omni.config_keys "$STAGE_CONFIG" >"$OUT_DIR/config_keys.txt" 2>&1 &
keys_pid=$!
nvidia-smi --query-gpu=timestamp,memory.used,memory.total,utilization.gpu --format=csv -l 5 >"$OUT_DIR/gpu.csv" 2>&1 &
smi_pid=$!

# 5. The benchmark, inside the time guard: no level starts within 40 s of the end, and a hard stop 5 s before it.
left=$((LIMIT_S - ($(date +%s) - T0)))
[ "$left" -ge 120 ] || die "only $left s of $LIMIT_S left after the set-up: not starting the benchmark"
say "starting the benchmark with $left s left; GPU: $(nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader)"
rc=0
timeout --kill-after=5 $((left - 5)) "$PY" benchmarks/e2e/bench_vllm_omni.py --model "$CKPT" --size 1.7b \
  --stage-config "$STAGE_CONFIG" --concurrency "${CONCURRENCY:-1,16,64}" --frames "${FRAMES:-100}" \
  --backends "${BACKENDS:-vllm-omni,native}" --time-budget-s $((left - 40)) --json "$OUT_DIR/vllm_omni.json" \
  >"$OUT_DIR/bench.log" 2>&1 || rc=$?
kill "$smi_pid" 2>/dev/null || true
wait "$keys_pid" 2>/dev/null && keys="none unread" || keys="see config_keys.txt"
say "benchmark exit status $rc; $STAGE_CONFIG keys against vLLM-Omni 0.26: $keys"
grep -E '^\[bench\]|^(backend|native|vllm-omni) ' "$OUT_DIR/bench.log" || true
if [ "$rc" -ne 0 ]; then
  echo "--- last lines of bench.log"
  tail -n 40 "$OUT_DIR/bench.log"
fi
grep 'is read by no code' "$OUT_DIR/config_keys.txt" || true
say "done; peak GPU memory $(awk -F', ' 'NR > 1 && $2 + 0 > m {m = $2 + 0} END {print m " MiB"}' "$OUT_DIR/gpu.csv")"
exit "$rc"
