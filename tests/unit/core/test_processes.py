"""Process identity across a coordinator restart (`shmdisagg/processes.py`): a zombie or a reused
pid is not the process, a pidfd sees an exit, and a subreaper collects orphans."""

from __future__ import annotations

import os
import select
import subprocess
import sys

from shmdisagg.processes import ProcessId, supervisor_of


def test_a_running_process_is_alive_and_a_reused_pid_or_a_zombie_is_not() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    me = ProcessId.of(proc.pid)
    assert me.alive()
    assert not ProcessId(proc.pid, me.starttime + 1).alive()  # the same pid, another start: another process
    assert proc.stdin is not None
    proc.stdin.close()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    with open(f"/proc/{proc.pid}/stat") as f:
        assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
    assert not me.alive()
    assert me.pidfd() is None
    proc.wait()


def test_a_pidfd_becomes_readable_when_the_process_exits() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    fd = ProcessId.of(proc.pid).pidfd()
    assert fd is not None
    try:
        assert select.select([fd], [], [], 0)[0] == []
        assert proc.stdin is not None
        proc.stdin.close()
        assert select.select([fd], [], [], 10)[0] == [fd]
    finally:
        os.close(fd)
        proc.wait()


def test_the_supervisor_identity_round_trips_through_the_environment() -> None:
    me = ProcessId.of(os.getpid())
    assert supervisor_of({"SHMDISAGG_SUPERVISOR": str(me)}) == me
    assert supervisor_of({}) is None
    assert supervisor_of({"SHMDISAGG_SUPERVISOR": "12:x"}) is None


def test_a_subreaper_reaps_the_orphans_it_inherits_and_leaves_its_own_children() -> None:
    # in a child of its own (a subreaper for the test process itself would change pytest's children)
    script = r"""
import os, subprocess, sys, time
from shmdisagg.processes import become_subreaper, reap_orphans
become_subreaper()
own = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
# a middle process starts a grandchild and exits at once: the grandchild is orphaned to us
middle = subprocess.run([sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen(['sleep', '0.2']).pid)"],
                        capture_output=True, text=True)
orphan = int(middle.stdout)
deadline = time.monotonic() + 10
reaped = 0
while time.monotonic() < deadline and os.path.exists(f"/proc/{orphan}"):
    reaped += reap_orphans(lambda pid: pid == own.pid)
    time.sleep(0.02)
print(reaped, os.path.exists(f"/proc/{orphan}"), own.poll())
own.stdin.close(); own.wait()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "False", "None"]  # the orphan reaped, our own child untouched
