#!/usr/bin/env bash
# make test: the suite on vLLM 0.32 (the CPU build) in two parts, then tests/unit on vLLM
# 0.33.0's Python code; prints each part's wall time, the share of the machine's CPU time
# left idle in it (what more workers could use), and the whole run's wall time.
#  1. everything but the tests marked alone, on pytest-xdist's workers (one a
#     CPU, at most 4), a module's tests on one worker (--dist loadfile: its shared engine
#     starts once; xdist's loadgroup does not group on pytest 9, which ignores its renaming),
#     the longest modules first (tests/module_seconds.json; xdist's own reorder, by the
#     number of tests, would start the long single-test modules last);
#  2. the tests marked alone (a time bound a busy machine stretches, a four-rank engine on
#     two cores), one at a time.
# TEST_WORKERS: the number of workers (make test passes its own: one a CPU, at most 4);
# PYTEST_ARGS is passed to every part;
# JUNIT_DIR, where set, gets each 0.32 part's junit XML (parallel.xml, alone.xml).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
workers="${TEST_WORKERS:-1}"  # make test sets it (the Makefile's TEST_WORKERS)
t0=$(date +%s)
status=0
cpu() {  # the machine's idle and total CPU ticks so far (/proc/stat), or nothing
  [ -r /proc/stat ] && awk '/^cpu /{t=0; for(i=2;i<=NF;i++) t+=$i; print $5+$6, t; exit}' /proc/stat
}
part() {  # NAME, then the command; its wall time and the CPU left idle are printed, a failure remembered
  local name=$1 t=$(date +%s) c0 c1 idle=""
  shift
  c0=$(cpu)
  "$@" || status=1
  c1=$(cpu)
  if [ -n "$c0" ] && [ -n "$c1" ]; then
    idle=$(echo "$c0 $c1" | awk '{d=$4-$2; if (d>0) printf ", CPU idle %.0f%%", 100*($3-$1)/d}')
  fi
  echo "make test: ${name} took $(( $(date +%s) - t )) s${idle}"
}
$PY -m scripts.support.env_report
junit() { [ -n "${JUNIT_DIR:-}" ] && echo "--junitxml=${JUNIT_DIR}/$1.xml"; }
part "vLLM 0.32, ${workers} workers" env EXPECT_VLLM=0.32.0 $PY -m pytest -q -rs --durations=30 \
  -n "$workers" --dist loadfile --no-loadscope-reorder -m "not alone" $(junit parallel) ${PYTEST_ARGS:-} tests
part "vLLM 0.32, alone" env EXPECT_VLLM=0.32.0 $PY -m pytest -q -rs --durations=10 \
  -m alone $(junit alone) ${PYTEST_ARGS:-} tests
part "vLLM 0.33 unit" make --no-print-directory test-vllm033 TEST_WORKERS="$workers"
echo "make test: $(( $(date +%s) - t0 )) s in all (exit ${status})"
exit $status
