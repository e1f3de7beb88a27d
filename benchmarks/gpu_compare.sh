#!/usr/bin/env bash
# Old vs new in one lease: bench_engine and bench_kernels of a baseline tree (BASE, e.g. a
# `git archive` of an earlier commit, carried as an ignored folder) and of this checkout,
# alternated per round, so both are measured on the same GPU within minutes.
# Usage (repo root, `.whl/` carried): bash benchmarks/gpu_compare.sh BASE [ROUNDS] [OUT_DIR]
set -uo pipefail
base=$(cd "$1" && pwd)
rounds=${2:-1}
out=${3:-${OUT:-/tmp/kvflow-compare}}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
here=$PWD
status=0
# each run builds into its own cache; KVFLOW_KERNEL_CACHE is the cubin cache of trees older
# than kvflow.cuda (one KVFLOW_CACHE_DIR since)
run() {  # run NAME TREE SCRIPT [ARGS...]
  local name=$1 tree=$2; shift 2
  local cache=/tmp/kvflow-cache-$name
  echo "=== $name"
  (cd "$tree" && KVFLOW_CACHE_DIR=$cache KVFLOW_KERNEL_CACHE=$cache/kernels \
    PYTHONPATH=/tmp/site:$tree timeout 280 python3 "$@") >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc"
  tail -n 20 "$out/$name.log"
  [ "$rc" -eq 0 ] || status=1
}
for round in $(seq "$rounds"); do
  run "engine_old_$round" "$base" benchmarks/bench_engine.py --reps 5 --json "$out/engine_old_$round.json"
  run "engine_new_$round" "$here" benchmarks/bench_engine.py --reps 5 --json "$out/engine_new_$round.json"
done
run kernels_old "$base" benchmarks/bench_kernels.py --variants default --json "$out/kernels_old.json"
run kernels_new "$here" benchmarks/bench_kernels.py --variants default --json "$out/kernels_new.json"
exit $status
