#!/usr/bin/env bash
# The main job: set up from nothing, launch a single-node deployment on the simulator
# (2 context + 2 generation executors, a fleet of 2), replay the first 300 requests of the
# Mooncake conversation trace, print the results table, shut down.
#
# Usage: scripts/demo.sh [extra `shmdisagg bench` args]   (results JSON: runs/demo.json)
#   The deployment is examples/demo.yaml: public port 8000, executors on 8101-8102 and 8201-8202.
#   Elsewhere on a shared machine:
#     scripts/demo.sh --port 9400       the same deployment moved: public port 9400, executors
#                                       on 9501-9502 and 9601-9602 (every port by the same offset)
#     scripts/demo.sh -c my.yaml        another config (with --port too, to move it)
#   Any other bench option given here overrides the demo's (e.g. --num-requests 50).
#   runs/demo.json records the run's timeline: `shmdisagg bench --plot-only --plot DIR
#   --compare runs/demo.json OTHER.json` draws it beside another run.
# Exits non-zero if the deployment fails, any request failed (1) or the run was interrupted:
# `shmdisagg bench`'s own exit status (130 for Ctrl-C, 143 for SIGTERM).
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
mkdir -p runs
# the previous run's results stay until this run writes its own (a bad option writes none)
started=$(mktemp)
trap 'rm -f "$started"' EXIT
status=0
"$VENV/bin/shmdisagg" bench --launch -c examples/demo.yaml \
  --trace data/mooncake_conversation_300.jsonl --num-requests 300 --speedup 2 \
  --json runs/demo.json "$@" || status=$?
if [ runs/demo.json -nt "$started" ]; then
  "$VENV/bin/python" - <<'PY' || { [ "$status" -ne 0 ] || status=1; }
import json, sys
errors = json.load(open("runs/demo.json"))["errors"]["count"]
if errors:
    sys.exit(f"demo: {errors} request(s) failed (see runs/demo.json)")
PY
fi
exit "$status"
