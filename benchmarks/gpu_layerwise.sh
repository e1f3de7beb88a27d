#!/usr/bin/env bash
# The layerwise GPU run for the device machine, in one lease: the layerwise GPU test,
# the engine and server GPU tests it builds on, and bench_ttft's (e) on the 8B shape.
# Usage (repo root, `.whl/` carried): [TESTS=...] [REPEAT=n] bash benchmarks/gpu_layerwise.sh [OUT_DIR] [LENGTHS]
set -uo pipefail
out=${1:-${OUT:-/tmp/kvflow-gpu}}
lengths=${2:-8192,32768}
STEP_TAIL=25
# shellcheck source=benchmarks/gpu_lib.sh
. "$(dirname "$0")/gpu_lib.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
tests=${TESTS:-tests/core/engine/test_movers_layers_gpu.py tests/core/server/test_layerwise_gpu.py tests/core/engine/test_engine_gpu.py tests/core/server/test_server_gpu.py}
# shellcheck disable=SC2086
step layerwise_tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu $tests
step bench_ttft 420 python3 benchmarks/bench_ttft.py --models 8b --lengths "$lengths" \
  --repeat "${REPEAT:-5}" --layerwise --json "$out/bench_ttft_layerwise.json"
exit $status
