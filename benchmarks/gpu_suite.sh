#!/usr/bin/env bash
# The combined GPU run for the device machine: every gpu-marked test (kernels, stream
# events, engine, server over CUDA IPC, e2e),
# the end-to-end transformer check and the engine benchmark, in one lease.
# Usage (repo root, `.whl/` carried): bash benchmarks/gpu_suite.sh [OUT_DIR]
set -uo pipefail
out=${1:-${OUT:-/tmp/kvflow-gpu}}
# shellcheck source=benchmarks/gpu_lib.sh
. "$(dirname "$0")/gpu_lib.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
step gpu_tests 360 python3 -m pytest -q -p no:cacheprovider -m gpu tests
step gpu_e2e 90 python3 -m tests.e2e.gpu_e2e --json "$out/gpu_e2e.json"
step bench_engine 240 python3 benchmarks/bench_engine.py --reps 10 --json "$out/bench_engine.json"
exit $status
