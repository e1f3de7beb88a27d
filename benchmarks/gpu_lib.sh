# Sourced by the device-machine scripts (gpu_suite.sh, gpu_layerwise.sh): make $out,
# install the carried `.whl/` wheels, set PYTHONPATH, and define `step NAME LIMIT CMD...`,
# which runs CMD under a time limit, keeps its log in $out/NAME.log, prints its tail and
# its exit code, and sets status=1 when it fails. Expects $out set by the caller.
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
status=0
step() {
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -"${STEP_TAIL:-40}"
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc"
  [ "$rc" -eq 0 ] || status=1
}
