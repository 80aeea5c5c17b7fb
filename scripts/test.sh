#!/usr/bin/env bash
# The test command: set up from nothing (a venv, the install with the native extension; the
# TensorRT-LLM worker copy for tests/conformance when ../shared/trtllm_worker exists, else that
# suite is skipped with the reason), then `ruff check`, `ruff format --check` and `mypy` (any
# failure ends it), then run the whole suite in parallel (`--dist loadgroup`:
# each conformance deployment's tests on one xdist worker). Usage: scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
# lint, format and types first (seconds; configured in pyproject.toml): any failure stops here
"$VENV/bin/ruff" check --quiet .
"$VENV/bin/ruff" format --check --quiet .
"$VENV/bin/mypy"
source scripts/conformance_env.sh
exec "$VENV/bin/python" -m pytest -n auto --dist loadgroup -q "$@"
