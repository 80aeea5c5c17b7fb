#!/usr/bin/env bash
# Installs vLLM's Rust router (PyPI `vllm-router`, vllm-project/router: a fork of SGLang's model
# gateway) into .venv-peers/ at the repository root (git-ignored), apart from the project's venv,
# for `benchmarks/bench_orchestrator_cpu.py --vllm-router auto`. Nothing of its code is committed.
#
#   bash benchmarks/peers/install_vllm_router.sh [VERSION]     # default 0.1.17, the version measured
#
# The bench starts it itself against its executors, round-robin, logging errors only:
#   vllm-router --host 127.0.0.1 --port P --prometheus-port Q --policy round_robin --log-level error \
#       --vllm-pd-disaggregation --prefill http://CTX --decode http://GEN      # two hops
#   vllm-router ... --worker-urls http://GEN                                   # one hop
set -euo pipefail
version="${1:-0.1.17}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="$root/.venv-peers"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q "vllm-router==$version"
"$venv/bin/vllm-router" --help >/dev/null
echo "vllm-router $version: $venv/bin/vllm-router"
