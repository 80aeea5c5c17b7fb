#!/usr/bin/env python
"""Where the fleet's CPU per request goes, by fleet size: `perf record` of every fleet worker.

Issue 14 asks fleet 4 to cost within 10 % of fleet 1 at the same load, or for the profile that
explains the distance. One pair of recording fakes (`bench_trees.fakes_running`) serves every cell.
A cell starts a deployment of this tree with `--fleet` workers (`bench_trees.deployment`), warms
it, then sends `--n` requests at `--concurrency` from this process while `perf record -e
cpu-clock -F HZ -p <every fleet worker>` samples them. Samples become microseconds per request,
grouped by where they fell: the interpreter (libpython), uvloop, httptools, orjson, libc, the
native extension, and the kernel split into scheduling, epoll, networking, syscall entry and the
rest (`CATEGORIES`). The cell also reads the workers' CPU (schedstat), their context switches
and their migrations between cores per request. Fleet sizes take turns within every round.

How to read it: orjson, httptools and libc are C code that a request calls the same number of
times whatever the fleet size, so their microseconds per request rise only if each call runs
slower (colder caches and TLBs after more process switches), not because there is more work;
the line after the table gives that rise.

Needs `perf` (Debian: linux-perf) and `kernel.perf_event_paranoid` at 1 or lower (or root).

    .venv/bin/python benchmarks/profile_fleet.py [--fleet 1,2,4] [--mode nonstream] [--n 3000]
        [--concurrency 32] [--rounds 2] [--hz 4999]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_trees import deployment, fakes_running, load, script_fakes, switches  # noqa: E402
from benchmarks.benchkit import MODES, count, count_or_zero, cpu_ns, positive_ints  # noqa: E402

# Kernel symbols by what they do, first match wins; user-space samples go by their library.
CATEGORIES = (
    (
        "kernel: scheduling",
        re.compile(
            r"finish_task_switch|schedule|_raw_spin_unlock|try_to_wake_up|ttwu|pick_next|update_curr|enqueue|dequeue"
            r"|select_task_rq|psi_|update_load|switch_mm|__switch_to|cpuacct|reweight|set_next|put_prev|load_balance"
            r"|hrtimer|sched"
        ),
    ),
    ("kernel: epoll", re.compile(r"ep_|epoll|fdget")),
    (
        "kernel: network",
        re.compile(
            r"tcp|ip_|__ip|sock|skb|net_|netif|__dev|dev_|inet|loopback|__sys_|sk_|copy_|_copy|vfs_|fsnotify|security_"
        ),
    ),
    ("kernel: syscall entry", re.compile(r"syscall|entry_|exit_to_user|__x64")),
)
LIBRARIES = (
    ("interpreter (libpython)", "libpython"),
    ("uvloop", "loop.cpython"),
    ("httptools", "parser.cpython"),
    ("orjson", "orjson"),
    ("libc", "libc"),
    ("native extension", "_native"),
)
FIXED_CALLS = ("httptools", "orjson", "libc")  # the same calls per request at any fleet size
_SAMPLE = re.compile(r"\s+(\d+)\s+(\S+)\s+\[[.k]\]\s+(.*)")


def category(dso: str, symbol: str) -> str:
    if dso.startswith("[kernel"):
        return next((name for name, pattern in CATEGORIES if pattern.search(symbol)), "kernel: other")
    return next((name for name, part in LIBRARIES if part in dso), "other")


def migrations(pid: int) -> int:
    with open(f"/proc/{pid}/sched") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith("se.nr_migrations"))


def profile(perf_data: str, n: int, hz: int) -> dict[str, float]:
    """Microseconds per request by category, from `perf report` of `perf_data`."""
    out = subprocess.run(
        [
            "perf",
            "report",
            "-i",
            perf_data,
            "--no-children",
            "--sort",
            "dso,sym",
            "-g",
            "none",
            "-F",
            "sample,dso,sym",
            "--stdio",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    samples: Counter[str] = Counter()
    for line in out.splitlines():
        m = _SAMPLE.match(line)
        if m:
            samples[category(m.group(2), m.group(3).strip())] += int(m.group(1))
    return {name: count * 1e6 / hz / n for name, count in samples.items()}


def cell(fakes: list[int], fleet: int, args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    import uvloop

    with deployment(REPO, fakes, fleet) as (base, pids):
        url = f"{base}/v1/completions"
        stream = MODES[args.mode]["stream"]
        uvloop.run(load(url, args.warmup, 10_000_000, stream, args.concurrency))
        data = str(tmp / f"fleet{fleet}.data")
        perf = subprocess.Popen(
            ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(args.hz), "-o", data, "-p", ",".join(map(str, pids))],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.5)  # perf attached to every worker
            c0, s0, m0 = (sum(f(p) for p in pids) for f in (cpu_ns, switches, migrations))
            bad = uvloop.run(load(url, args.n, 0, stream, args.concurrency))
            c1, s1, m1 = (sum(f(p) for p in pids) for f in (cpu_ns, switches, migrations))
        finally:
            perf.send_signal(signal.SIGINT)
            perf.wait()
        n = args.n
        return {
            "cpu_ms": (c1 - c0) / 1e6 / n,
            "switches": (s1 - s0) / n,
            "migrations": (m1 - m0) / n,
            "bad": bad,
            "us": profile(data, n, args.hz),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fleet", default="1,2,4", help="fleet sizes (num_workers)")
    ap.add_argument("--mode", default="nonstream", choices=sorted(MODES))
    ap.add_argument("--n", type=count, default=3000)
    ap.add_argument("--warmup", type=count_or_zero, default=300)
    ap.add_argument("--concurrency", type=count, default=32)
    ap.add_argument("--rounds", type=count, default=2)
    ap.add_argument("--hz", type=count, default=4999, help="perf's sampling frequency")
    args = ap.parse_args()
    fleets = positive_ints(ap, "--fleet", args.fleet)
    runs: dict[int, list[dict[str, object]]] = {f: [] for f in fleets}
    tmp = Path(tempfile.mkdtemp(prefix="profile-fleet-"))
    with fakes_running() as fakes:
        script_fakes(fakes, args.mode)
        for rnd in range(args.rounds):
            for fleet in fleets if rnd % 2 == 0 else reversed(fleets):
                row = cell(fakes, fleet, args, tmp)
                runs[fleet].append(row)
                print(
                    f"round {rnd} f{fleet}: cpu {row['cpu_ms']:.3f} ms/req, switches {row['switches']:.2f}, "
                    f"migrations {row['migrations']:.3f}, bad {row['bad']}",
                    flush=True,
                )
    report(runs, args)
    return 0


def report(runs: dict[int, list[dict[str, object]]], args: argparse.Namespace) -> None:
    fleets = list(runs)
    first, last = fleets[0], fleets[-1]

    def med(fleet: int, key: str) -> float:
        return statistics.median(float(r[key]) for r in runs[fleet])  # type: ignore[arg-type]

    def us(fleet: int, name: str) -> float:
        return statistics.median(r["us"].get(name, 0.0) for r in runs[fleet])  # type: ignore[attr-defined]

    names = [n for n, _ in LIBRARIES] + [n for n, _ in CATEGORIES] + ["kernel: other", "other"]
    print(
        f"\n{time.strftime('%Y-%m-%d %H:%M')}, {args.mode}, N={args.n} after {args.warmup} warm-up, "
        f"c={args.concurrency}, {args.rounds} rounds (medians); load average {os.getloadavg()[0]:.1f}\n"
    )
    print("| µs per request | " + " | ".join(f"fleet {f}" for f in fleets) + f" | fleet {last} − fleet {first} |")
    print("|---|" + "---|" * (len(fleets) + 1))
    for name in names:
        cells = " | ".join(f"{us(f, name):.1f}" for f in fleets)
        print(f"| {name} | {cells} | {us(last, name) - us(first, name):+.1f} |")
    total = {f: sum(us(f, n) for n in names) for f in fleets}
    print(
        "| **all samples** | "
        + " | ".join(f"{total[f]:.1f}" for f in fleets)
        + f" | {total[last] - total[first]:+.1f} |"
    )
    print("| CPU ms/req (schedstat) | " + " | ".join(f"{med(f, 'cpu_ms'):.3f}" for f in fleets) + " | |")
    print("| context switches/req | " + " | ".join(f"{med(f, 'switches'):.2f}" for f in fleets) + " | |")
    print("| migrations/req | " + " | ".join(f"{med(f, 'migrations'):.3f}" for f in fleets) + " | |")
    print("| bad responses | " + " | ".join(str(sum(int(r["bad"]) for r in runs[f])) for f in fleets) + " | |")  # type: ignore[call-overload]
    fixed = {f: sum(us(f, n) for n in FIXED_CALLS) for f in fleets}
    print(
        f"\nCode with fixed calls per request ({', '.join(FIXED_CALLS)}): "
        + ", ".join(f"fleet {f} {fixed[f] / fixed[first]:.2f}×" for f in fleets)
        + f" of fleet {first}; the interpreter: "
        + ", ".join(f"fleet {f} {us(f, LIBRARIES[0][0]) / us(first, LIBRARIES[0][0]):.2f}×" for f in fleets)
    )


if __name__ == "__main__":
    sys.exit(main())
