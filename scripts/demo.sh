#!/usr/bin/env bash
# The main job: set up from nothing, launch a single-node deployment on the simulator
# (2 context + 2 generation executors, a fleet of 2), replay the first 300 requests of the
# Mooncake conversation trace, print the results table, shut down.
# Usage: scripts/demo.sh [extra `shmdisagg bench` args]   (results JSON: runs/demo.json)
# Exits non-zero if the deployment fails, any request failed (1) or the run was interrupted (130):
# `shmdisagg bench`'s own exit status.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
mkdir -p runs
rm -f runs/demo.json
status=0
"$VENV/bin/shmdisagg" bench --launch -c examples/demo.yaml \
  --trace data/mooncake_conversation_300.jsonl --num-requests 300 --speedup 2 \
  --json runs/demo.json "$@" || status=$?
if [ -f runs/demo.json ]; then
  "$VENV/bin/python" - <<'PY' || { [ "$status" -ne 0 ] || status=1; }
import json, sys
errors = json.load(open("runs/demo.json"))["errors"]["count"]
if errors:
    sys.exit(f"demo: {errors} request(s) failed (see runs/demo.json)")
PY
fi
exit "$status"
