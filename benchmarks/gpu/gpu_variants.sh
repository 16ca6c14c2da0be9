#!/usr/bin/env bash
# On the GPU machine: measure the engine's kernel variants against its defaults (docs/performance.md) in as few
# device calls as possible. Installs the carried wheels (.whl/server, .whl/test; benchmarks/gpu/gpu_wheels.sh) like
# gpu_bench.sh, then runs the stages named on the command line, in order, each under its own time limit so that one
# device call (600 s at most) can hold several. Logs and JSON go to $OUT (else bench_out/variants).
#
#   bash benchmarks/gpu/gpu_variants.sh tests gemm      # <= 10 min: the CUDA tests but the engine's, the matmuls
#   bash benchmarks/gpu/gpu_variants.sh tests-engine    # <= 8 min: the engine's CUDA tests
#   bash benchmarks/gpu/gpu_variants.sh checks          # <= 7 min: determinism across requests and processes
#   bash benchmarks/gpu/gpu_variants.sh profile engine  # <= 9.5 min: the step and Code2Wav; the engine per variant
#   bash benchmarks/gpu/gpu_variants.sh attention       # <= 2 min: the attention kernels alone
#   bash benchmarks/gpu/gpu_variants.sh teacher-forced  # <= 4 min a size: top-1 agreement with the official package
#
# Stages: tests, tests-engine (the engine's CUDA tests), checks (the CUDA cases of tests/test_determinism.py and
# tests/test_reproducible.py), pytest (the tests PYTEST_ARGS names), stack (the one-kernel code predictor stack: its
# passes alone, STACK_MODES naming bench_stack.py's modes, then its tests), sampler (the sampler kernel alone),
# attention, gemm, profile, step (the frame step alone, per STEP_SIZES), codec (Code2Wav alone), engine,
# teacher-forced (tests/reference/make_fixture.py --teacher-forced per TF_SIZES, with the official package from
# .whl/reference; benchmarks/gpu/gpu_wheels.sh with REFERENCE_WHEELS). VARIANTS overrides the engine stage's variant
# list, CODEC_VARIANTS the Code2Wav variants of the profile and codec stages, STEP_VARIANTS the step stage's.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
WHL=${WHEEL_DIR:-.whl}
SITE=${SITE_PREFIX:-/tmp/site}
OUT_DIR=${OUT:-bench_out}/variants
VARIANTS=${VARIANTS:-}
DEFAULT_STEP=fused-split+small-m+cp-one-pass+kernel-sampler
STEP_VARIANTS=${STEP_VARIANTS:-$DEFAULT_STEP}
STEP_SIZES=${STEP_SIZES:-1.7b 0.6b}
CODEC_VARIANTS=${CODEC_VARIANTS:-fp16+polyphase-9,fp16+polyphase-9+snake-kernel}

[ $# -gt 0 ] || { sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2; exit 2; }
for stage in "$@"; do
  case $stage in tests | tests-engine | checks | pytest | stack | sampler | attention | gemm | profile | step | codec | engine | teacher-forced) ;; *) echo "gpu_variants: unknown stage $stage" >&2; exit 2 ;; esac
done

# The same folder as gpu_bench.sh's, which installs the server's wheels only: the test wheels (pytest-asyncio)
# have a marker of their own, so a machine that ran gpu_bench.sh first still gets them.
if [ ! -f "$SITE-server/.installed-with-tests" ]; then
  compgen -G "$WHL/server/*.whl" >/dev/null || { echo "gpu_variants: no wheels in $WHL/server" >&2; exit 2; }
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$SITE-server" --upgrade \
    "$WHL"/server/*.whl $(compgen -G "$WHL/test/*.whl" || true)
  touch "$SITE-server/.installed" "$SITE-server/.installed-with-tests"
fi
export PYTHONPATH="$SITE-server:$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
tokenizer=()  # the real text tokenizer for the full-size checkpoints, as gpu_bench.sh passes it
[ -d "$WHL/tools/full_size_tokenizer" ] && tokenizer=(--tokenizer-dir "$WHL/tools/full_size_tokenizer")

run() {  # run <name> <seconds> <command...>: its output to the terminal and $OUT_DIR/<name>.log
  local name=$1 limit=$2
  shift 2
  echo "gpu_variants: $name (limit ${limit}s): $*" >&2
  local t0
  t0=$(date +%s)
  timeout "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log" || echo "gpu_variants: $name exited with ${PIPESTATUS[0]}" >&2
  echo "gpu_variants: $name took $(($(date +%s) - t0)) s" >&2
}

for stage in "$@"; do
  case $stage in
    tests)  # the kernels, the fused path, Code2Wav, the engine against the reference loop (75 cases, ~4 min)
      run tests 360 "$PY" -m pytest -q -p no:cacheprovider -W ignore --tb=short -rf -o log_level=WARNING \
        tests/test_fused.py tests/test_decoder.py tests/test_codec_decoder.py tests/test_engine_reference.py \
        -k "cuda or attention or small_m or split_k or fp16 or fused"
      run kernel-tests 120 "$PY" -m pytest -q -p no:cacheprovider -W ignore --tb=short -rf tests/test_sample_kernel.py \
        tests/test_snake_kernel.py
      ;;
    tests-engine)  # the engine's CUDA cases: graphs == eager, batch invariance per kernel variant (24 cases)
      run tests-engine 480 "$PY" -m pytest -q -p no:cacheprovider -W ignore --tb=short -rf -o log_level=WARNING \
        tests/test_engine.py -k "cuda or attention or small_m or split_k or fp16 or fused"
      ;;
    checks)  # a request alone and batched, bit for bit; two fresh processes, bit for bit (0.6B random weights)
      run checks 420 "$PY" -m pytest -q -p no:cacheprovider -W ignore --tb=short -rf -o log_level=WARNING \
        tests/test_determinism.py tests/test_reproducible.py -k cuda
      ;;
    stack)  # the code predictor's passes alone (the fused path's kernels against the one-kernel stack), then its tests; STACK_PROFILE_MODE: the phase profile's options
      run stack 240 "$PY" benchmarks/kernels/bench_stack.py --rows 1,2,4,8,16 ${STACK_MODES:+--modes "$STACK_MODES"} ${STACK_PROFILE_MODE:+--profile-mode "$STACK_PROFILE_MODE"} --out "$OUT_DIR/stack.json"
      run stack-tests 300 "$PY" -m pytest -q -p no:cacheprovider -W ignore --tb=short -rf tests/test_stack_kernel.py
      ;;
    sampler)
      run sampler 120 "$PY" benchmarks/kernels/bench_sampler.py --batches 2,64,256 --warp-elements 256,512,1024,2048 \
        --out "$OUT_DIR/sampler.json"
      ;;
    pytest)  # the tests PYTEST_ARGS names (e.g. one failing case with --tb=long)
      # shellcheck disable=SC2086
      run pytest 300 "$PY" -m pytest -q -p no:cacheprovider -W ignore -rf --durations=15 ${PYTEST_ARGS:?set PYTEST_ARGS}
      ;;
    attention)
      run attention 120 "$PY" benchmarks/kernels/bench_attention.py --batches 1,8,64,256 --positions 100,300,1000 \
        --out "$OUT_DIR/attention.json"
      ;;
    gemm)
      run gemm 180 "$PY" benchmarks/kernels/bench_gemm.py --size 1.7b --rows 2,4,8,16 --configs 16,32x128,256x3,4 \
        --max-splits 1,2,4 --out "$OUT_DIR/gemm.json"
      ;;
    profile)
      run profile 240 "$PY" benchmarks/profiles/profile_step.py --size 1.7b --batches 1,64 \
        --variants fused-split+small-m+cp-one-pass+kernel-sampler,fused-split+small-m,fused-split+small-m+kernel-sampler \
        --codec-batches 64 --codec-variants "$CODEC_VARIANTS" --out "$OUT_DIR/profile.json"
      ;;
    step)
      for size in $STEP_SIZES; do
        run "step-$size" 240 "$PY" benchmarks/profiles/profile_step.py --size "$size" --batches 1,64 --variants "$STEP_VARIANTS" \
          --codec-batches "" --out "$OUT_DIR/step-$size.json"
      done
      ;;
    codec)
      run codec 120 "$PY" benchmarks/profiles/profile_step.py --size 1.7b --variants "" --codec-batches 64 \
        --codec-variants "$CODEC_VARIANTS" --out "$OUT_DIR/codec.json"
      ;;
    teacher-forced)  # ours (float32, bf16, the engine's path and its variants) against the official package in bf16
      compgen -G "$WHL/reference/*.whl" >/dev/null || { echo "gpu_variants: no wheels in $WHL/reference" >&2; exit 2; }
      if [ ! -f "$SITE-reference/.installed" ]; then
        "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$SITE-reference" \
          "$WHL"/reference/*.whl
        touch "$SITE-reference/.installed"
      fi
      for size in ${TF_SIZES:-1.7b 0.6b}; do
        run "tf-$size" 300 env PYTHONPATH="$SITE-reference:$PYTHONPATH" "$PY" tests/reference/make_fixture.py \
          --size "$size" --device cuda --teacher-forced --frames "${TF_FRAMES:-64}" --json "$OUT_DIR/tf-$size.json"
      done
      ;;
    engine)
      run engine 330 "$PY" benchmarks/e2e/bench_gpu.py --time-budget-s 280 --level-timeout-s 90 --sizes 1.7b --parts engine \
        --concurrency 1,64,256 --engine-variants "$VARIANTS" --variant-concurrency 1,64,256 \
        "${tokenizer[@]}" --out "$OUT_DIR/engine.json"
      ;;
  esac
done
