#!/usr/bin/env bash
# The many-GPU run for a device machine with two or more GPUs, in one lease: every
# gpu2-marked test (a second GPU with the first one's context current, ranks on both,
# the minute-long two-GPU stress), bench_two_gpus for 2 ranks through one server (one
# process, then a shard per GPU) and with a server per rank (and 4 ranks with four GPUs,
# one process and sharded), each rank alone and all at once next to the
# pinned-copy ceilings, and bench_cold_l1.
# Usage (repo root, `.whl/` carried): bash benchmarks/gpu_multi_suite.sh [OUT_DIR]
set -uo pipefail
out=${1:-${OUT:-/tmp/kvflow-gpu}}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
nvidia-smi topo -m | head -8
gpus=$(nvidia-smi -L | wc -l)
status=0
step() {
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -25 "$out/$name.log"
  echo "=== $name rc=$rc"
  [ "$rc" -eq 0 ] || status=1
}
step gpu2_tests 300 python3 -m pytest -q -p no:cacheprovider -p no:randomly -m gpu2 tests
step two_gpus 150 python3 benchmarks/bench_two_gpus.py --ranks 2 --json "$out/two_gpus.json"
# one server with a shard process per GPU (kvflow server --shards 2), same lease
step two_gpus_shards 150 python3 benchmarks/bench_two_gpus.py --ranks 2 --shards 2 \
  --json "$out/two_gpus_shards.json"
# the same ranks with a server each: what one server's shared interpreter costs, same lease
step two_gpus_per_rank 150 python3 benchmarks/bench_two_gpus.py --ranks 2 --server-per-rank \
  --json "$out/two_gpus_per_rank.json"
if [ "$gpus" -ge 4 ]; then
  step four_gpus 150 python3 benchmarks/bench_two_gpus.py --ranks 4 --json "$out/four_gpus.json"
  step four_gpus_shards 150 python3 benchmarks/bench_two_gpus.py --ranks 4 --shards 4 \
    --json "$out/four_gpus_shards.json"
fi
step cold_l1 120 python3 benchmarks/bench_cold_l1.py --json "$out/cold_l1.json"
exit $status
