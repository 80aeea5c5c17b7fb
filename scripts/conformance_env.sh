# Sourced by scripts/test.sh and scripts/conformance.sh: set up TensorRT-LLM's worker copy for
# tests/conformance, or say why that suite is skipped. Never fails the caller.
#
# The worker copy is ../shared/trtllm_worker next to the repository (next to the main checkout
# when this is a git worktree), read-only in CI; its venv and tokenizer go under the ignored
# .venv-trtllm-worker/ and are reused while the copy's requirements.txt and make_tokenizer.py are
# unchanged. Override with SHMDISAGG_TRTLLM_WORKER, SHMDISAGG_TRTLLM_WORKER_VENV and
# SHMDISAGG_TRTLLM_WORKER_TOKENIZER (e.g. an existing venv). Exports those three, and
# SHMDISAGG_CONFORMANCE_SKIP (the reason) when the suite cannot run.
_conformance_setup() {
  local root="$PWD" state="$PWD/.venv-trtllm-worker" common w wv wt stamp want log t0
  if [ -z "${SHMDISAGG_TRTLLM_WORKER:-}" ] && [ ! -d "$root/../shared/trtllm_worker" ]; then
    common=$(git rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)
    [ -n "$common" ] && root=$(dirname "$common")
  fi
  w="${SHMDISAGG_TRTLLM_WORKER:-$root/../shared/trtllm_worker}"
  wv="${SHMDISAGG_TRTLLM_WORKER_VENV:-$state/venv}"
  wt="${SHMDISAGG_TRTLLM_WORKER_TOKENIZER:-$state/tiny-llama3-tokenizer}"
  unset SHMDISAGG_CONFORMANCE_SKIP
  if [ ! -f "$w/setup.sh" ]; then
    export SHMDISAGG_CONFORMANCE_SKIP="no TensorRT-LLM worker copy at $w (tests/conformance/README.md)"
  else
    w=$(cd "$w" && pwd)
    stamp="$wv/.shmdisagg-conformance"
    want=$(cat "$w/requirements.txt" "$w/make_tokenizer.py" | sha256sum | cut -d' ' -f1)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -f "$wt/tokenizer.json" ]; then
      mkdir -p "$state"
      log="$state/setup.log"
      t0=$(date +%s)
      echo "conformance: setting up the worker copy (bash $w/setup.sh $wv $wt; log $log)" >&2
      if bash "$w/setup.sh" "$wv" "$wt" >"$log" 2>&1; then
        echo "$want" >"$stamp"
        echo "conformance: worker copy set up in $(( $(date +%s) - t0 )) s" >&2
      else
        export SHMDISAGG_CONFORMANCE_SKIP="set-up of the worker copy failed: bash $w/setup.sh $wv $wt (log: $log)"
      fi
    fi
  fi
  export SHMDISAGG_TRTLLM_WORKER="$w" SHMDISAGG_TRTLLM_WORKER_VENV="$wv" SHMDISAGG_TRTLLM_WORKER_TOKENIZER="$wt"
  if [ -n "${SHMDISAGG_CONFORMANCE_SKIP:-}" ]; then
    echo "conformance suite skipped: $SHMDISAGG_CONFORMANCE_SKIP" >&2
  fi
}
_conformance_setup
unset -f _conformance_setup
