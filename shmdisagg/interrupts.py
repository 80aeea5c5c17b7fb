"""Stop signals as exceptions, never lost, and a handled Ctrl-C's exit status kept. Imports
nothing heavy: the command and the coordinator import it before their modules load, while a
Ctrl-C may land.

- `raise_interrupted`: the command's SIGINT/SIGTERM handler. It records the signal, then raises
  `Interrupted`. An exception raised where Python swallows it (a finalizer's `__del__`, a weakref
  callback, a library's bare `except:`) would otherwise be lost, and the command would go on
  starting a deployment nobody wants, or wait out a start-up timeout after a Ctrl-C.
- `raise_if_interrupted`: what a start-up wait calls each turn, so a swallowed signal still
  ends it within one poll.
- `exit_status_stands`: a handled Ctrl-C's exit status is the one the command asked for.
"""

from __future__ import annotations

import signal

# Every stop signal taken by `raise_interrupted`, first first; never cleared: the command ends.
received: list[int] = []


class Interrupted(KeyboardInterrupt):
    """A stop signal (SIGINT or SIGTERM) turned into an exception; `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum: int, frame: object) -> None:
    """A signal handler: record `signum` in `received`, then raise `Interrupted`."""
    received.append(signum)
    raise Interrupted(signum)


def raise_if_interrupted() -> None:
    """Raise `Interrupted` for a stop signal that came earlier and was swallowed (`received`)."""
    if received:
        raise Interrupted(received[0])


def exit_status_stands() -> None:
    """Clear CPython's mark of an unhandled KeyboardInterrupt, so the exit status we give stands.

    CPython sets `_Py_UnhandledKeyboardInterrupt` when a C-level `PyRun_*` call ends in a
    KeyboardInterrupt (a Cython or pyo3 module's init runs Python that way), even when the
    interrupt is caught afterwards. Under `python -m shmdisagg.cli`, `Py_RunMain` then exits by
    SIGINT whatever status the `SystemExit` asked for (Modules/main.c): a Ctrl-C during the
    imports ended as "killed by SIGINT" instead of 130. Every interrupt that reaches here was
    handled, so the mark is stale."""
    import ctypes

    try:
        ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 0
    except (AttributeError, ValueError):  # another interpreter: nothing to clear
        pass
