"""CPU time of other processes, read from `/proc/<pid>/stat`.

Owns the before/after sampling that turns into "orchestrator CPU ms per request". Reads only
`/proc`; never signals or otherwise touches the processes it measures. A pid whose process is gone
at the second sample (or was replaced: its start time changed) is reported as vanished and left out
of the total, because its CPU up to exit cannot be read any more.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ProcCpu:
    """One reading: the process's start time (ticks since boot, to spot pid reuse) and its
    utime + stime in ticks, all threads included."""

    pid: int
    start_ticks: int
    cpu_ticks: int


@dataclass(slots=True)
class CpuUsage:
    """CPU used between two samples. `per_pid_ms` covers pids present in both samples (or, for
    `appeared`, started after the first one); `vanished` were in the first sample only."""

    total_ms: float = 0.0
    per_pid_ms: dict[int, float] = field(default_factory=dict)
    vanished: list[int] = field(default_factory=list)
    appeared: list[int] = field(default_factory=list)
    unreadable: list[int] = field(default_factory=list)


def read_proc_cpu(pid: int) -> ProcCpu | None:
    """utime + stime of `pid`, or None when there is no such process (or it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: the fields we need follow its last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    # fields[0] is field 3 (state); utime, stime, starttime are fields 14, 15, 22.
    return ProcCpu(pid=pid, start_ticks=int(fields[19]), cpu_ticks=int(fields[11]) + int(fields[12]))


def sample(pids: Iterable[int]) -> dict[int, ProcCpu]:
    """Readings for the pids that exist now."""
    out: dict[int, ProcCpu] = {}
    for pid in pids:
        reading = read_proc_cpu(pid)
        if reading is not None:
            out[pid] = reading
    return out


def usage_between(
    before: dict[int, ProcCpu],
    after: dict[int, ProcCpu],
    requested: Iterable[int] = (),
) -> CpuUsage:
    """CPU used from `before` to `after`. Pids in `after` but not in `before` count in full
    (they started during the run); `requested` pids readable in neither are `unreadable`."""
    usage = CpuUsage()
    ms_per_tick = 1000.0 / _TICKS_PER_S
    for pid, start in before.items():
        end = after.get(pid)
        if end is None or end.start_ticks != start.start_ticks:
            usage.vanished.append(pid)
            continue
        usage.per_pid_ms[pid] = (end.cpu_ticks - start.cpu_ticks) * ms_per_tick
    for pid, end in after.items():
        if pid not in before:
            usage.appeared.append(pid)
            usage.per_pid_ms[pid] = end.cpu_ticks * ms_per_tick
    usage.unreadable = sorted(set(requested) - before.keys() - after.keys())
    usage.total_ms = sum(usage.per_pid_ms.values())
    return usage
