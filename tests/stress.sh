#!/usr/bin/env bash
# The default test suite several times in a row beside CPU-bound busy processes (issue 28): a test that measures the
# machine instead of the code — a wall-clock bound, the process's resident set — fails here first. Each run's log is
# kept; the failures of every run are printed at the end, and the exit status is 1 if any run failed.
#
#   bash tests/stress.sh [RUNS=3] [HOGS=2] [-- PYTEST ARGS…]        (from the repository root, in the venv)
#
# Record the result in docs/testing.md with the date, the machine and each run's summary line.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
hogs=${2:-2}
shift $(( $# >= 2 ? 2 : $# ))
[ "${1:-}" = "--" ] && shift
python=${PYTHON:-.venv/bin/python}
logs=$(mktemp -d "${TMPDIR:-/tmp}/shipyard-stress-XXXXXX")
pids=()
stop_hogs() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done; wait 2>/dev/null; }
trap stop_hogs EXIT INT TERM
for _ in $(seq "$hogs"); do
  "$python" -c "while True: pass" &
  pids+=($!)
done
echo "stress: $runs runs of the default suite beside $hogs busy processes ($(nproc) cores); logs in $logs"
failed=0
for i in $(seq "$runs"); do
  start=$(date +%s)
  "$python" -m pytest -q -p no:cacheprovider "$@" > "$logs/run-$i.log" 2>&1
  rc=$?
  echo "run $i: exit $rc, $(tail -n 1 "$logs/run-$i.log") ($(( $(date +%s) - start )) s)"
  if [ "$rc" -ne 0 ]; then
    failed=$(( failed + 1 ))
    grep -E '^(FAILED|ERROR) ' "$logs/run-$i.log" | sed 's/^/    /'
  fi
done
echo "stress: $failed of $runs runs failed"
[ "$failed" -eq 0 ]
