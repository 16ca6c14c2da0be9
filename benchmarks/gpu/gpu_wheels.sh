#!/usr/bin/env bash
# Download, for the GPU benchmark machine (Python 3.12, manylinux x86_64, no package index), the wheels that
# machine lacks, into git-ignored folders that a run carries along with the tree:
#   .whl/server/     what our server imports beyond torch/numpy/safetensors/pyyaml/httpx (fastapi, uvicorn,
#                    pydantic(-settings), soundfile, soxr, tokenizers, prometheus-client, ...), pinned to the
#                    versions installed in .venv (the versions our tests ran with) when it exists;
#   .whl/test/       what our CUDA tests need beyond the machine's pytest (pytest-asyncio, for the engine's async
#                    tests), pinned to .venv's version like the server's;
#   .whl/reference/  the official implementation's wheels        (REFERENCE_WHEELS=<list>, one spec a line)
#   .whl/peer/       faster-qwen3-tts and its official-code build (PEER_WHEELS=<list>, one spec a line)
# The two baseline lists are optional: a folder is skipped when its list is not given or not found.
# Prints each folder's size and the total (one device call carries at most 64 MiB with the tree).
#
#   REFERENCE_WHEELS=path/reference_wheels.txt PEER_WHEELS=path/peer_wheels.txt bash benchmarks/gpu/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
DEST=${WHEEL_DIR:-.whl}
PYV=${PY_VERSION:-3.12}  # the GPU machine's Python

# Our server's third-party imports that the GPU machine lacks, with their runtime dependencies.
SERVER_PACKAGES=(
  fastapi starlette annotated-doc opentelemetry-api
  pydantic pydantic-core pydantic-settings python-dotenv typing-inspection annotated-types typing-extensions
  uvicorn h11 click anyio idna websockets httptools
  soundfile cffi pycparser soxr
  tokenizers prometheus-client tqdm watchfiles python-multipart sentencex fastapi-offline
)

# The GPU machine has pytest but not the plugin that runs our async tests.
TEST_PACKAGES=(pytest-asyncio)

download() {  # download <folder> <spec>...
  local dir=$1
  shift
  mkdir -p "$dir"
  local log
  log=$(mktemp)
  if ! "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYV" --implementation cp --abi "cp${PYV/./}" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$dir" "$@" >"$log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    rm -f "$log"
    echo "gpu_wheels: pip download into $dir failed" >&2
    return 1
  fi
  rm -f "$log"
}

pinned() {  # the installed version of each package in .venv, else the bare name
  "$PY" - "$@" <<'EOF'
import importlib.metadata as md
import sys

for name in sys.argv[1:]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(name)
EOF
}

specs_of() {  # the package specs of a list file (comments and blank lines dropped)
  grep -v '^\s*#' "$1" | sed 's/#.*//; s/\s*$//' | grep -v '^$'
}

mapfile -t server_specs < <(pinned "${SERVER_PACKAGES[@]}")
echo "gpu_wheels: ${#server_specs[@]} server wheels -> $DEST/server"
download "$DEST/server" "${server_specs[@]}"
mapfile -t test_specs < <(pinned "${TEST_PACKAGES[@]}")
echo "gpu_wheels: ${#test_specs[@]} test wheels -> $DEST/test"
download "$DEST/test" "${test_specs[@]}"

for kind in reference peer; do
  var=$(echo "${kind}_WHEELS" | tr a-z A-Z)
  list=${!var:-}
  if [ -z "$list" ] || [ ! -f "$list" ]; then
    echo "gpu_wheels: $var not given or not found, skipping $DEST/$kind"
    continue
  fi
  mapfile -t specs < <(specs_of "$list")
  echo "gpu_wheels: ${#specs[@]} $kind wheels -> $DEST/$kind"
  download "$DEST/$kind" "${specs[@]}"
done

du -sh "$DEST"/*/
echo "gpu_wheels: total $(du -sm "$DEST" | cut -f1) MiB (a device call carries at most 64 MiB with the tree)"
