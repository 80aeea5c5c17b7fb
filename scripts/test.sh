#!/usr/bin/env bash
# The test command: set up from nothing (a venv, the install with the native extension), then
# run the whole suite in parallel. Usage: scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec "$VENV/bin/python" -m pytest -n auto -q "$@"
