#!/usr/bin/env bash
# CI stress check: the full test suite, several times in a row, next to a busy core.
#
# Starts a CPU hog (a Python busy loop, pinned to the last core with taskset when it is
# available), runs `python -m pytest` RUNS times (default 3), prints passed/failed counts and
# the duration of every run, and stops the hog at the end (also on Ctrl-C). The rule it
# checks: no test asserts anything that depends on timing or machine load, so every run
# passes however busy the machine is.
#
#   benchmarks/ci_stress.sh              # 3 runs
#   benchmarks/ci_stress.sh 5 -x -q      # 5 runs; the rest goes to pytest
#
# Logs: one file per run in a fresh temporary folder (printed). Exit status 1 when a run failed.
set -u

cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-.venv/bin/python}
RUNS=${1:-3}
shift $(( $# > 0 ? 1 : 0 ))
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/ci_stress.XXXXXX")

cores=$(nproc 2>/dev/null || echo 1)
hog=("$PY" -c 'while True: pass')
if command -v taskset >/dev/null 2>&1; then
    hog=(taskset -c "$((cores - 1))" "${hog[@]}")
fi
"${hog[@]}" &
HOG=$!
stop_hog() { kill "$HOG" 2>/dev/null; wait "$HOG" 2>/dev/null; }
trap stop_hog EXIT
trap 'exit 130' INT TERM
echo "CPU hog: pid $HOG (${hog[*]}), $cores cores; logs in $LOGS"

summary=()
status=0
for run in $(seq 1 "$RUNS"); do
    log="$LOGS/run$run.log"
    start=$(date +%s)
    "$PY" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    last=$(grep -E "(passed|failed|error)" "$log" | tail -n 1)
    count() { echo "$last" | grep -oE "[0-9]+ $1" | grep -oE "[0-9]+" || echo 0; }
    line="run $run: $(count passed) passed, $(count failed) failed, $(count error) errors, $(count skipped) skipped in ${secs} s (exit $rc)"
    echo "$line"
    summary+=("$line")
    if [ "$rc" -ne 0 ]; then
        status=1
        grep -E "^(FAILED|ERROR) " "$log" | sed 's/^/    /'
    fi
done

echo "---"
printf '%s\n' "${summary[@]}"
exit "$status"
