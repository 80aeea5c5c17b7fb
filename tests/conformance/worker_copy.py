"""Where TensorRT-LLM's worker copy, its venv and its tokenizer are, or why the suite is skipped.

The worker copy (`../shared/trtllm_worker` next to the repository, read its README) runs
TensorRT-LLM's own `trtllm-serve` worker server code on CPU with a deterministic fake engine.
`scripts/conformance_env.sh` sets it up (its `setup.sh VENV TOKENIZER_DIR`, into the ignored
`.venv-trtllm-worker/`) and exports the variables read here; a plain `pytest` finds the same
default locations.

- `SHMDISAGG_TRTLLM_WORKER`: the worker copy (default `<repo>/../shared/trtllm_worker`, or, in
  a git worktree, `../shared/trtllm_worker` next to the main checkout);
- `SHMDISAGG_TRTLLM_WORKER_VENV`: its venv (default `<repo>/.venv-trtllm-worker/venv`);
- `SHMDISAGG_TRTLLM_WORKER_TOKENIZER`: the tokenizer directory `setup.sh` wrote (default
  `<repo>/.venv-trtllm-worker/tiny-llama3-tokenizer`); its basename is the model name served;
- `SHMDISAGG_CONFORMANCE_SKIP`: set by the script when the set-up failed: the skip reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STATE = REPO / ".venv-trtllm-worker"  # git-ignored: the venv, the tokenizer, bytecode, set-up log


@dataclass(frozen=True)
class WorkerCopy:
    root: Path  # the worker copy (read-only in CI)
    python: Path  # its venv's interpreter
    tokenizer: Path  # the tokenizer directory, also the worker's --model-dir

    @property
    def serve_worker(self) -> Path:
        return self.root / "serve_worker.py"

    @property
    def model(self) -> str:
        """The model name the workers serve (`/v1/models`): the tokenizer directory's basename."""
        return self.tokenizer.name


def _path(var: str, default: Path) -> Path:
    return Path(os.environ.get(var) or default)


def default_root() -> Path:
    """`../shared/trtllm_worker` next to the repository, else next to the main checkout when
    this is a git worktree (its `.git` file names `<main>/.git/worktrees/<name>`)."""
    here = REPO.parent / "shared" / "trtllm_worker"
    dot_git = REPO / ".git"
    if not here.exists() and dot_git.is_file():
        gitdir = Path(dot_git.read_text().removeprefix("gitdir:").strip())
        if gitdir.parent.name == "worktrees":
            return gitdir.parents[2].parent / "shared" / "trtllm_worker"
    return here


def locate() -> WorkerCopy | str:
    """The worker copy ready to run, or the reason the conformance suite is skipped."""
    reason = os.environ.get("SHMDISAGG_CONFORMANCE_SKIP")
    if reason:
        return reason
    root = _path("SHMDISAGG_TRTLLM_WORKER", default_root())
    if not (root / "serve_worker.py").is_file():
        return f"no TensorRT-LLM worker copy at {root} (set SHMDISAGG_TRTLLM_WORKER)"
    venv = _path("SHMDISAGG_TRTLLM_WORKER_VENV", STATE / "venv")
    tokenizer = _path("SHMDISAGG_TRTLLM_WORKER_TOKENIZER", STATE / "tiny-llama3-tokenizer")
    python = venv / "bin" / "python"
    if not python.exists() or not (tokenizer / "tokenizer.json").is_file():
        return f"the worker copy is not set up (no {python} or {tokenizer}/tokenizer.json): run scripts/conformance.sh"
    return WorkerCopy(root, python, tokenizer)
