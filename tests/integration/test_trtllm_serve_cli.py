"""`shmdisagg disaggregated` run as `trtllm-serve disaggregated` is, in front of simulators: NVIDIA's
own start script's command line, the start-up wait for every server (`-t`), `--report_addr` with
port 0, `-l`, `-r` and the TensorRT-LLM environment variables that change what a deployment does."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from shmdisagg.executors.sim.testing import SimProcess, get_json
from shmdisagg.node_ids import NodeIdError, claim_node_id
from tests.conftest import free_port
from tests.integration.harness import REPO, wait_until

MODEL = "sim-model"
COMPLETION = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 4}


class Command:
    """A `python -m shmdisagg.cli ...` process; its stderr goes to a file the test reads."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._file = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shmdisagg.cli", *args],
            cwd=REPO,
            stdout=self._file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout_s: float = 60.0) -> None:
        def seen() -> bool:
            assert self.proc.poll() is None or text in self.output(), (
                f"exited with {self.proc.returncode}: {self.output()}"
            )
            return text in self.output()

        wait_until(seen, timeout_s, what=repr(text))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._file.close()
        return code


def sim(port: int | None = None, *args: str) -> SimProcess:
    port = port or free_port()
    return SimProcess(["--port", str(port), "--speedup", "200", "--model", MODEL, *args], port)


@contextlib.contextmanager
def sims(*procs: SimProcess) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for p in procs:
            stack.enter_context(p.start(wait=False))
        for p in procs:
            p.wait_healthy()
        yield


def config(tmp_path: Path, shm_prefix: str, ctx: list[str], gen: list[str], **top: Any) -> Path:
    cfg = {
        "hostname": "127.0.0.1",
        "port": free_port(),
        "num_workers": 1,
        "context_servers": {"urls": ctx},
        "generation_servers": {"urls": gen},
        "shmdisagg": {
            "shm": {"prefix": shm_prefix},
            "coordinator_socket": str(tmp_path / "coord.sock"),
            "health_check_interval_s": 0.2,
        },
        **top,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def call(host: str, port: int, method: str, path: str, body: Any = None) -> tuple[int, dict[str, str], Any]:
    c = http.client.HTTPConnection(host, port, timeout=30)
    try:
        data = orjson.dumps(body) if body is not None else None
        c.request(method, path, body=data, headers={"content-type": "application/json"} if data else {})
        r = c.getresponse()
        raw = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, (orjson.loads(raw) if raw else None)
    finally:
        c.close()


def serving(cmd: Command, host: str, port: int, timeout_s: float = 120.0) -> None:
    """Wait until the deployment answers /health with 200; fail with its output if it exits or
    does not within `timeout_s`."""
    try:
        wait_until(lambda: cmd.proc.poll() is not None or healthy(host, port), timeout_s, "the deployment")
    except AssertionError as err:
        raise AssertionError(f"{err}: {cmd.output()}") from None
    assert cmd.proc.poll() is None, cmd.output()


def healthy(host: str, port: int) -> bool:
    try:
        return call(host, port, "GET", "/health")[0] == 200
    except OSError:
        return False


def test_nvidias_start_server_command_line_runs_unchanged_but_for_the_command_name(tmp_path: Path) -> None:
    """examples/disaggregated/slurm/benchmark/start_server.sh @33338f3c runs gen_server_config.py,
    then `trtllm-serve disaggregated -c ${work_dir}/server_config.yaml -t 7200 -r 7200`; the newest
    also exports TRTLLM_SERVER_DISABLE_GC=1 and TRTLLM_WORKER_DISABLE_GC=1. The config has the
    shape gen_server_config.py writes (its hostname is socket.gethostname(), no shmdisagg section)."""
    ctx, gen = sim(None, "--role", "context"), sim(None, "--role", "generation")
    work = tmp_path / "work"
    (work / "hostnames").mkdir(parents=True)
    (work / "hostnames" / "CTX_0").write_text(ctx.endpoint)
    (work / "hostnames" / "GEN_0").write_text(gen.endpoint)
    hostname, port = socket.gethostname(), free_port()
    server_config = {
        "hostname": hostname,
        "port": port,
        "backend": "pytorch",
        "context_servers": {"num_instances": 1, "urls": [(work / "hostnames" / "CTX_0").read_text()]},
        "generation_servers": {"num_instances": 1, "urls": [(work / "hostnames" / "GEN_0").read_text()]},
    }
    (work / "server_config.yaml").write_text(yaml.dump(server_config))
    address = socket.getaddrinfo(hostname, port, type=socket.SOCK_STREAM)[0][4][0]
    with sims(ctx, gen):
        cmd = Command(
            ["disaggregated", "-c", f"{work}/server_config.yaml", "-t", "7200", "-r", "7200"],
            tmp_path / "serve.log",
            env={"TRTLLM_SERVER_DISABLE_GC": "1", "TRTLLM_WORKER_DISABLE_GC": "1"},
        )
        try:
            serving(cmd, address, port)
            status, headers, body = call(address, port, "POST", "/v1/completions", COMPLETION)
            assert status == 200 and body["usage"]["completion_tokens"] == 4, body
            assert "warning" not in cmd.output() and "error" not in cmd.output().lower(), cmd.output()
        finally:
            assert cmd.stop() == 0, cmd.output()
    prefix = f"shmdisagg-{os.getuid()}-{port}"
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(prefix)]


def test_start_up_waits_for_every_configured_executor(tmp_path: Path, shm_prefix: str) -> None:
    """TensorRT-LLM's orchestrator serves once every configured server's /health is 200, not
    when one per role is: the public port stays closed while the second context server loads."""
    late_port = free_port()
    c0, late, g0 = (
        sim(None, "--role", "context"),
        sim(late_port, "--role", "context"),
        sim(None, "--role", "generation"),
    )
    cfg = config(tmp_path, shm_prefix, [c0.endpoint, late.endpoint], [g0.endpoint])
    port = yaml.safe_load(cfg.read_text())["port"]
    with sims(c0, g0):
        cmd = Command(["serve", "-c", str(cfg), "-t", "120"], tmp_path / "serve.log")
        try:
            cmd.wait_for(f"not ready: context {late.endpoint}")
            assert not healthy("127.0.0.1", port), "the fleet serves before every executor is healthy"
            with late.start():
                serving(cmd, "127.0.0.1", port)
                assert call("127.0.0.1", port, "POST", "/v1/completions", COMPLETION)[0] == 200
                assert cmd.stop() == 0, cmd.output()
        finally:
            cmd.stop()


def test_start_up_fails_after_the_timeout_naming_the_executor_still_down(tmp_path: Path, shm_prefix: str) -> None:
    down = f"127.0.0.1:{free_port()}"
    c0, g0 = sim(None, "--role", "context"), sim(None, "--role", "generation")
    cfg = config(tmp_path, shm_prefix, [c0.endpoint, down], [g0.endpoint])
    with sims(c0, g0):
        cmd = Command(["disaggregated", "-c", str(cfg), "-t", "2"], tmp_path / "serve.log")
        try:
            code = cmd.proc.wait(timeout=60)
        finally:
            cmd.stop()
    assert code == 1, cmd.output()
    assert f"shmdisagg: coordinator failed to start: executors not healthy after 2 s: context {down}" in cmd.output()
    assert "Traceback" not in cmd.output()


def test_report_addr_with_port_0_writes_the_bound_address_and_log_level_applies(
    tmp_path: Path, shm_prefix: str
) -> None:
    c0, g0 = sim(None, "--role", "context"), sim(None, "--role", "generation")
    cfg = config(tmp_path, shm_prefix, [c0.endpoint], [g0.endpoint], port=0)
    addr = tmp_path / "deep" / "nested" / "server.addr"
    with sims(c0, g0):
        cmd = Command(
            ["disaggregated", "-c", str(cfg), "--report_addr", str(addr), "-l", "warning"], tmp_path / "serve.log"
        )
        try:
            wait_until(lambda: addr.exists() or cmd.proc.poll() is not None, 120, "the address file")
            assert cmd.proc.poll() is None, cmd.output()
            host, _, port = addr.read_text().rstrip("\n").rpartition(":")
            assert addr.read_text().endswith("\n") and host == "127.0.0.1" and int(port) > 0, addr.read_text()
            serving(cmd, host, int(port))
            assert call(host, int(port), "POST", "/v1/completions", COMPLETION)[0] == 200
            assert sorted(p.name for p in addr.parent.iterdir()) == [
                "server.addr"
            ]  # written atomically, no temporary left
        finally:
            assert cmd.stop() == 0, cmd.output()
    # -l warning: not the coordinator's info lines ("coordinator ready", "... is healthy")
    assert " INFO " not in cmd.output(), cmd.output()


def _unheld_node_id() -> int:
    """A node id no deployment on this host holds now, from the half of the ring that deployments
    without a `node_id` reach last: they claim upward from uuid.getnode() % 256, so a parallel
    test's deployment cannot take this one between our release and our deployment's claim (CI
    saw `claim_node_id(None)` hand out the id the next deployment under xdist claimed)."""
    start = uuid.getnode() % 256 + 128
    for i in range(128):
        with contextlib.suppress(NodeIdError), claim_node_id((start + i) % 256) as free:
            return free.node_id
    raise AssertionError("no free node id in the far half of the ring")


def test_node_id_and_the_process_id_variable_reach_the_request_id_and_r_reaches_the_workers(
    tmp_path: Path, shm_prefix: str
) -> None:
    """`node_id` and TRTLLM_DISAGG_WORKER_PROCESS_ID are the snowflake id's node and process
    fields (llmapi/disagg_utils.py); `-r` becomes every worker's leg timeout; WEB_CONCURRENCY
    (not an integer here, which uvicorn would fail on) is ignored with a warning and not passed on."""
    node = _unheld_node_id()
    c0, g0 = sim(None, "--role", "context"), sim(None, "--role", "generation")
    cfg = config(tmp_path, shm_prefix, [c0.endpoint], [g0.endpoint], node_id=node)
    port = yaml.safe_load(cfg.read_text())["port"]
    with sims(c0, g0):
        cmd = Command(
            ["disaggregated", "-c", str(cfg), "-r", "7"],
            tmp_path / "serve.log",
            env={"TRTLLM_DISAGG_WORKER_PROCESS_ID": "9", "WEB_CONCURRENCY": "many"},
        )
        try:
            serving(cmd, "127.0.0.1", port)
            status, headers, _ = call("127.0.0.1", port, "POST", "/v1/completions", COMPLETION)
            assert status == 200
            raw = int(headers["x-disagg-request-id"]) - (
                1 << 40
            )  # ids sit in [2**40, 2**63); the raw id is below 2**62 for decades
            assert ((raw >> 16) & 0xFF, (raw >> 10) & 0x3F) == (node, 9)
            pid = call("127.0.0.1", port, "GET", "/cluster_info")[2]["worker_pid"]
            environ = dict(
                item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
            )
            assert environ["SHMDISAGG_LEG_TIMEOUT_S"] == "7.0" and "WEB_CONCURRENCY" not in environ
            assert environ["SHMDISAGG_NODE_ID"] == str(node)  # the coordinator's claim, handed to its fleet
            assert "shmdisagg: warning: WEB_CONCURRENCY is ignored" in cmd.output()
            with pytest.raises(NodeIdError, match=f"node_id {node} is in use"):  # held host-wide while it runs
                claim_node_id(node)
        finally:
            assert cmd.stop() == 0, cmd.output()
    with claim_node_id(node):  # released with the deployment
        pass


def test_trtllm_disagg_no_retry_turns_retries_off(tmp_path: Path, shm_prefix: str) -> None:
    """With max_retries 1 a context 5xx is retried on the other context server; with
    TRTLLM_DISAGG_NO_RETRY=1 (TensorRT-LLM's openai_client: retries 0) it is not."""
    bad, good, g0 = (
        sim(None, "--role", "context", "--fault", "error:status=500"),
        sim(None, "--role", "context"),
        sim(None, "--role", "generation"),
    )
    cfg = config(tmp_path, shm_prefix, [bad.endpoint, good.endpoint], [g0.endpoint], max_retries=1)
    port = yaml.safe_load(cfg.read_text())["port"]
    with sims(bad, good, g0):
        cmd = Command(["serve", "-c", str(cfg)], tmp_path / "serve.log", env={"TRTLLM_DISAGG_NO_RETRY": "1"})
        try:
            serving(cmd, "127.0.0.1", port)
            statuses = [
                call("127.0.0.1", port, "POST", "/v1/completions", COMPLETION)[0] for _ in range(2)
            ]  # round robin: one each
        finally:
            assert cmd.stop() == 0, cmd.output()
        seen = [get_json(s.endpoint, "/sim/stats")[1]["requests_seen"] for s in (bad, good)]
    assert sorted(s == 200 for s in statuses) == [False, True], statuses
    assert seen == [1, 1], seen  # the failed leg was not sent again to the good server


def test_r_bounds_each_leg_and_a_leg_past_it_is_a_504_never_replayed(tmp_path: Path, shm_prefix: str) -> None:
    """`-r/--request_timeout` is upstream's aiohttp total timeout of each call to an executor:
    a context leg that takes longer is a 504 (not retried: its work may be running), and a
    generation stream that stalls past it ends with an SSE error event, while a request whose legs
    each finish within it passes even when the two together take longer."""
    from tests.integration.harness import fake_executors

    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], max_retries=3)
        host, port = "127.0.0.1", yaml.safe_load(cfg.read_text())["port"]
        cmd = Command(["disaggregated", "-c", str(cfg), "-r", "2"], tmp_path / "serve.log")
        try:
            serving(cmd, host, port)
            body = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}
            ctx.script(delay_s=1.2)
            gen.script(delay_s=1.2)  # 2.4 s in all, each leg under 2 s
            assert call(host, port, "POST", "/v1/completions", body)[0] == 200
            ctx.script(delay_s=4.0)
            status, _, err = call(host, port, "POST", "/v1/completions", body)
            assert (
                status == 504
                and err["code"] == 504
                and "did not finish within 2 s (-r/--request_timeout, each leg's limit)" in err["message"]
            )
            assert len(ctx.recorded()) == 2  # the timed-out leg was not replayed on a retry
            ctx.script(delay_s=0.0)
            gen.script(delay_s=0.0, hold=True)  # the stream stalls after its first chunk
            c = http.client.HTTPConnection(host, port, timeout=30)
            c.request(
                "POST",
                "/v1/completions",
                body=orjson.dumps({**body, "stream": True}),
                headers={"content-type": "application/json"},
            )
            raw = c.getresponse().read()
            c.close()
            events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]" and orjson.loads(events[-2])["error"]["code"] == 504
        finally:
            gen.release()
            assert cmd.stop() == 0, cmd.output()


def test_launch_takes_r_as_serve_does(tmp_path: Path, shm_prefix: str) -> None:
    """`shmdisagg launch -r N` bounds each leg as `serve -r N` does (a config whose
    request_timeout_s is longer than 180 s needs it: the legs are cut at -r first)."""
    from tests.integration.harness import fake_executors

    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = config(tmp_path, shm_prefix, [ctx.addr], [gen.addr])
        host, port = "127.0.0.1", yaml.safe_load(cfg.read_text())["port"]
        cmd = Command(["launch", "-c", str(cfg), "-r", "1"], tmp_path / "launch.log")
        try:
            serving(cmd, host, port)
            ctx.script(delay_s=2.0)
            status, _, err = call(host, port, "POST", "/v1/completions", {"model": "fake-model", "prompt": "hi"})
            assert status == 504 and "did not finish within 1 s (-r/--request_timeout" in err["message"], err
        finally:
            assert cmd.stop() == 0, cmd.output()
