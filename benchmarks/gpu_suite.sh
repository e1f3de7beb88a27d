#!/usr/bin/env bash
# The combined GPU run for the device machine: every gpu-marked test (kernels, stream
# events, engine, server over CUDA IPC, e2e), the end-to-end transformer check, the rest of
# the suite (which CI runs without a GPU: here CUDA is present) and the engine benchmark,
# in one lease.
# Usage (repo root, `.whl/` carried): bash benchmarks/gpu_suite.sh [OUT_DIR]
set -uo pipefail
out=${1:-${OUT:-/tmp/kvflow-gpu}}
# shellcheck source=benchmarks/gpu_lib.sh
. "$(dirname "$0")/gpu_lib.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
step gpu_tests 360 python3 -m pytest -q -p no:cacheprovider -m gpu tests
step gpu_e2e 90 python3 -m tests.e2e.gpu_e2e --json "$out/gpu_e2e.json"
workers=$(( $(nproc) * 3 / 4 )); [ "$workers" -ge 1 ] || workers=1
step cpu_tests 300 python3 -m pytest -q -p no:cacheprovider -n "$workers" --dist loadgroup \
  --max-worker-restart=0 -m "not gpu and not gpu2" tests
step bench_engine 240 python3 benchmarks/bench_engine.py --reps 10 --json "$out/bench_engine.json"
exit $status
