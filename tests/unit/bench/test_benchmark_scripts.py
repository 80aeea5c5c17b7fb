"""The benchmark scripts under benchmarks/ as a user runs them: a bad option is one argparse
error line (exit 2), and the in-process benchmarks still run against this tree's code at their
smallest sizes. Nothing here is timed: the figures belong to BENCHMARKS.md."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fakes.trtllm_shim import REPO


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["benchmarks/bench_routing.py", "--reps", "0"],
        ["benchmarks/bench_routing.py", "--sizes", "abc"],
        ["benchmarks/bench_relay.py", "--chunks", "-1"],
        ["benchmarks/bench_tokenize.py", "--reps", "0"],
        ["benchmarks/bench_kv_policy.py", "--tpb", "-1"],  # left a /dev/shm segment behind
        ["benchmarks/bench_kv_policy.py", "--algos", "abc"],
        ["benchmarks/bench_pick_servers.py", "--servers", "0"],  # left segments behind
        ["benchmarks/bench_membership.py", "--rounds", "0"],
        ["benchmarks/bench_observe_cpu.py", "--n", "0"],
        ["benchmarks/bench_observe_cpu.py", "--variants", "abc"],
        ["benchmarks/bench_sim_cpu.py", "--outputs", "0"],
        ["benchmarks/bench_upstream.py", "--concurrency", "0"],
        ["benchmarks/bench_routing_quality.py", "--fleet", "0"],
        ["benchmarks/bench_routing_quality.py", "--trace", "no-such-trace.jsonl"],
        ["benchmarks/bench_coordinator_restart.py", "--gap", "nan"],  # measured nothing and exited 0
        ["benchmarks/bench_scaling.py", "--warmup", "-1"],
        ["benchmarks/bench_trees.py", "--tree", "no-such-tree"],
        ["benchmarks/profile_fleet.py", "--fleet", "0"],
        ["benchmarks/count_calls.py", "--fleet", "0"],
        ["benchmarks/gc_memory.py", "abc", "1"],
    ],
    ids=lambda argv: " ".join(a.removeprefix("benchmarks/") for a in argv),
)
def test_a_bad_option_is_one_error_line_and_exit_2(argv: list[str]) -> None:
    done = _run(*argv)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    (line,) = [x for x in done.stderr.splitlines() if "error:" in x]
    assert line.startswith(argv[0].removeprefix("benchmarks/") + ": error: "), done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["benchmarks/bench_observe_cpu.py", "--n", "20", "--rounds", "1"],  # its 'before' variant broke every request
        ["benchmarks/bench_relay.py", "--chunks", "50", "--rounds", "1"],
        ["benchmarks/bench_timers.py", "--n", "100", "--rounds", "1"],
        ["benchmarks/bench_header_callbacks.py", "--n", "1000", "--rounds", "1"],
        ["benchmarks/bench_anthropic.py", "--rounds", "1"],
        ["benchmarks/bench_chat_pin.py", "--reps", "100", "--rounds", "1"],
        ["benchmarks/bench_edge.py", "--requests", "50", "--rounds", "1"],
    ],
    ids=lambda argv: argv[0].removeprefix("benchmarks/"),
)
def test_an_in_process_benchmark_runs_against_this_trees_code(argv: list[str]) -> None:
    done = _run(*argv)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stdout.strip()
