#!/usr/bin/env bash
# The conformance suite alone: shmdisagg deployments in front of TensorRT-LLM's own worker
# server code (../shared/trtllm_worker), every answer compared with the worker's direct one.
# Sets up shmdisagg's venv and the worker copy's (scripts/conformance_env.sh) first.
# Usage: scripts/conformance.sh [extra pytest args]     (tests/conformance/README.md)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
source scripts/conformance_env.sh
exec "$VENV/bin/python" -m pytest -n auto --dist loadgroup -q tests/conformance "$@"
