"""End to end: `run(args)` against the scripted server in `fake_openai.py`, checking the JSON."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from shmdisagg.bench import cli
from shmdisagg.bench.trace import BLOCK_TOKENS, SHIPPED_TRACE, load_trace
from tests.conftest import free_port
from tests.unit.bench.fake_openai import FakeOpenAI


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def bench(argv: list[str], **server: Any) -> tuple[dict[str, Any], FakeOpenAI]:
    async def scenario() -> tuple[dict[str, Any], FakeOpenAI]:
        async with FakeOpenAI(free_port(), **server) as fake:
            return await cli.run(parse(["--url", fake.url, "--no-progress", *argv])), fake

    return asyncio.run(scenario())


def expected_hit_rate(n: int) -> float:
    """Prefix-cache hits over full 512-token blocks in trace order, from the hash ids alone."""
    seen: set[tuple[int, ...]] = set()
    cached = prompt = 0
    for req in load_trace(SHIPPED_TRACE, n):
        missed = False
        for k in range(req.input_length // BLOCK_TOKENS):
            key = tuple(req.hash_ids[: k + 1])
            if not missed and key in seen:
                cached += BLOCK_TOKENS
            else:
                missed = True
            seen.add(key)
        prompt += req.input_length
    return cached / prompt


def test_trace_replay_summary_counts_tokens_cache_hits_and_cpu(tmp_path: Path) -> None:
    out, records = tmp_path / "summary.json", tmp_path / "records.jsonl"
    summary, fake = bench(
        [
            "--num-requests",
            "25",
            "--concurrency",
            "1",
            "--max-output-tokens",
            "4",
            "--json",
            str(out),
            "--records",
            str(records),
        ]
    )
    trace = load_trace(SHIPPED_TRACE, 25)

    # what the server was sent
    assert [len(b["prompt"]) for b in fake.bodies] == [r.input_length for r in trace]
    assert {b["model"] for b in fake.bodies} == {"fake-model"}  # discovered via /v1/models
    assert [b["max_tokens"] for b in fake.bodies] == [min(4, r.output_length) for r in trace]

    written = orjson.loads(out.read_bytes())
    assert written == orjson.loads(orjson.dumps(summary, option=orjson.OPT_NON_STR_KEYS))
    assert summary["requests"] == {"sent": 25, "completed": 25, "failed": 0, "cancelled": 0, "without_usage": 0}
    assert summary["errors"] == {"count": 0, "kinds": {}, "examples": {}}
    outputs = [min(4, r.output_length) for r in trace]
    assert summary["throughput"]["total_output_tokens"] == sum(outputs)
    assert summary["throughput"]["total_input_tokens"] == sum(r.input_length for r in trace)
    assert summary["kv_cache_hit_rate"] == pytest.approx(expected_hit_rate(25))
    assert summary["kv_cache_hit_rate"] > 0
    assert summary["cache"]["cached_tokens"] == sum(fake.cached)
    # every hit is explained by an earlier request of this run: a cold cache, not a warm one
    assert summary["cache"]["warm_requests"] == 0 and summary["cache"]["warm_cached_tokens"] == 0
    assert summary["ttft_ms"]["count"] == 25
    assert summary["tpot_ms"]["count"] == sum(1 for n in outputs if n > 1)
    assert summary["itl_ms"]["count"] == sum(n - 1 for n in outputs)  # empty chunks ignored
    assert summary["config"]["mode"] == "closed_loop"

    # AIPerf-named view of the same numbers
    assert summary["time_to_first_token"]["unit"] == "ms"
    assert summary["time_to_first_token"]["avg"] == summary["ttft_ms"]["mean"]
    assert summary["inter_token_latency"]["p99"] == summary["tpot_ms"]["p99"]
    assert summary["request_count"] == {"unit": "requests", "avg": 25}
    assert summary["error_summary"] == []

    # CPU: /cluster_info names this process
    assert summary["cpu"]["pid_source"] == "cluster_info"
    assert summary["cpu"]["pids"] == [os.getpid()]
    assert summary["orchestrator_cpu_ms_per_request"] >= 0

    rows = [orjson.loads(line) for line in records.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(25))
    assert rows[3]["request_id"] == "req-3" and rows[3]["output_tokens"] == 4
    assert len(rows[3]["chunk_ms"]) == 4 and rows[3]["ttft_ms"] == rows[3]["chunk_ms"][0]


def fail_some(n: int) -> str:
    if n % 4 == 3:
        return "http_500"
    return "truncate" if n == 5 else "ok"


def test_open_loop_counts_errors_by_kind_and_tolerates_no_cluster_info(capsys: pytest.CaptureFixture[str]) -> None:
    summary, fake = bench(
        ["--num-requests", "20", "--speedup", "1000", "--max-output-tokens", "3", "--goodput", "e2e:60000"],
        behaviour=fail_some,
        cluster_info=False,
        hold_until=20,
    )
    # hold_until: no answer before all 20 arrived, so this finishing shows the loop was open
    assert len(fake.bodies) == 20
    assert summary["requests"]["sent"] == 20
    assert summary["requests"]["completed"] == 14
    assert summary["errors"]["count"] == 6
    assert summary["errors"]["kinds"] == {"http_500": 5, "incomplete_stream": 1}
    assert "scripted failure" in summary["errors"]["examples"]["http_500"]
    codes = {e["error_details"]["type"]: (e["error_details"]["code"], e["count"]) for e in summary["error_summary"]}
    assert codes == {"http_500": (500, 5), "incomplete_stream": (None, 1)}
    table = capsys.readouterr().out
    assert "http_500, e.g." in table and "scripted failure" in table  # the reason, not only the status
    assert summary["error_request_count"] == {"unit": "requests", "avg": 6}
    assert summary["goodput_slo"]["limits_ms"] == {"e2e_ms": 60000}
    assert summary["goodput_slo"]["good_requests"] == 14
    assert summary["goodput"]["avg"] == pytest.approx(14 / summary["duration_s"])
    assert summary["send_lag_ms"]["count"] == 20
    assert summary["cpu"]["pid_source"] is None
    assert summary["orchestrator_cpu_ms_per_request"] is None
    assert summary["config"]["mode"] == "open_loop"


def test_synthetic_closed_loop_with_explicit_pids() -> None:
    summary, fake = bench(
        [
            "--concurrency",
            "4",
            "--input-len",
            "700",
            "--output-len",
            "6",
            "--num-requests",
            "12",
            "--cpu-pids",
            f"{os.getpid()},{os.getpid()}",
            "--model",
            "given",
        ]
    )
    assert {len(b["prompt"]) for b in fake.bodies} == {700}
    assert {b["model"] for b in fake.bodies} == {"given"}
    assert summary["requests"]["completed"] == 12
    assert summary["kv_cache_hit_rate"] == 0.0  # synthetic prompts share nothing
    assert summary["throughput"]["total_output_tokens"] == 72
    assert summary["cpu"]["pid_source"] == "--cpu-pids" and summary["cpu"]["pids"] == [os.getpid()]


def test_a_concurrency_above_the_request_count_runs_one_loop_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """--concurrency 1000000 with 3 requests made a million request loops (a task each) first."""
    loops: list[int] = []
    real = cli.closed_loop

    def counted(work: Any, send: Any, concurrency: int, counters: Any) -> Any:
        loops.append(concurrency)
        return real(work, send, concurrency, counters)

    monkeypatch.setattr(cli, "closed_loop", counted)
    summary, fake = bench(["--concurrency", "1000000", "--num-requests", "3", "--input-len", "10", "--output-len", "2"])
    assert summary["requests"]["completed"] == 3 and len(fake.bodies) == 3
    assert loops == [3]


def test_table_shows_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    bench(["--num-requests", "3", "--speedup", "1000", "--max-output-tokens", "2", "--goodput", "ttft:1000"])
    table = capsys.readouterr().out
    for heading in (
        "Requests",
        "Latency (ms)",
        "Throughput",
        "Cache",
        "CPU",
        "KV cache hit rate",
        "goodput req/s",
        "goodput SLO (ms)",
        "ttft<=1000",
        "orchestrator CPU ms/request",
        "prompt seed",
    ):
        assert heading in table


def _two_runs(argv: list[str]) -> tuple[dict[str, Any], dict[str, Any], FakeOpenAI]:
    """The same bench command twice against one server (whose prefix cache outlives a run)."""

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], FakeOpenAI]:
        async with FakeOpenAI(free_port()) as fake:
            first = await cli.run(parse(["--url", fake.url, "--no-progress", *argv]))
            return first, await cli.run(parse(["--url", fake.url, "--no-progress", *argv])), fake

    return asyncio.run(scenario())


SYNTHETIC = ["--concurrency", "2", "--input-len", "1100", "--output-len", "2", "--num-requests", "6"]


def test_a_second_run_of_the_same_command_is_cold_too(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the seed was 0 unless given, so the second run sent the first run's prompts and
    measured the cache they had left (a 100 % hit rate, and 30 % faster on the simulator)."""
    first, second, fake = _two_runs(SYNTHETIC)
    assert fake.cached == [0] * 12  # the second run's prompts were new to the server too
    assert second["kv_cache_hit_rate"] == 0.0 and second["cache"]["warm_requests"] == 0
    assert first["config"]["seed"] != second["config"]["seed"]  # a fresh seed per run, recorded
    assert second["config"]["seed_given"] is False
    out, err = capsys.readouterr()
    warm_rows = [line for line in out.splitlines() if "warm from before the run" in line]
    assert len(warm_rows) == 2 and all(line.rstrip().endswith(" no │") for line in warm_rows)
    assert "was warm" not in err


def test_the_same_seed_again_measures_the_cache_it_left_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    _, second, fake = _two_runs([*SYNTHETIC, "--seed", "5"])
    assert fake.cached[6:] == [1024] * 6  # every full 512-token block of the repeated prompts
    assert second["config"]["seed"] == 5 and second["config"]["seed_given"] is True
    assert second["cache"]["warm_requests"] == 6 and second["cache"]["warm_cached_tokens"] == 6 * 1024
    out, err = capsys.readouterr()
    assert "yes: 6 req, 6,144 tok" in out
    assert (
        "shmdisagg bench: the KV cache was warm: 6 of 6 requests found 6,144 prompt tokens cached that no earlier "
        "request of this run had sent (an earlier run with --seed 5, or other traffic with these prompts)"
    ) in err


def test_more_requests_than_the_trace_holds_sends_the_trace_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    whole = len(load_trace(SHIPPED_TRACE, None))
    requests, _ = cli.workload(parse(["--num-requests", str(whole + 1)]))
    assert len(requests) == whole
    assert capsys.readouterr().err == (
        f"shmdisagg bench: the trace holds {whole:,} requests, fewer than --num-requests {whole + 1:,}: "
        f"sending those {whole:,}\n"
    )
    cli.workload(parse(["--num-requests", str(whole)]))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["--input-len", "100"],  # synthetic needs --concurrency
        ["--concurrency", "2", "--input-len", "100", "--trace", str(SHIPPED_TRACE)],
        ["--goodput", "ttft"],
        ["--trace", "/nonexistent/trace.jsonl"],
        ["--cpu-pids", "abc"],
        ["--timeout", "0"],
        ["--timeout", "nan"],
        ["--json", "/nonexistent/dir/run.json"],
        ["--records", "/"],
        ["--plot", "/dev/null"],
        ["--plot-only", "--plot", "/dev/null", "--compare", str(SHIPPED_TRACE)],  # was a FileExistsError traceback
        ["--concurrency", "1", "--input-len", "10", "--vocab-range", "0", "99999999999"],  # an OverflowError
        ["--output-len", "0"],  # without --input-len: was ignored, the trace's lengths sent
        ["--concurrency", "1", "--output-len", "5"],
        ["--concurrency", "1", "--input-len", "10", "--output-len", "0"],
        ["--concurrency", "1", "--num-requests", "1", "--input-len", "100000000000"],  # built 16 GiB of block ids
        ["--concurrency", "1000000000", "--input-len", "10"],  # 10 x 1e9 requests by default
    ],
)
def test_bad_options_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Before any request (the server here does not exist): an output path the run could not
    write came out as a traceback after the whole run, and nan/inf ran with nan durations."""
    assert cli.main(["--url", f"http://127.0.0.1:{free_port()}", "--model", "m", *argv]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_an_output_that_fails_to_write_after_the_run_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The path passed the check (a writable folder) but the write failed at the end: the table
    is printed, the other outputs are written, one line names the one that failed."""
    records = tmp_path / "records.jsonl"
    blocked = tmp_path / "gone"
    blocked.mkdir()

    def vanish(n: int) -> str:
        if blocked.is_dir():  # the folder vanishes during the run, after the options were checked
            blocked.rmdir()
            blocked.write_text("now a file")
        return "ok"

    async def scenario() -> int:
        async with FakeOpenAI(free_port(), behaviour=vanish) as fake:
            argv = ["--url", fake.url, "--num-requests", "2", "--concurrency", "1", "--no-progress"]
            argv += ["--json", str(blocked / "run.json"), "--records", str(records)]
            return await asyncio.to_thread(cli.main, argv)

    assert asyncio.run(scenario()) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and records.exists()
    lines = [line for line in captured.err.splitlines() if line.startswith("shmdisagg bench: error:")]
    assert lines == [f"shmdisagg bench: error: could not write --json: Not a directory ({blocked / 'run.json'})"]


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a refusal at parsing (exit 2), before any request."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "speedup", ["0", "-1", "nan", "inf", "1e-300", "0.0009", "abc"]
)  # 1e-300 scaled the arrivals to ~1e300 s: the replay stalled for ever
def test_a_speedup_that_would_stall_the_replay_is_refused_at_parsing(
    speedup: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _usage_error(["--url", f"http://127.0.0.1:{free_port()}", "--speedup", speedup], capsys)
    assert line.startswith("shmdisagg bench: error: argument --speedup: ") and repr(speedup) in line, line


def test_the_slowest_speedup_is_accepted_and_said_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(["--speedup", "0.001"]).speedup == 0.001
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "at least 0.001" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    "url", ["notaurl", "127.0.0.1:8000", "", "ftp://127.0.0.1:8000", "http://:8000", "http://h:99999", "http://h:x"]
)
def test_a_url_that_is_not_http_host_port_is_refused_at_parsing(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--url notaurl` went to the server and blamed it ("is the server up?")."""
    line = _usage_error(["--url", url, "--model", "m"], capsys)
    assert line == (
        f"shmdisagg bench: error: argument --url: needs http://host:port (e.g. http://127.0.0.1:8000), not {url!r}"
    )


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
        ("https://[::1]:8000", "https://[::1]:8000"),
        ("http://gateway:80/llm/v1", "http://gateway:80/llm"),  # a server behind a path prefix keeps it
    ],
)
def test_a_url_is_read_as_the_servers_base(url: str, base: str) -> None:
    assert parse(["--url", url]).url == base


def test_an_openai_clients_base_url_benches_the_same_server() -> None:
    """OpenAI clients take a base URL ending in /v1: the bench asked /v1/v1/models and failed."""

    async def scenario() -> tuple[dict[str, Any], FakeOpenAI]:
        async with FakeOpenAI(free_port()) as fake:
            argv = ["--url", f"{fake.url}/v1/", "--no-progress", "--num-requests", "2", "--concurrency", "1"]
            return await cli.run(parse(argv)), fake

    summary, fake = asyncio.run(scenario())
    assert summary["requests"]["completed"] == 2 and len(fake.bodies) == 2
    assert {b["model"] for b in fake.bodies} == {"fake-model"}  # found at /v1/models
    assert summary["config"]["url"] == fake.url


def test_a_url_with_a_route_in_it_is_told_to_give_the_base() -> None:
    """--url .../v1/completions asked .../v1/completions/v1/models, got a 404, and advised --model."""

    async def scenario() -> None:
        async with FakeOpenAI(free_port()) as fake:
            await cli.run(parse(["--url", f"{fake.url}/v1/completions", "--no-progress", "--num-requests", "1"]))

    with pytest.raises(cli.BenchError, match=r"404 Not Found; give --url as the server's base \(http://host:port\)"):
        asyncio.run(scenario())


def test_unreachable_server_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--url", f"http://127.0.0.1:{free_port()}", "--num-requests", "1"]) == 2
    assert "cannot list models" in capsys.readouterr().err


def test_all_requests_failing_exits_1() -> None:
    async def scenario() -> int:
        async with FakeOpenAI(free_port(), behaviour=_always_500) as fake:
            return await asyncio.to_thread(
                cli.main, ["--url", fake.url, "--num-requests", "2", "--concurrency", "1", "--no-progress"]
            )

    assert asyncio.run(scenario()) == 1


def _always_500(n: int) -> str:
    return "http_500"


def test_some_requests_failing_exits_1_and_still_prints_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    async def scenario() -> int:
        async with FakeOpenAI(free_port(), behaviour=lambda n: "http_500" if n == 1 else "ok") as fake:
            return await asyncio.to_thread(
                cli.main,
                [
                    "--url",
                    fake.url,
                    "--num-requests",
                    "3",
                    "--concurrency",
                    "1",
                    "--max-output-tokens",
                    "2",
                    "--no-progress",
                ],
            )

    assert asyncio.run(scenario()) == 1
    out, err = capsys.readouterr()
    assert "sent / completed / failed" in out and "3 / 2 / 1" in out and "http_500 x1" in out
    assert "1 of 3 requests failed" in err


@pytest.mark.parametrize(
    ("sig", "status", "said"),
    [
        (2, 130, b"interrupted; cancelling"),  # SIGINT: Ctrl-C
        (15, 143, b"SIGTERM received; cancelling"),  # SIGTERM: kill, timeout(1)
    ],
)
def test_a_stop_signal_interrupts_the_run_exits_128_plus_it_and_the_json_counts_the_cancelled(
    tmp_path: Path, sig: int, status: int, said: bytes
) -> None:
    import sys

    out = tmp_path / "run.json"

    async def scenario() -> tuple[int, bytes, bytes]:
        two_hanging = asyncio.Event()

        def behaviour(n: int) -> str:
            if n < 3:
                return "ok"
            if n == 4:  # requests 3 and 4 are now both in flight, and nothing more is sent
                two_hanging.set()
            return "hang"

        async with FakeOpenAI(free_port(), behaviour=behaviour) as fake:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "shmdisagg.cli",
                "bench",
                "--url",
                fake.url,
                "--no-progress",
                "--concurrency",
                "2",
                "--num-requests",
                "100",
                "--max-output-tokens",
                "2",
                "--json",
                str(out),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                await asyncio.wait_for(two_hanging.wait(), 60)
                proc.send_signal(sig)
                stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            return proc.returncode, stdout, stderr

    rc, stdout, stderr = asyncio.run(scenario())
    assert rc == status, stderr.decode()
    assert said in stderr
    assert b"interrupted: 5 of 100 requests sent, 2 cancelled in flight" in stderr
    assert b"shmdisagg bench (interrupted)" in stdout and b"5 / 3 / 0 / 2" in stdout
    summary = orjson.loads(out.read_bytes())
    assert summary["was_cancelled"] is True
    assert summary["requests"] == {"sent": 5, "completed": 3, "failed": 0, "cancelled": 2, "without_usage": 0}


def test_stop_event_cancels_in_flight_requests_and_reports_the_finished_ones(tmp_path: Path) -> None:
    async def scenario() -> dict[str, Any]:
        stop = asyncio.Event()

        def behaviour(n: int) -> str:
            if n < 3:
                return "ok"
            stop.set()  # the 4th arrival: the user presses Ctrl-C while it is in flight
            return "hang"

        async with FakeOpenAI(free_port(), behaviour=behaviour) as fake:
            args = parse(
                [
                    "--url",
                    fake.url,
                    "--no-progress",
                    "--concurrency",
                    "1",
                    "--num-requests",
                    "10",
                    "--max-output-tokens",
                    "2",
                    "--json",
                    str(tmp_path / "s.json"),
                ]
            )
            return await cli.run(args, stop)

    summary = asyncio.run(scenario())
    assert summary["was_cancelled"] is True
    assert summary["requests"]["completed"] == 3
    assert summary["requests"]["cancelled"] == 1
    assert summary["requests"]["sent"] == 4
    assert orjson.loads((tmp_path / "s.json").read_bytes())["was_cancelled"] is True


def test_cancelling_run_from_outside_still_cancels_it() -> None:
    async def scenario() -> None:
        both_arrived = asyncio.Event()

        def behaviour(n: int) -> str:
            if n == 1:
                both_arrived.set()
            return "hang"

        async with FakeOpenAI(free_port(), behaviour=behaviour) as fake:
            args = parse(["--url", fake.url, "--no-progress", "--num-requests", "2", "--speedup", "1000"])
            task = asyncio.create_task(cli.run(args, asyncio.Event()))
            await both_arrived.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(scenario())


def test_a_json_summary_records_its_timeline_so_it_can_be_compared(tmp_path: Path) -> None:
    from shmdisagg.bench.plot import load_runs

    out = tmp_path / "demo.json"
    bench(["--num-requests", "4", "--concurrency", "2", "--max-output-tokens", "2", "--json", str(out)])  # no --plot
    ((label, run),) = load_runs([str(out)])  # what --compare reads: "has no timeline" before
    assert label == "demo"
    assert len(run["timeline"]["requests"]["ttft_ms"]) == 4
    assert run["timeline"]["server_load"] is None  # sampled only with --plot
