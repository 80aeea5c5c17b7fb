#!/usr/bin/env bash
# The membership demo: the demo deployment with its executors found through etcd
# (examples/demo_etcd.yaml, TensorRT-LLM's `disagg_cluster`), replaying the first 300 requests of
# the Mooncake conversation trace while executors join and leave: 2 context + 2 generation
# simulators register at start; during the replay one more of each registers, then one
# generation and one context simulator stop (SIGTERM: they deregister, finish their requests in
# flight and serve their last KV pulls). Prints the results table; no request may fail.
#
# Usage: scripts/demo_membership.sh [extra `shmdisagg bench` args]   (results: runs/demo_membership.json)
#   PORT=8000 ETCD_PORT=2479 are the defaults (the public port and etcd's client port; etcd's peer
#   port is ETCD_PORT + 1). It starts its own etcd (Debian's etcd-server, installed by
#   scripts/setup_env.sh) with a temporary data directory, and stops everything it started.
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
PORT="${PORT:-8000}"
ETCD_PORT="${ETCD_PORT:-2479}"
work="$(mktemp -d)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
etcd --name demo --data-dir "$work/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
  --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
  --initial-cluster "demo=http://127.0.0.1:$((ETCD_PORT + 1))" --log-level error > "$work/etcd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  ETCDCTL_API=3 etcdctl --endpoints "127.0.0.1:$ETCD_PORT" endpoint health >/dev/null 2>&1 && break
  sleep 0.1
done
uri="etcd://127.0.0.1:$ETCD_PORT"
sed -e "s|^port: 8000|port: $PORT|" -e "s|etcd://127.0.0.1:2479|$uri|" examples/demo_etcd.yaml > "$work/demo_etcd.yaml"

sim() {  # one simulator registering as `trtllm-serve --disagg_cluster_uri ... --server_role $1` does
  "$VENV/bin/python" -m shmdisagg.executors.sim --host 127.0.0.1 --port 0 --role "$1" --server-role "$1" \
    --disagg-cluster-uri "$uri" --cluster-name demo --heartbeat-interval-sec 1 --inactive-timeout-sec 3 \
    --model sim-llama-3.1-8b --num-blocks 131072 --speedup 4 --enable-chunked-prefill \
    --max-batch-size "$2" --event-timestamps > "$work/extra-$1-$RANDOM.log" 2>&1 &
  pids+=($!)
}
churn() {  # executors join and leave while the trace replays
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 0.2; done
  sleep 8;  echo "demo: a context and a generation executor join";  sim context 16; ctx=$!; sim generation 64; gen=$!
  sleep 12; echo "demo: a generation executor leaves"; kill -TERM "$gen"
  sleep 8;  echo "demo: a context executor leaves";    kill -TERM "$ctx"
}
mkdir -p runs
rm -f runs/demo_membership.json
churn &
pids+=($!)
status=0
"$VENV/bin/shmdisagg" bench --launch -c "$work/demo_etcd.yaml" \
  --trace data/mooncake_conversation_300.jsonl --num-requests 300 --speedup 2 \
  --json runs/demo_membership.json "$@" || status=$?
if [ -f runs/demo_membership.json ]; then
  "$VENV/bin/python" - <<'PY' || { [ "$status" -ne 0 ] || status=1; }
import json, sys
errors = json.load(open("runs/demo_membership.json"))["errors"]["count"]
if errors:
    sys.exit(f"demo: {errors} request(s) failed (see runs/demo_membership.json)")
PY
fi
exit "$status"
