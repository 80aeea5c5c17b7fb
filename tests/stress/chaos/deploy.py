"""A deployment for a chaos scenario, run through the product's own commands in a subprocess:
`shmdisagg launch` (the launcher starts the simulated executors, the coordinator, its fleet), or
`shmdisagg serve -r SECONDS` with executors this harness starts (the only way to set the per-leg
timeout, `-r`, which `launch` does not take).

Every process of the deployment is tracked (`ProcessTracker`): the launcher or `serve`, each
coordinator the control table names, its children (fleet workers and the warm standby) and
every executor, including those the harness restarted. After `stop()` none may remain.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from shmdisagg.config import load_config
from shmdisagg.executors.plan import build_plan
from shmdisagg.procutil import die_with_parent, listeners
from shmdisagg.shm.table import ControlTable, process_starttime
from tests.conftest import free_port
from tests.integration.harness import REPO, write_config
from tests.stress.chaos.load import MODEL

STOP_WAIT_S = 40.0  # the launcher's ordered stop, bounded: G (1 s here) + the supervisor's 5 s margin + executors


@dataclass(frozen=True)
class Layout:
    """What a scenario deploys. `routers`: (context, generation) router specs; `conditional`:
    conditional_disagg_config.max_local_prefill_length (0: off); `shmdisagg`: settings of the
    `shmdisagg:` section; `leg_timeout_s`: run under `shmdisagg serve -r` instead of `launch`."""

    schedule_style: str = "context_first"
    routers: tuple[Any, Any] = ("round_robin", "round_robin")
    num_ctx: int = 2
    num_gen: int = 2
    conditional: int = 0
    request_timeout_s: float = 6.0
    health_check_interval_s: float = 0.25
    shmdisagg: dict[str, Any] = field(default_factory=dict)
    leg_timeout_s: float | None = None

    def describe(self) -> str:
        names = [r if isinstance(r, str) else r["type"] for r in self.routers]
        extra = f", conditional {self.conditional}" if self.conditional else ""
        serve = f", serve -r {self.leg_timeout_s:g}" if self.leg_timeout_s else ""
        return f"{self.schedule_style}, {names[0]}/{names[1]}{extra}{serve}, {self.num_ctx}+{self.num_gen} executors"

    @property
    def kv_roles(self) -> set[str]:
        roles = set()
        for role, spec in zip(("context", "generation"), self.routers, strict=True):
            if (spec if isinstance(spec, str) else spec["type"]) == "kv_cache_aware":
                roles.add(role)
        return roles


@dataclass(frozen=True)
class Fault:
    """What a fault did: `at` when it was injected, `done` when it had taken effect (a killed
    process gone), both monotonic seconds."""

    what: str
    target: str
    at: float
    done: float


@dataclass
class Executor:
    """One executor: its address and current process (`pid`, None while down)."""

    name: str
    role: str
    slot: int
    port: int
    argv: list[str]
    pid: int | None = None
    proc: subprocess.Popen[bytes] | None = None  # set when this harness started it
    stopped: bool = False  # SIGSTOPped

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"


class ProcessTracker:
    """Samples the deployment's process tree every 0.1 s: every (pid, start time) seen."""

    def __init__(self, roots: Any) -> None:
        self._roots = roots  # () -> list[int]
        self.seen: dict[tuple[int, int], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-procs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self.sample()

    def sample(self) -> None:
        todo = [p for p in self._roots() if p]
        while todo:
            pid = todo.pop()
            try:
                key = (pid, process_starttime(pid))
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue
            self.seen[key] = _cmdline(pid)  # the latest: a child forked but not yet exec'd shows its parent's
            todo.extend(_children(pid))

    def alive(self) -> dict[int, str]:
        """{pid: command line} of every process seen that still runs (a zombie counts as gone)."""
        out = {}
        for (pid, start), cmd in self.seen.items():
            try:
                if process_starttime(pid) == start and not _exited(pid):
                    out[pid] = cmd
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
        return out


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    return out


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    """The command line, shortened for messages."""
    return " ".join(_argv(pid))[:160] or "?"


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2 :].split()[0].decode()


def _exited(pid: int) -> bool:
    """Whether every thread of `pid` has exited (its files, listening sockets included, are
    closed), reaped or not. The thread-group leader shows `Z` as soon as it exits itself, while
    the process's other threads may still hold its files."""
    try:
        return _state(pid) == "Z" and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except (FileNotFoundError, ProcessLookupError):
        return True


def http_json(addr: str, path: str, timeout_s: float = 2.0, method: str = "GET") -> tuple[int | None, Any]:
    """(status, JSON) of a request to host:port; (None, None) when nothing answered."""
    req = urllib.request.Request(f"http://{addr}{path}", method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, orjson.loads(r.read() or b"null")
    except urllib.error.HTTPError as err:
        err.close()
        return err.code, None
    except (OSError, ValueError):
        return None, None


class ChaosDeployment:
    """Start with `start()`, stop with `stop()` (idempotent); `events` lists what the faults
    did (`Fault`); `seen_ids` the disagg ids each role's executors served."""

    def __init__(self, layout: Layout, tmp: Path, shm_prefix: str) -> None:
        self.layout = layout
        self.tmp = tmp
        self.prefix = shm_prefix
        self.log_dir = tmp / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ctx = [f"127.0.0.1:{free_port()}" for _ in range(layout.num_ctx)]
        gen = [f"127.0.0.1:{free_port()}" for _ in range(layout.num_gen)]
        top: dict[str, Any] = {"routers": layout.routers, "schedule_style": layout.schedule_style}
        if layout.conditional:
            top["conditional_disagg_config"] = {"max_local_prefill_length": layout.conditional}
        self.config_path = write_config(
            tmp, shm_prefix, ctx, gen, **top,
            shmdisagg={
                "request_timeout_s": layout.request_timeout_s,
                "health_check_interval_s": layout.health_check_interval_s,
                "timeout_graceful_shutdown_s": 1.0,
                # the harness reads each executor's /perf_metrics (disagg ids): a ring big enough for its polls
                "executors": {"backend": "sim", "model": MODEL, "startup_timeout_s": 60,
                              "sim": {"speedup": 20.0, "num_blocks": 4096,
                                      "extra_args": ["--perf-metrics-max-requests", "100000"]}},
                **layout.shmdisagg,
            },
        )  # fmt: skip
        self.config = load_config(self.config_path)
        self.port = self.config.port
        plan = build_plan(self.config, self.log_dir)
        self.executors = [
            Executor(inst.name, inst.role, slot, inst.port, list(inst.argv)) for slot, inst in enumerate(plan.instances)
        ]
        self.main: subprocess.Popen[bytes] | None = None  # `shmdisagg launch` or `shmdisagg serve`
        self.main_log = self.log_dir / "main.log"
        self.events: list[Fault] = []
        self.tracker = ProcessTracker(self._roots)
        self.seen_ids: dict[str, list[int]] = {"context": [], "generation": []}  # disagg ids the executors served
        self._poller_stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_perf, name="chaos-perf", daemon=True)
        self._lock = threading.Lock()

    # -- start / stop ------------------------------------------------------------------------

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        log = open(self.main_log, "ab")
        cmd = [sys.executable, "-m", "shmdisagg.cli"]
        if self.layout.leg_timeout_s:
            for ex in self.executors:
                self._spawn_executor(ex)
            cmd += ["serve", "-c", str(self.config_path), "-r", f"{self.layout.leg_timeout_s:g}"]
        else:
            cmd += ["launch", "-c", str(self.config_path), "--log-dir", str(self.log_dir)]
        self.main = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            preexec_fn=die_with_parent,
            start_new_session=True,
        )
        log.close()
        self.tracker.start()
        self._wait_ready()
        if not self.layout.leg_timeout_s:
            self._find_launched_executors()
        self._poller.start()

    def _wait_ready(self, timeout_s: float = 90.0) -> None:
        """Until the public port serves with the whole fleet and every executor is healthy."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.main is not None
            if self.main.poll() is not None:
                raise AssertionError(
                    f"the deployment exited with {self.main.returncode} during start-up:\n{self.log_tail()}"
                )
            status, info = http_json(f"127.0.0.1:{self.port}", "/cluster_info", 1.0)
            if status == 200 and len(info.get("fleet_pids", ())) >= self.config.num_workers and self._all_healthy():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the deployment did not come up within {timeout_s:g} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def _all_healthy(self) -> bool:
        try:
            with ControlTable.attach(self.prefix, read_only=True) as table:
                servers = table.servers()
        except Exception:
            return False
        return len(servers) == len(self.executors) and all(s.healthy for s in servers)

    def _find_launched_executors(self) -> None:
        assert self.main is not None
        by_port = {}
        for pid in _children(self.main.pid):
            argv = _argv(pid)
            if "shmdisagg.executors.sim" in argv and "--port" in argv:
                by_port[int(argv[argv.index("--port") + 1])] = pid
        for ex in self.executors:
            ex.pid = by_port.get(ex.port)
            assert ex.pid is not None, f"no process of the launcher serves {ex.name} on port {ex.port}"

    def stop(self) -> float:
        """Stop everything (SIGTERM to the launcher or `serve`, then the executors this harness
        started); returns the seconds it took. A stop that must SIGKILL raises afterwards."""
        began = time.monotonic()
        self._poller_stop.set()
        if self._poller.is_alive():
            self._poller.join(5)
        problems = []
        for ex in self.executors:  # a stopped executor would hold the launcher's stop up
            if ex.stopped and ex.pid:
                self.cont_executor(ex)
        if self.main is not None and self.main.poll() is None:
            self.main.send_signal(signal.SIGTERM)
            try:
                self.main.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                problems.append(f"the deployment did not stop within {STOP_WAIT_S:g} s of SIGTERM")
                os.killpg(self.main.pid, signal.SIGKILL)
                self.main.wait()
        for ex in self.executors:
            if ex.proc is not None and ex.proc.poll() is None:
                ex.proc.terminate()
                try:
                    ex.proc.wait(10)
                except subprocess.TimeoutExpired:
                    problems.append(f"{ex.name} did not stop within 10 s of SIGTERM")
                    ex.proc.kill()
                    ex.proc.wait()
        self.tracker.stop() if self.tracker._thread.is_alive() else self.tracker.sample()
        if problems:
            raise AssertionError("; ".join(problems) + f"\n{self.log_tail()}")
        return time.monotonic() - began

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.main_log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    # -- what is running -------------------------------------------------------------------

    def _roots(self) -> list[int]:
        roots = [self.main.pid] if self.main is not None else []
        roots += [ex.pid for ex in self.executors if ex.pid]
        with contextlib.suppress(Exception):
            with ControlTable.attach(self.prefix, read_only=True, timeout=0.1) as table:
                roots.append(table.coordinator()["pid"])
                roots += [r.pid for r in table.rows()]
        return roots

    def table(self) -> ControlTable:
        return ControlTable.attach(self.prefix, read_only=True)

    def coordinator_pid(self) -> int:
        with self.table() as table:
            return int(table.coordinator()["pid"])

    def worker_pids(self) -> list[int]:
        with self.table() as table:
            return [r.pid for r in table.rows()]

    def listening_pids(self) -> set[int]:
        """The processes listening on the public port (a replacement claims its row a moment
        before it listens)."""
        return {ln.pid for ln in listeners(self.port) if ln.pid is not None}

    def healthy(self, slot: int) -> bool:
        with self.table() as table:
            return any(s.slot == slot and s.healthy for s in table.servers())

    def note(self, what: str, target: str, at: float | None = None) -> None:
        now = time.monotonic()
        self.events.append(Fault(what, target, now if at is None else at, now))

    # -- executors -------------------------------------------------------------------------

    def _spawn_executor(self, ex: Executor) -> None:
        log = open(self.log_dir / f"{ex.name}.log", "ab")
        ex.proc = subprocess.Popen(
            ex.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            preexec_fn=die_with_parent,
            start_new_session=True,
        )
        log.close()
        ex.pid = ex.proc.pid

    def kill_executor(self, ex: Executor) -> None:
        assert ex.pid is not None
        at = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(ex.pid, signal.SIGKILL)
        if ex.proc is not None:
            ex.proc.wait()
        else:  # the launcher's child: it reaps it; wait until it is gone
            wait_gone(ex.pid)
        self.note("executor SIGKILL", ex.name, at)
        ex.pid = None

    def restart_executor(self, ex: Executor, at_once: bool = False) -> None:
        """A fresh executor process on the same port (the launcher does not restart executors;
        this one is the harness's to stop). `at_once`: right after its kill (named apart in the
        report)."""
        assert ex.pid is None
        self._spawn_executor(ex)
        self.note("executor restart at once" if at_once else "executor restart", ex.name)

    def stop_executor(self, ex: Executor) -> None:
        assert ex.pid is not None
        os.killpg(ex.pid, signal.SIGSTOP)
        ex.stopped = True
        self.note("executor SIGSTOP", ex.name)

    def cont_executor(self, ex: Executor) -> None:
        assert ex.pid is not None
        os.killpg(ex.pid, signal.SIGCONT)
        ex.stopped = False
        self.note("executor SIGCONT", ex.name)

    def live_executors(self) -> list[Executor]:
        return [ex for ex in self.executors if ex.pid is not None and not ex.stopped]

    # -- fleet -----------------------------------------------------------------------------

    def kill_worker(self, rng: random.Random) -> int:
        pid = rng.choice(self.worker_pids())
        at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid)  # until then its listening socket may still take connections
        self.note("worker SIGKILL", str(pid), at)
        return pid

    # -- the disagg ids the executors served (their /perf_metrics records) -----------------

    def _poll_perf(self) -> None:
        while not self._poller_stop.wait(0.5):
            self.drain_perf()

    def drain_perf(self) -> None:
        with self._lock:
            for ex in self.live_executors():
                status, records = http_json(ex.addr, "/perf_metrics", 1.0)
                if status != 200 or not isinstance(records, list):
                    continue
                # ctx_request_id: the disagg_request_id of either leg (absent on a plain request)
                self.seen_ids[ex.role] += [r["ctx_request_id"] for r in records if r.get("ctx_request_id") is not None]


def running(pid: int) -> bool:
    """Whether `pid` runs (an exited process its parent has not reaped yet does not)."""
    return not _exited(pid)


def wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    """Until every thread of `pid` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        start = process_starttime(pid)
    except (FileNotFoundError, ProcessLookupError):
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if process_starttime(pid) != start or _exited(pid):
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.002)
