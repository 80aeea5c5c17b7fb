"""Start TensorRT-LLM worker processes by forking one process that has already imported the
worker copy. Run with the worker venv's python (not shmdisagg's), by `workers.WorkerSet`:

    python forkserver.py WORKER_COPY_DIR

Importing the worker copy's server (`openai_server`, transformers, fastapi, openai) costs about
7 s of CPU per process; a fork after those imports starts a worker in a fraction of that, from
the same code, so the suite can run several workers per test module on a 2-core machine. Each
child runs the copy's own `serve_worker.main()` (its command line in `sys.argv`), exactly what
`python serve_worker.py ...` runs after its imports.

Protocol, one JSON object per line: stdin `{"argv": [...], "log": PATH}` starts a worker and
stdout answers `{"pid": N}`. Children get SIGTERM when this process exits (parent-death signal),
and this process exits when its stdin closes or its own parent dies, after SIGTERM to every
child it started and a SIGKILL to any still running after 10 s.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _child(root: str, argv: list[str], log: str) -> None:
    _die_with_parent()
    os.setpgid(0, 0)  # its own group: a terminal's Ctrl-C reaches pytest, which stops it in order
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # not the fork server's command pipe
    os.close(null)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = [os.path.join(root, "serve_worker.py"), *argv]
    import serve_worker

    try:
        serve_worker.main()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


def _stop(children: set[int]) -> None:
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while children and time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # every child reaped already
            break
        if pid:
            children.discard(pid)
        else:
            time.sleep(0.05)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def main() -> None:
    _die_with_parent()
    root = sys.argv[1]
    sys.path.insert(0, root)
    sys.path.insert(0, os.path.join(root, "src"))
    # What serve_worker.main() imports, loaded once here.
    import serve_worker  # noqa: F401
    import tensorrt_llm.llmapi.disagg_utils
    import tensorrt_llm.llmapi.llm
    import tensorrt_llm.logger
    import tensorrt_llm.serve.openai_server  # noqa: F401

    children: set[int] = set()
    signal.signal(signal.SIGCHLD, lambda *_: _reap(children))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(0)))
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(root, cmd["argv"], cmd["log"])
            children.add(pid)
            print(json.dumps({"pid": pid}), flush=True)
    finally:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _stop(children)


def _reap(children: set[int]) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        children.discard(pid)


if __name__ == "__main__":
    main()
