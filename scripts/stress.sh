#!/usr/bin/env bash
# The chaos suite's long version: every scenario of tests/stress/test_chaos.py under load for
# about DURATION seconds in total (split evenly over the scenarios, each repeating its fault:
# kill, recover, kill again), two at a time, then the table of what each did.
# Usage: scripts/stress.sh DURATION [extra pytest args]   e.g. scripts/stress.sh 600
# SHMDISAGG_CHAOS_SEED=N replays a run's faults and load (each row names its seed).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ ]]; then
    echo "usage: scripts/stress.sh DURATION [pytest args]  (DURATION: seconds of load in total, e.g. 600)" >&2
    exit 2
fi
duration=$1
shift
source scripts/setup_env.sh
report=$(mktemp /tmp/shmdisagg-chaos-XXXXXX.md)
trap 'rm -f "$report"' EXIT
status=0
SHMDISAGG_CHAOS_DURATION=$duration SHMDISAGG_CHAOS_REPORT=$report \
    "$VENV/bin/python" -m pytest -n 2 -q -p no:cacheprovider -m chaos tests/stress "$@" || status=$?
echo
echo "chaos suite, scripts/stress.sh $duration:"
cat "$report" 2>/dev/null || echo "(no table: no scenario ran)"
exit $status
