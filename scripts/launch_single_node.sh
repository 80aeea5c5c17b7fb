#!/usr/bin/env bash
# Launch shmdisagg on one GPU node with trtllm-serve executors: writes a config, then runs
# `shmdisagg launch -c CONFIG`. Ctrl-C (or SIGTERM) stops every process it started.
#
# Defaults (an 8-GPU node, see docs/deploy.md for sizing):
#   4 context instances at TP1 on GPUs 0-3, 2 generation instances at TP2 on GPUs 4-5 and 6-7,
#   model meta-llama/Llama-3.1-8B-Instruct, KV transfer over NIXL, public port 8000 on 0.0.0.0,
#   context instances on ports 8001.., generation instances after them, 8 fleet workers,
#   load_balancing routers (tokens for context, requests for generation).
#
# Usage: scripts/launch_single_node.sh [options] [--dry-run]
#   --model NAME            model to serve (Hugging Face name or checkpoint path)
#   --ctx N / --ctx-tp T    context instances and tensor-parallel size of each (4 / 1)
#   --gen N / --gen-tp T    generation instances and tensor-parallel size of each (2 / 2)
#   --gpus LIST             comma-separated GPU ids handed out in order, context first
#                           (default 0..N-1 for the N GPUs the instances need)
#   --transceiver NAME      cache_transceiver_config.backend: NIXL or UCX (NIXL)
#   --port P                public port (8000); executors use P+1, P+2, ...
#   --host H                public address (0.0.0.0)
#   --workers N             fleet workers (8)
#   --ctx-batch N / --ctx-tokens N    context max_batch_size / max_num_tokens (16 / 16384)
#   --gen-batch N / --gen-tokens N    generation max_batch_size / max_num_tokens (256 / 8192)
#   --mem-fraction F        kv_cache_config.free_gpu_memory_fraction (0.9)
#   --schedule STYLE        context_first or generation_first (context_first)
#   --startup-timeout S     seconds an instance may take to load (900)
#   --config-out FILE       where the generated config goes
#                           (default ${TMPDIR:-/tmp}/shmdisagg-<uid>-single-node-<port>.yaml)
#   --log-dir DIR           executor logs and option files (default ${TMPDIR:-/tmp}/shmdisagg-<uid>-<port>-logs,
#                           the same directory for every launch on that port; logs are appended to)
#   --dry-run               print the generated config and the plan (commands, environment, YAMLs,
#                           ports, GPUs); start nothing and write nothing (with --config-out: write
#                           only that file, and say so)
# Environment: PYTHON (the interpreter with shmdisagg installed; default .venv/bin/python if
# present, else python3).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"

MODEL=meta-llama/Llama-3.1-8B-Instruct
CTX=4; CTX_TP=1; GEN=2; GEN_TP=2
GPUS=""
TRANSCEIVER=NIXL
PORT=8000; HOST=0.0.0.0; WORKERS=8
CTX_BATCH=16; CTX_TOKENS=16384; GEN_BATCH=256; GEN_TOKENS=8192
MEM_FRACTION=0.9
SCHEDULE=context_first
STARTUP_TIMEOUT=900
CONFIG_OUT=""
CONFIG_OUT_GIVEN=""
LOG_DIR=""
DRY_RUN=""

die() { echo "launch_single_node.sh: $*" >&2; exit 2; }
need() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) need "$@"; MODEL="$2"; shift 2 ;;
        --ctx) need "$@"; CTX="$2"; shift 2 ;;
        --ctx-tp) need "$@"; CTX_TP="$2"; shift 2 ;;
        --gen) need "$@"; GEN="$2"; shift 2 ;;
        --gen-tp) need "$@"; GEN_TP="$2"; shift 2 ;;
        --gpus) need "$@"; GPUS="$2"; shift 2 ;;
        --transceiver) need "$@"; TRANSCEIVER="$2"; shift 2 ;;
        --port) need "$@"; PORT="$2"; shift 2 ;;
        --host) need "$@"; HOST="$2"; shift 2 ;;
        --workers) need "$@"; WORKERS="$2"; shift 2 ;;
        --ctx-batch) need "$@"; CTX_BATCH="$2"; shift 2 ;;
        --ctx-tokens) need "$@"; CTX_TOKENS="$2"; shift 2 ;;
        --gen-batch) need "$@"; GEN_BATCH="$2"; shift 2 ;;
        --gen-tokens) need "$@"; GEN_TOKENS="$2"; shift 2 ;;
        --mem-fraction) need "$@"; MEM_FRACTION="$2"; shift 2 ;;
        --schedule) need "$@"; SCHEDULE="$2"; shift 2 ;;
        --startup-timeout) need "$@"; STARTUP_TIMEOUT="$2"; shift 2 ;;
        --config-out) need "$@"; CONFIG_OUT="$2"; CONFIG_OUT_GIVEN=1; shift 2 ;;
        --log-dir) need "$@"; LOG_DIR="$2"; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

for v in CTX CTX_TP GEN GEN_TP PORT WORKERS CTX_BATCH CTX_TOKENS GEN_BATCH GEN_TOKENS STARTUP_TIMEOUT; do
    [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a whole number, got '${!v}'"
done
(( CTX + GEN > 0 )) || die "no instances to start"
(( PORT + CTX + GEN < 65536 )) || die "ports $PORT..$((PORT + CTX + GEN)) do not fit"

NEEDED=$(( CTX * CTX_TP + GEN * GEN_TP ))
if [[ -z "$GPUS" ]]; then
    GPUS=$(seq -s, 0 $(( NEEDED - 1 )))
fi

urls() {  # urls FIRST_PORT COUNT -> ["127.0.0.1:P", ...]
    local first=$1 n=$2 i out=""
    for (( i = 0; i < n; i++ )); do out+="${out:+, }\"127.0.0.1:$(( first + i ))\""; done
    echo "[$out]"
}

CONFIG_OUT="${CONFIG_OUT:-${TMPDIR:-/tmp}/shmdisagg-$(id -u)-single-node-$PORT.yaml}"
write_config() {
cat <<EOF
# Generated by scripts/launch_single_node.sh: $CTX context x TP$CTX_TP + $GEN generation x TP$GEN_TP.
# TensorRT-LLM's disaggregated config format, plus the shmdisagg section (docs/deploy.md).
hostname: "$HOST"
port: $PORT
num_workers: $WORKERS
max_retries: 2
schedule_style: $SCHEDULE
backend: pytorch
context_servers:
  num_instances: $CTX
  urls: $(urls $(( PORT + 1 )) "$CTX")
  router: {type: load_balancing, use_tokens: true}
  tensor_parallel_size: $CTX_TP
  max_batch_size: $CTX_BATCH
  max_num_tokens: $CTX_TOKENS
  disable_overlap_scheduler: true
  cache_transceiver_config: {backend: $TRANSCEIVER}
  kv_cache_config: {enable_block_reuse: true, event_buffer_max_size: 4096, tokens_per_block: 32, free_gpu_memory_fraction: $MEM_FRACTION}
generation_servers:
  num_instances: $GEN
  urls: $(urls $(( PORT + 1 + CTX )) "$GEN")
  router: {type: load_balancing}
  tensor_parallel_size: $GEN_TP
  max_batch_size: $GEN_BATCH
  max_num_tokens: $GEN_TOKENS
  cache_transceiver_config: {backend: $TRANSCEIVER}
  kv_cache_config: {enable_block_reuse: true, event_buffer_max_size: 4096, tokens_per_block: 32, free_gpu_memory_fraction: $MEM_FRACTION}
shmdisagg:
  executors:
    backend: trtllm
    model: "$MODEL"
    gpus: [$GPUS]
    startup_timeout_s: $STARTUP_TIMEOUT
  request_timeout_s: 300
EOF
}

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
LOG_ARGS=()
[[ -n "$LOG_DIR" ]] && LOG_ARGS=(--log-dir "$LOG_DIR")

if [[ -n "$DRY_RUN" && -z "$CONFIG_OUT_GIVEN" ]]; then
    # Write nothing: the plan is made from the config on stdin, named as a launch would write it.
    echo "# the config a launch writes to $CONFIG_OUT (dry run: not written)"
    write_config
    echo
    status=0
    out=$(write_config | "$PYTHON" -m shmdisagg.cli launch -c /dev/stdin --dry-run "${LOG_ARGS[@]}" 2>&1) || status=$?
    out="${out//\/dev\/stdin/$CONFIG_OUT}"
    if (( status )); then printf '%s\n' "$out" >&2; else printf '%s\n' "$out"; fi
    exit "$status"
fi

write_config > "$CONFIG_OUT"
if [[ -n "$DRY_RUN" ]]; then
    echo "launch_single_node.sh: dry run: config written to $CONFIG_OUT (--config-out); nothing else is written" >&2
else
    echo "launch_single_node.sh: config written to $CONFIG_OUT" >&2
fi
ARGS=(launch -c "$CONFIG_OUT" "${LOG_ARGS[@]}")
[[ -n "$DRY_RUN" ]] && ARGS+=(--dry-run)
exec "$PYTHON" -m shmdisagg.cli "${ARGS[@]}"
