"""Process identity and liveness that survive a coordinator restart: a pid with its start time,
pidfds, the deployment's supervisor, and the reaping of orphaned fleet workers.

Fleet workers outlive a coordinator that dies (the supervisor starts a new one, which adopts
them: `coordinator/adoption.py`), so they cannot die with their parent. They die with the
deployment's **supervisor** instead: the process whose death ends the deployment (the launcher
under `shmdisagg launch`, the small parent under `shmdisagg serve`, or the coordinator itself
when it runs alone). Its identity travels in SUPERVISOR_ENV as "pid:starttime"; a worker opens a
pidfd on it at start and stops when it becomes readable (pidfds work for non-children
and become readable once the process exits).

A pid alone is not an identity (pids are reused), and /proc/<pid> of a zombie still exists: a
process is alive only if /proc/<pid>/stat shows the same start time and a state other than Z
(zombie) or X (dead). A worker orphaned by its coordinator's death is re-parented to the nearest
child subreaper: the supervisor marks itself one (`become_subreaper`) and reaps what is not its
own (`reap_orphans`), else such workers would stay zombies on a machine whose init does not reap.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# A fleet worker's exit status for a config error (one line on its stderr): its coordinator stops
# the start rather than restart what would fail alike (coordinator/supervisor.py).
CONFIG_ERROR_EXIT = 2
# A coordinator's exit status when its start failed for a reason a restart would meet again (its
# fleet could not start); its keeper ends the deployment with status 1 rather than restart it.
START_FAILED_EXIT = 3
SUPERVISOR_ENV = "SHMDISAGG_SUPERVISOR"
_PR_SET_CHILD_SUBREAPER = 36


def _stat(pid: int) -> tuple[str, int]:
    """(state letter, start time in clock ticks since boot) from /proc/<pid>/stat (fields 3 and
    22). Raises FileNotFoundError (or ProcessLookupError) if the process is gone."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])


def process_starttime(pid: int) -> int:
    """Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22); guards pid reuse.

    Raises FileNotFoundError if the process is gone.
    """
    return _stat(pid)[1]


@dataclass(frozen=True)
class ProcessId:
    """A process as pid + start time: a reused pid is another process."""

    pid: int
    starttime: int

    @classmethod
    def of(cls, pid: int) -> ProcessId:
        """The process running as `pid` now. Raises FileNotFoundError if there is none."""
        return cls(pid, process_starttime(pid))

    @classmethod
    def parse(cls, text: str | None) -> ProcessId | None:
        """From "pid:starttime" (SUPERVISOR_ENV); None when absent or malformed."""
        pid, _, start = (text or "").partition(":")
        if not (pid.isdigit() and start.isdigit()):
            return None
        return cls(int(pid), int(start))

    def __str__(self) -> str:
        return f"{self.pid}:{self.starttime}"

    def alive(self) -> bool:
        """Running (not a zombie) with the same start time."""
        try:
            state, start = _stat(self.pid)
        except (OSError, ValueError, IndexError):
            return False
        return start == self.starttime and state not in ("Z", "X", "x")

    def pidfd(self) -> int | None:
        """A pidfd on this process (readable once it exits), or None if it is gone already.
        Opened first, checked second: a pid reused in between is caught by the start time."""
        try:
            fd = os.pidfd_open(self.pid)
        except (ProcessLookupError, OSError):
            return None
        if not self.alive():
            os.close(fd)
            return None
        return fd


def describe_exit(returncode: int) -> str:
    """A `Popen.returncode` in words, the same in every log line: "exit 3", "killed by SIGKILL"
    (-N: killed by signal N)."""
    if returncode < 0 and -returncode in signal.valid_signals():
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit {returncode}"


def supervisor_of(environ: Mapping[str, str]) -> ProcessId | None:
    """The deployment's supervisor named in `environ` (SUPERVISOR_ENV), if any."""
    return ProcessId.parse(environ.get(SUPERVISOR_ENV))


def become_subreaper() -> None:
    """Make this process the child subreaper of its descendants (Linux prctl): an orphaned
    fleet worker is re-parented here, not to init, and `reap_orphans` collects it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap_orphans(own: Callable[[int], bool]) -> int:
    """Reap every exited child for which `own(pid)` is False (an adopted orphan); returns how
    many. An exited child of our own is left for its `Popen` (`own` reaps it through
    `Popen.poll`, so it no longer blocks the scan, and returns True)."""
    reaped = 0
    seen: set[int] = set()
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped
        if info is None or info.si_pid in seen:
            return reaped
        seen.add(info.si_pid)
        if own(info.si_pid):
            continue
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)
            reaped += 1
