"""Loaded by every Python process that has this directory on PYTHONPATH (`count_calls.py` puts
it there for the deployment it starts); acts only in fleet workers. SIGUSR1 starts counting
every function call of the worker's main thread (`sys.setprofile`: Python functions by file,
name and line; C functions by qualified name and calling function), SIGUSR2 stops and writes the counts to
`$SHMDISAGG_COUNT_CALLS/calls.<pid>.tsv` (count, kind, file, name, line; most frequent first)."""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from typing import Any


def _install() -> None:
    out = os.environ.get("SHMDISAGG_COUNT_CALLS")
    try:
        with open("/proc/self/cmdline", "rb") as f:
            fleet_worker = b"shmdisagg.fleet.worker" in f.read()
    except OSError:
        return
    if not out or not fleet_worker:
        return
    counts: Counter[tuple[str, str, str, int]] = Counter()

    def count(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            counts["py", code.co_filename, code.co_name, code.co_firstlineno] += 1
        elif event == "c_call":  # by caller: which Python function made it
            code = frame.f_code
            name = f"{getattr(arg, '__qualname__', repr(arg))} in {code.co_name}"
            counts["c", code.co_filename, name, code.co_firstlineno] += 1

    def start(signum: int, frame: Any) -> None:
        counts.clear()
        sys.setprofile(count)

    def stop(signum: int, frame: Any) -> None:
        sys.setprofile(None)
        final = os.path.join(out, f"calls.{os.getpid()}.tsv")
        with open(final + ".tmp", "w") as f:
            for (kind, path, name, line), n in counts.most_common():
                f.write(f"{n}\t{kind}\t{path}\t{name}\t{line}\n")
        os.replace(final + ".tmp", final)  # the reader sees the whole file or none

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


_install()
