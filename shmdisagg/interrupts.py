"""A handled Ctrl-C's exit status, kept: what a command or the coordinator exits with after
catching a KeyboardInterrupt is the status it asked for. Imports nothing heavy: both import it
before their modules load, while a Ctrl-C may land."""

from __future__ import annotations


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
