from __future__ import annotations

import subprocess
import sys

from shmdisagg.bench.procstat import ProcCpu, read_proc_cpu, sample, usage_between

# Says it is up, waits for a line, burns 0.3 s of its own CPU time, says so, then waits for
# stdin to close.
BURNER = """
import sys, time
print("ready", flush=True)
sys.stdin.readline()
t = time.process_time()
while time.process_time() - t < 0.3:
    pass
print("done", flush=True)
sys.stdin.read()
"""


def test_cpu_of_a_child_burning_cpu_is_measured_and_its_exit_reported() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline() == "ready\n"  # interpreter start-up is over
        before = sample([child.pid])
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        after = sample([child.pid])
        child.stdin.close()  # lets the child exit; Popen's exit waits for it
    usage = usage_between(before, after, [child.pid])
    # 300 ms burnt; /proc counts in clock ticks (10 ms), plus a little loop overshoot.
    assert 280 <= usage.per_pid_ms[child.pid] <= 400
    assert usage.total_ms == usage.per_pid_ms[child.pid]
    assert usage.vanished == [] and usage.appeared == []
    gone = usage_between(before, sample([child.pid]), [child.pid])
    assert gone.vanished == [child.pid]
    assert gone.total_ms == 0 and gone.per_pid_ms == {}
    assert read_proc_cpu(child.pid) is None


def test_a_reused_pid_counts_as_vanished_and_a_new_pid_counts_in_full() -> None:
    before = {10: ProcCpu(10, start_ticks=100, cpu_ticks=50), 11: ProcCpu(11, 100, 0)}
    after = {10: ProcCpu(10, start_ticks=999, cpu_ticks=5), 11: ProcCpu(11, 100, 3), 12: ProcCpu(12, 500, 7)}
    usage = usage_between(before, after, [10, 11, 12, 13])
    assert usage.vanished == [10]
    assert usage.appeared == [12]
    assert usage.unreadable == [13]
    tick_ms = usage.per_pid_ms[11] / 3
    assert usage.per_pid_ms == {11: 3 * tick_ms, 12: 7 * tick_ms}


def test_own_process_reads_like_os_times() -> None:
    import os

    reading = read_proc_cpu(os.getpid())
    assert reading is not None
    times = os.times()
    ticks = os.sysconf("SC_CLK_TCK")
    assert abs(reading.cpu_ticks / ticks - (times.user + times.system)) < 0.1
