"""Single-node launch: executors, then the coordinator (which starts the fleet).

`Deployment.start()` starts one executor per url of each section (the simulator or
`trtllm-serve`, per `shmdisagg.executors.backend`), waits until each answers `/health` with 200,
starts the coordinator and waits until the public port answers `/health` with 200. Any failure
on the way stops everything already started and raises `LaunchError`. `Deployment.stop()` stops
the coordinator (which stops its fleet and unlinks the shared memory), then the executors, then
removes any segment a hard-killed coordinator left. Every child gets a parent-death signal, so
even a SIGKILLed launcher leaves no process behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from shmdisagg.config import DisaggConfig
from shmdisagg.executors.plan import executor_command
from shmdisagg.procutil import die_with_parent
from shmdisagg.shm.segment import cleanup_stale

log = logging.getLogger("shmdisagg.launch")

STOP_TIMEOUT_S = 15.0


class LaunchError(RuntimeError):
    """The deployment could not be brought up; everything started was stopped."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path | None
    log_file: IO[bytes] | None = None
    reported: bool = False  # its unexpected exit was logged


def http_status(url: str, timeout_s: float = 1.0) -> int | None:
    """Status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status)
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError):
        return None


def public_url(config: DisaggConfig) -> str:
    host = config.hostname
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{config.port}"


class Deployment:
    """A running single-node deployment. Use as a context manager or call start()/stop()."""

    def __init__(self, config: DisaggConfig, config_path: str, log_dir: str | None = None) -> None:
        self.config = config
        self.config_path = os.path.abspath(config_path)
        base = log_dir or (config.shmdisagg.executors.log_dir if config.shmdisagg.executors else None)
        self.log_dir = Path(base or tempfile.mkdtemp(prefix=f"{config.shm_prefix}-logs-"))
        self.executors: list[Child] = []
        self.coordinator: Child | None = None

    @property
    def url(self) -> str:
        return public_url(self.config)

    def __enter__(self) -> "Deployment":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- start ------------------------------------------------------------------------------

    def start(self) -> None:
        try:
            self._start_executors()
            self._start_coordinator()
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, argv: list[str], log_to_file: bool, env: dict[str, str] | None = None) -> Child:
        log_path = self.log_dir / f"{name}.log" if log_to_file else None
        out: IO[bytes] | None = open(log_path, "ab") if log_path else None
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
            env={**os.environ, **(env or {})},
        )
        return Child(name, proc, log_path, out)

    def _start_executors(self) -> None:
        spec = self.config.shmdisagg.executors
        if spec is None:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for role, section in (("context", self.config.context_servers), ("generation", self.config.generation_servers)):
            for i, (host, port) in enumerate(section.addresses()):
                argv, env = executor_command(spec, role, section, host, port)
                self.executors.append(self._spawn(f"{role}-{i}", argv, log_to_file=True, env=env))
        deadline = time.monotonic() + spec.startup_timeout_s
        for child, (host, port) in zip(self.executors, self._addresses()):
            self._wait_healthy(child, f"http://{host}:{port}/health", deadline)

    def _addresses(self) -> list[tuple[str, int]]:
        return self.config.context_servers.addresses() + self.config.generation_servers.addresses()

    def _start_coordinator(self) -> None:
        argv = [sys.executable, "-m", "shmdisagg.coordinator", "-c", self.config_path]
        self.coordinator = self._spawn("coordinator", argv, log_to_file=False)
        deadline = time.monotonic() + self.config.shmdisagg.server_start_timeout_s + 30
        self._wait_healthy(self.coordinator, f"{self.url}/health", deadline)

    def _wait_healthy(self, child: Child, url: str, deadline: float) -> None:
        """Poll `url` until it answers 200; raise LaunchError if `child` exits or time runs out."""
        while True:
            code = child.proc.poll()
            if code is not None:
                raise LaunchError(f"{child.name} exited with code {code} during start-up{self._log_hint(child)}")
            if http_status(url) == 200:
                return
            if time.monotonic() > deadline:
                raise LaunchError(f"{child.name} not healthy at {url} in time{self._log_hint(child)}")
            time.sleep(0.1)

    @staticmethod
    def _log_hint(child: Child) -> str:
        return f" (log: {child.log_path})" if child.log_path else ""

    # -- run / stop -------------------------------------------------------------------------

    def wait(self) -> int:
        """Block until SIGINT/SIGTERM (returns 0) or until the coordinator dies (returns 1)."""
        stop = {"flag": False}

        def on_signal(signum: int, frame: object) -> None:
            stop["flag"] = True

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not stop["flag"]:
                assert self.coordinator is not None
                if self.coordinator.proc.poll() is not None:
                    log.error("coordinator exited with code %s", self.coordinator.proc.returncode)
                    return 1
                for child in self.executors:
                    if child.proc.poll() is not None and not child.reported:
                        log.error("executor %s exited with code %s%s", child.name, child.proc.returncode, self._log_hint(child))
                        child.reported = True
                time.sleep(0.2)
            return 0
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def stop(self) -> None:
        """Stop everything this deployment started; idempotent."""
        if self.coordinator is not None:
            _terminate([self.coordinator.proc])
            self.coordinator = None
        _terminate([c.proc for c in self.executors])
        for child in self.executors:
            if child.log_file:
                child.log_file.close()
        self.executors = []
        # A coordinator killed hard cannot unlink its segments; nobody holds their lock now.
        with contextlib.suppress(Exception):
            removed = cleanup_stale(self.config.shm_prefix)
            if removed:
                log.warning("removed stale shared memory: %s", ", ".join(removed))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.config.coordinator_socket)


def _terminate(procs: list[subprocess.Popen[bytes]], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, wait up to `timeout_s` in total, SIGKILL whatever is left, reap everything."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
