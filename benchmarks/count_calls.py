#!/usr/bin/env python
"""Function calls per request in a fleet worker, by function: where a request's Python goes.

CPU timings on this shared 2-core VM move by ±10 % from run to run; call counts do not. This
starts one pair of recording fakes and a deployment of this tree (`bench_trees`), warms it, then
counts every call the fleet workers' main threads make (`count_calls_hook/sitecustomize.py`:
`sys.setprofile` from SIGUSR1 to SIGUSR2) while `--n` requests run at `--concurrency`, and prints
calls per request: Python functions and C functions apart (a C call by the Python function that
made it), the `--top` most frequent of each. A coroutine counts once per resumption. A profiler
hook slows the worker, so the counts are the output, not its CPU.

    .venv/bin/python benchmarks/count_calls.py [--mode nonstream] [--n 1000] [--fleet 1] [--top 25]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_trees import deployment, fakes_running, load, script_fakes  # noqa: E402
from benchmarks.benchkit import MODES, count, count_or_zero  # noqa: E402

HOOK = Path(__file__).resolve().parent / "count_calls_hook"


def counted(out: Path, pids: list[int], timeout_s: float = 30.0) -> dict[tuple[str, str, str, int], int]:
    """The fleet workers' counts, summed, once every worker has written its file (each renames
    its file into place whole)."""
    files = [out / f"calls.{pid}.tsv" for pid in pids]
    deadline = time.monotonic() + timeout_s
    while not all(f.exists() for f in files):  # written by each worker's SIGUSR2 handler
        if time.monotonic() > deadline:
            raise RuntimeError(f"no call counts from {[f.name for f in files if not f.exists()]}")
        time.sleep(0.05)
    total: dict[tuple[str, str, str, int], int] = defaultdict(int)
    for f in files:
        for line in f.read_text().splitlines():
            n, kind, path, name, lineno = line.split("\t")
            total[kind, path, name, int(lineno)] += int(n)
    return total


def short(path: str) -> str:
    """`shmdisagg/fleet/hot.py`, `uvicorn/...`: the path from the package on."""
    for mark in ("site-packages/", str(REPO) + "/"):
        if mark in path:
            return path.split(mark, 1)[1]
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="nonstream", choices=sorted(MODES))
    ap.add_argument("--n", type=count, default=1000)
    ap.add_argument("--warmup", type=count_or_zero, default=200)
    ap.add_argument("--concurrency", type=count, default=32)
    ap.add_argument("--fleet", type=count, default=1)
    ap.add_argument("--top", type=count, default=25)
    args = ap.parse_args()
    import uvloop

    out = Path(tempfile.mkdtemp(prefix="count-calls-"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH")]))
    os.environ["SHMDISAGG_COUNT_CALLS"] = str(out)
    stream = bool(MODES[args.mode]["stream"])
    with fakes_running() as fakes:
        script_fakes(fakes, args.mode)
        with deployment(REPO, fakes, args.fleet) as (base, pids):
            url = f"{base}/v1/completions"
            uvloop.run(load(url, args.warmup, 10_000_000, stream, args.concurrency))
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)
            bad = uvloop.run(load(url, args.n, 0, stream, args.concurrency))
            for pid in pids:
                os.kill(pid, signal.SIGUSR2)
            counts = counted(out, pids)
    n = args.n
    py = {k: v for k, v in counts.items() if k[0] == "py"}
    c = {k: v for k, v in counts.items() if k[0] == "c"}
    print(
        f"{args.mode}, fleet {args.fleet}, {n} requests at c={args.concurrency} ({bad} bad): "
        f"{sum(py.values()) / n:.1f} Python calls and {sum(c.values()) / n:.1f} C calls per request\n"
    )
    for title, group in (("Python function", py), ("C function", c)):
        print(f"| {title} | calls per request |\n|---|---|")
        for (_, path, name, line), v in sorted(group.items(), key=lambda kv: -kv[1])[: args.top]:
            where = f"{short(path)}:{line} " if path else ""
            print(f"| {where}`{name}` | {v / n:.2f} |")
        print()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
