"""Single-node launch: executors, then the coordinator (which starts the fleet).

`Deployment.start()` first checks that the fleet can listen on the public host:port (nothing
else listens there), then builds the launch plan (`executors/plan.py`: one instance per url of each
section, the simulator or `trtllm-serve` per `shmdisagg.executors.backend`), writes each
instance's option file, starts every instance with its own log file (`<log dir>/<name>.log`,
headed by its command line) and waits for all of them at once until each answers `/health`
with 200. While an instance loads it may answer 503 with `x-trtllm-server-state: starting`, or
refuse connections: both mean "keep waiting", but only while its process is alive and only
until `shmdisagg.executors.startup_timeout_s`; a 200 counts only from the instance's own
process (`procutil.listens_on`). Then it starts the coordinator and waits until it reports ready
on its pipe (every fleet worker listens; `coordinator/keeper.py`). Any failure on the way stops everything already
started and raises `LaunchError` naming the instance, its log and what it last answered; an
interrupt (whatever the caller's SIGINT/SIGTERM handlers raise) stops it all the same. Every
10 s of waiting it logs what is not ready yet.

`Deployment.stop()` stops the coordinator (which stops its fleet, giving requests in flight
`timeout_graceful_shutdown_s`, and unlinks the shared memory; SIGKILL after
`coordinator_stop_timeout`), then the executors (so they serve those last requests), then
removes any segment a hard-killed coordinator left. Each executor runs in its own process
group, so the processes a `trtllm-serve` starts (MPI ranks for TP > 1) are signalled with it;
SIGTERM first, SIGKILL after `stop_timeout_s`. The coordinator runs in its own session too (a
terminal's Ctrl-C reaches the launcher alone, which stops the rest in this order). Every child
gets a parent-death signal, so even a SIGKILLed launcher leaves no executor or coordinator behind.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from shmdisagg.config import DisaggConfig, log_dir_problem
from shmdisagg.coordinator.keeper import CoordinatorKeeper, coordinator_stop_timeout
from shmdisagg.executors.plan import LaunchPlan, PlanError, build_plan
from shmdisagg.interrupts import raise_if_interrupted
from shmdisagg.node_ids import NodeIdClaim, NodeIdError, claim_or_inherit
from shmdisagg.portuser import public_port_taken
from shmdisagg.processes import describe_exit, reap_orphans
from shmdisagg.procutil import STOP_SIGNALS, die_with_parent, listens_on, public_port_problem
from shmdisagg.shm.segment import cleanup_stale

log = logging.getLogger("shmdisagg.launch")

STOP_TIMEOUT_S = 15.0
POLL_INTERVAL_S = 0.1
WAIT_REPORT_S = 10.0  # while waiting for readiness, how often to log who is not ready yet


class LaunchError(RuntimeError):
    """The deployment could not be brought up; everything started was stopped."""

    exit_status = 1  # what the command exits with: 1 a runtime failure, 2 a bad option or config key


class LogDirError(LaunchError):
    """The log directory cannot be created or written; exit 2 when --log-dir or
    shmdisagg.executors.log_dir named it (only the kernel knew: check-config cannot tell)."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path | None
    log_file: IO[bytes] | None = None
    reported: bool = False  # its unexpected exit was logged
    own_group: bool = False  # leads its own process group: signals go to the whole group
    health_url: str = ""
    addr: str = ""  # an executor's host:port

    @property
    def label(self) -> str:
        """How log lines name it: `generation-1 (127.0.0.1:8202)`, the coordinator by name."""
        return f"{self.name} ({self.addr})" if self.addr else self.name


@dataclass(frozen=True)
class Probe:
    """One `GET /health`: the status (None when nothing answered) and TensorRT-LLM's
    `x-trtllm-server-state` header (`starting` while the model loads)."""

    status: int | None
    state: str | None = None
    foreign: bool = False  # the answer came from a process that is not the child (procutil.listens_on)

    @property
    def ready(self) -> bool:
        return self.status == 200 and not self.foreign

    def describe(self) -> str:
        if self.foreign:
            return f"HTTP {self.status} from another process: the port was taken after launch found it free"
        if self.status is None:
            return "no answer (connection refused or timed out)"
        if self.state:
            return f"still {self.state} (HTTP {self.status}, x-trtllm-server-state: {self.state})"
        return f"last answered HTTP {self.status}"


def probe(url: str, timeout_s: float = 1.0) -> Probe:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return Probe(int(r.status), r.headers.get("x-trtllm-server-state"))
    except urllib.error.HTTPError as err:
        state = err.headers.get("x-trtllm-server-state") if err.headers else None
        err.close()
        return Probe(err.code, state)
    except (urllib.error.URLError, OSError):
        return Probe(None)


def http_status(url: str, timeout_s: float = 1.0) -> int | None:
    """Status of a GET, or None when nothing answers."""
    return probe(url, timeout_s).status


def public_url(config: DisaggConfig) -> str:
    host = config.hostname
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    elif ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"http://{host}:{config.port}"


def coordinator_stage(fleet_started: bool) -> str:
    """Where a coordinator that has not reported ready is: `fleet_started` when it said so on its
    ready pipe (keeper.py's F)."""
    if fleet_started:
        return "fleet started, its workers not listening yet"
    return "fleet not started yet (the coordinator starts it once every executor is healthy)"


class Deployment:
    """A running single-node deployment. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        config: DisaggConfig,
        config_path: str,
        log_dir: str | None = None,
        *,
        background: bool = False,
        request_timeout: int | None = None,
    ) -> None:
        self.config = config
        # `request_timeout`: each leg's timeout in seconds, the coordinator's -r (None: its default, 180; 0: none)
        self.request_timeout = request_timeout
        # `background`: run under another command that stops it itself (`bench --launch`): the
        # coordinator and its fleet log to <log dir>/coordinator.log instead of the terminal. (They
        # run in their own session either way, so a Ctrl-C, or `timeout`'s SIGTERM, to the
        # terminal's process group reaches only the launching command, which stops them in order.)
        self.background = background
        self.config_path = os.path.abspath(config_path)
        configured = config.shmdisagg.executors.log_dir if config.shmdisagg.executors else None
        base = log_dir or configured
        # where the log directory came from, for messages about it
        self.log_dir_source = "--log-dir" if log_dir else "shmdisagg.executors.log_dir" if configured else "the default"
        # One log directory per deployment (named by its shared-memory prefix), reused by the
        # next launch of the same deployment rather than a new temporary directory each time.
        self.log_dir = Path(base or Path(tempfile.gettempdir()) / f"{config.shm_prefix}-logs")
        self.plan: LaunchPlan | None = None
        self.executors: list[Child] = []
        self._claim_sock: socket.socket | None = None
        self.coordinator: Child | None = None
        self._started_coordinator = False  # whose sockets stop() may remove after a hard kill
        self.coordinator_exit: int | None = None  # its exit status, when it ended for good under wait()
        self.keeper: CoordinatorKeeper | None = None  # restarts a coordinator that dies after it served
        self._keeper_lock = threading.Lock()
        self._keeping: threading.Thread | None = None
        self._coordinator_gone = threading.Event()
        self._coordinator_standby: Child | None = None  # the keeper's warm replacement
        self.node_claim: NodeIdClaim | None = None

    @property
    def url(self) -> str:
        return public_url(self.config)

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- start ------------------------------------------------------------------------------

    def start(self) -> None:
        # Before starting anything: with the public port taken, the fleet workers could only
        # crash-loop on "Address already in use" (and whatever listens there would answer our
        # readiness check).
        problem = public_port_problem(self.config.hostname, self.config.port)
        if problem:
            # who holds it, as check-config says (portuser.py); the plain line if that cannot tell
            user = public_port_taken(self.config, self.config_path)
            raise LaunchError(user or problem)
        self._claim()
        try:
            self._start_executors()
            self._start_coordinator()
        except BaseException:
            self.stop()
            raise

    def _claim(self) -> None:
        """Claim this deployment (its shared-memory prefix) for the launcher's lifetime: two
        launches started at once would otherwise both pass the port checks, then kill each
        other's executors. An abstract Unix socket name is the claim: the kernel frees it when
        this process exits, however it exits, and it leaves no file behind."""
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            claim.bind(f"\0shmdisagg-launch-{self.config.shm_prefix}")
        except OSError:
            claim.close()
            raise LaunchError(
                f"another launch with shared-memory prefix {self.config.shm_prefix} (of this config or another) "
                "is starting or running: stop it, or give this deployment another shmdisagg.shm.prefix"
            ) from None
        self._claim_sock = claim

    def _spawn(
        self,
        name: str,
        argv: list[str],
        log_to_file: bool,
        env: dict[str, str] | None = None,
        own_group: bool = False,
        new_session: bool = False,
        pass_fds: Sequence[int] = (),
        standby: bool = False,
    ) -> Child:
        """`own_group`: the child leads its own process group and is signalled with it;
        `new_session`: its own session too, but signals go to the child alone. The child is
        registered (in `executors`, or as `coordinator`) before this returns, with SIGINT and
        SIGTERM held back meanwhile, so an interrupt cannot leave a child stop() does not know."""
        log_path = self.log_dir / f"{name}.log" if log_to_file else None
        try:
            out: IO[bytes] | None = open(log_path, "ab") if log_path else None
        except OSError as err:
            raise self._log_dir_error(f"cannot write {name}.log: ", err) from None
        try:
            if out is not None:
                out.write(
                    f"# {time.strftime('%Y-%m-%d %H:%M:%S')} shmdisagg launch: {_shell_line(argv, env)}\n".encode()
                )
                out.flush()
            with _stop_signals_held():
                proc = subprocess.Popen(
                    argv,
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=_child_preexec,
                    start_new_session=own_group or new_session,
                    env={**os.environ, **(env or {})},
                    pass_fds=tuple(pass_fds),
                )
                child = Child(name, proc, log_path, out, own_group=own_group)
                if name == "coordinator" and standby:
                    if self._coordinator_standby is not None and self._coordinator_standby.log_file:
                        self._coordinator_standby.log_file.close()  # a standby that died
                    self._coordinator_standby = child
                elif name == "coordinator":
                    if self.coordinator is not None and self.coordinator.log_file:
                        self.coordinator.log_file.close()  # the one it replaces (a restart)
                    self.coordinator = child
                    self._started_coordinator = True
                else:
                    self.executors.append(child)
        except BaseException as err:  # an interrupt too: until the child is registered, its log is ours to close
            if out is not None:
                out.close()
            if isinstance(err, OSError):
                raise LaunchError(f"{name}: cannot run {argv[0]}: {err.strerror or err}") from None
            raise
        return child

    def _log_dir_error(self, what: str, err: OSError | str) -> LaunchError:
        why = err if isinstance(err, str) else (err.strerror or str(err))
        error = LogDirError(f"log directory {self.log_dir} ({self.log_dir_source}): {what}{why}")
        error.exit_status = 1 if self.log_dir_source == "the default" else 2  # a bad option or key: usage
        return error

    def _make_log_dir(self) -> None:
        problem = log_dir_problem(self.log_dir)
        if problem:
            raise self._log_dir_error("", problem)
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise self._log_dir_error("cannot create it: ", err) from None

    def _start_executors(self) -> None:
        spec = self.config.shmdisagg.executors
        if spec is None:
            urls = [*self.config.context_servers.urls, *self.config.generation_servers.urls]
            log.info(
                "no shmdisagg.executors section: starting no executors; the coordinator waits up to %g s for the "
                "listed ones (%s) to serve (shmdisagg serve does the same; add a shmdisagg.executors section "
                "to have launch start them)",
                self.config.shmdisagg.server_start_timeout_s,
                ", ".join(urls),
            )
            return
        try:
            self.plan = build_plan(self.config, self.log_dir.absolute())
        except PlanError as err:
            raise LaunchError(f"config error: {err}") from None
        unresolved = [inst.addr for inst in self.plan.instances if not _resolvable(inst.addr)]
        if unresolved:
            raise LaunchError(f"cannot resolve executor address: {', '.join(unresolved)}")
        bind_errors = {inst.addr: address_bind_error(inst.addr) for inst in self.plan.instances if inst.port}
        foreign = [addr for addr, e in bind_errors.items() if e == errno.EADDRNOTAVAIL]
        if foreign:
            raise LaunchError(
                f"executor address not on this machine: {', '.join(foreign)} (launch starts the executors here; "
                "executors elsewhere: start them yourself and use shmdisagg serve)"
            )
        busy = [addr for addr, e in bind_errors.items() if e is not None]
        if busy:
            # Otherwise another deployment's executor would answer our readiness checks.
            raise LaunchError(f"executor address already in use: {', '.join(busy)} (is another deployment running?)")
        self._make_log_dir()  # only now: a refused launch leaves none
        for inst in self.plan.instances:
            try:
                inst.write_options()
            except OSError as err:
                raise self._log_dir_error(f"cannot write {inst.name}'s option file: ", err) from None
            child = self._spawn(inst.name, inst.argv, log_to_file=True, env=inst.env, own_group=True)
            child.health_url, child.addr = f"http://{inst.addr}/health", inst.addr
            log.info(
                "started %s (pid %d) on %s%s",
                inst.name,
                child.proc.pid,
                inst.addr,
                f", GPUs {','.join(inst.gpus)}" if inst.gpus else "",
            )
        # With disagg_cluster they bind a port the kernel picks and register it: the coordinator
        # learns them from the cluster store and waits for disagg_cluster.minimal_instances
        self._wait_ready([c for c in self.executors if not c.addr.endswith(":0")], spec.startup_timeout_s)

    def _start_coordinator(self) -> None:
        if self.background:
            self._make_log_dir()
        try:  # the request ids' node field, held by the launcher for the deployment's life
            self.node_claim = claim_or_inherit(self.config.node_id)
        except NodeIdError as err:
            raise LaunchError(str(err)) from None
        self.keeper = CoordinatorKeeper(self._spawn_coordinator, self.config, node_claim=self.node_claim)
        self.keeper.start()
        assert self.coordinator is not None
        self._wait_coordinator_ready()
        log.info("coordinator is ready: every fleet worker listens")
        if self.config.disagg_cluster is not None and self.executors:
            self._wait_registered()
        self._keeping = threading.Thread(target=self._keep, name="coordinator-keeper", daemon=True)
        self._keeping.start()

    def _wait_coordinator_ready(self) -> None:
        """Until the coordinator reports ready on its pipe (keeper.py's R: every fleet worker
        listens); the public /health answers as soon as one does, so it is not the signal. A
        coordinator that dies after its fleet started (F) is restarted meanwhile; one that dies
        before, or a wait past `server_start_timeout_s` + 30 s, ends the launch."""
        assert self.keeper is not None and self.coordinator is not None
        budget = self.config.shmdisagg.server_start_timeout_s + 30
        deadline = time.monotonic() + budget
        report_at = time.monotonic() + WAIT_REPORT_S
        while not self.keeper.served:
            raise_if_interrupted()
            final = self.keeper.check()
            if final is not None:
                raise LaunchError(
                    f"coordinator ended during start-up (exit status {final}){self._log_hint(self.coordinator)}"
                )
            now = time.monotonic()
            if now > deadline:
                raise LaunchError(f"coordinator did not report ready within {budget:g} s")
            if now >= report_at:
                report_at = now + WAIT_REPORT_S
                log.info(
                    "still waiting (%.0f s left) for the coordinator: %s",
                    deadline - now,
                    coordinator_stage(self.keeper.ever_served),
                )
            time.sleep(0.01)

    def _wait_registered(self) -> None:
        """With disagg_cluster: until the executors it started registered and the public /health
        says ready (`minimal_instances` prepared), within `startup_timeout_s`; an executor that
        exits meanwhile ends the launch."""
        spec = self.config.shmdisagg.executors
        timeout = spec.startup_timeout_s if spec is not None else self.config.shmdisagg.server_start_timeout_s
        deadline = time.monotonic() + timeout
        while http_status(f"{self.url}/health") != 200:
            raise_if_interrupted()
            for child in self.executors:
                code = child.proc.poll()
                if code is not None:
                    raise LaunchError(
                        f"{child.name} ended while registering ({describe_exit(code)}){self._log_hint(child)}"
                    )
            if time.monotonic() > deadline:
                uri = self.config.disagg_cluster.cluster_uri if self.config.disagg_cluster else ""
                raise LaunchError(
                    f"the executors did not register at {uri} and become ready within {timeout:g} s "
                    "(public /health not 200)"
                )
            time.sleep(POLL_INTERVAL_S)
        log.info("executors registered: /health is ready")

    def _spawn_coordinator(self, env: dict[str, str], fds: Sequence[int]) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "shmdisagg.coordinator", "-c", self.config_path]
        if self.request_timeout is not None:
            argv += ["-r", str(self.request_timeout)]
        # Always its own session: a terminal's Ctrl-C reaches the launcher alone, which stops
        # the coordinator (and so its fleet) in order, never one caught in the middle of its imports.
        # SHMDISAGG_LAUNCHED: an interrupted start-up is reported by the launcher, not twice
        child = self._spawn(
            "coordinator",
            argv,
            log_to_file=self.background,
            env={"SHMDISAGG_LAUNCHED": "1", **env},
            new_session=True,
            pass_fds=fds,
            standby="SHMDISAGG_STANDBY_FD" in env,
        )
        return child.proc

    def _keep(self) -> None:
        """The keeper's thread: restarts a coordinator that dies (`coordinator/keeper.py`) until
        `stop()` or until the keeper gives up (`coordinator_exit` set, `wait()` returns 1)."""
        while True:
            with self._keeper_lock:
                if self.keeper is None or self.keeper.stopping:
                    return
                code = self.keeper.check()
                standby = self._coordinator_standby
                if standby is not None and standby.proc is self.keeper.proc:  # promoted
                    if self.coordinator is not None and self.coordinator.log_file:
                        self.coordinator.log_file.close()
                    self.coordinator, self._coordinator_standby = standby, None
                if code is not None:
                    self.coordinator_exit = code
                    self._coordinator_gone.set()
                    return
            time.sleep(POLL_INTERVAL_S)

    def _wait_ready(self, children: list[Child], timeout_s: float) -> None:
        """Poll every child's health URL until each answers 200, an executor's from its own
        listener: a 200 from a process that took its port in the moment between launch's port
        check and its bind is not its answer. Raise LaunchError as soon as one exits, or when
        `timeout_s` passes, naming what the first unready one last answered."""
        deadline = time.monotonic() + timeout_s
        report_at = time.monotonic() + WAIT_REPORT_S
        pending = list(children)
        last: dict[str, Probe] = {}
        while True:
            raise_if_interrupted()  # a stop signal swallowed where it landed still ends the wait
            for child in list(pending):
                code = child.proc.poll()
                if code is not None:
                    raise LaunchError(
                        f"{child.name} ended during start-up ({describe_exit(code)}){self._log_hint(child)}"
                    )
                p = probe(child.health_url)
                if p.ready and not listens_on(child.proc.pid, int(child.addr.rpartition(":")[2])):
                    # another process took the port between our check and the child's bind: its 200
                    # is not this executor's, which will fail to bind and exit (reported above)
                    p = Probe(p.status, p.state, foreign=True)
                    if not (child.name in last and last[child.name].foreign):
                        log.warning("%s: %s", child.label, p.describe())
                if p.ready:
                    pending.remove(child)
                    log.info("%s is ready", child.label)
                    continue
                if p.state and (child.name not in last or last[child.name].state != p.state):
                    log.info("%s is %s", child.label, p.state)
                last[child.name] = p
            if not pending:
                return
            now = time.monotonic()
            if now >= report_at:
                report_at = now + WAIT_REPORT_S
                log.info(
                    "still waiting (%.0f s left) for /health to answer 200: %s",
                    max(0.0, deadline - now),
                    "; ".join(f"{c.label}: {last[c.name].describe()}" for c in pending if c.name in last),
                )
            if now > deadline:
                child = pending[0]
                others = f"; {len(pending) - 1} more not ready" if len(pending) > 1 else ""
                raise LaunchError(
                    f"{child.name} not healthy at {child.health_url} within {timeout_s:g} s: "
                    f"{last[child.name].describe()}{others}{self._log_hint(child)}"
                )
            time.sleep(POLL_INTERVAL_S)

    @staticmethod
    def _log_hint(child: Child) -> str:
        if not child.log_path:
            return ""
        tail = _last_line(child.log_path)
        return f" (log: {child.log_path}" + (f"; last line: {tail}" if tail else "") + ")"

    # -- run / stop -------------------------------------------------------------------------

    def wait(self, reap: bool = False) -> int:
        """Block until SIGINT/SIGTERM (returns 0) or until the coordinator ends for good
        (returns 1; its exit status in `coordinator_exit`): a coordinator that dies after it
        served is restarted meanwhile (`_keep`), its fleet serving on. `reap`: this process is the
        child subreaper of the deployment (`processes.become_subreaper`): collect the fleet
        workers a dead coordinator left, when they exit."""
        stop = {"flag": False}

        def on_signal(signum: int, frame: object) -> None:
            if stop["flag"] and signum == signal.SIGINT:  # a second Ctrl-C before the stop began
                self.forward_sigint()
            stop["flag"] = True

        old = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
        try:
            while not stop["flag"]:
                if reap:
                    reap_orphans(self._owns)
                if self._coordinator_gone.is_set():
                    log.error(
                        "the coordinator is gone for good (exit status %s): stopping the deployment",
                        self.coordinator_exit,
                    )
                    return 1
                for child in self.executors:
                    if child.proc.poll() is not None and not child.reported:
                        log.error(
                            "executor %s ended (%s)%s",
                            child.label,
                            describe_exit(child.proc.returncode),
                            self._log_hint(child),
                        )
                        child.reported = True
                time.sleep(0.2)
            return 0
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def stop(self) -> None:
        """Stop everything this deployment started; idempotent. A second Ctrl-C (or SIGTERM)
        while stopping does not interrupt it (that would leave children and segments behind): a
        Ctrl-C goes on to the coordinator's process group (`forward_sigint`), whose fleet workers
        then end the requests still running at once instead of after timeout_graceful_shutdown_s
        (uvicorn's "CTRL+C to force quit"; `fleet.worker.GracefulStop`)."""
        with _stop_signals_ignored(forward_sigint=self.forward_sigint):
            self._stop()

    def forward_sigint(self) -> None:
        """Pass a SIGINT on to the coordinator's process group (itself and its fleet): a second
        Ctrl-C. Safe in a signal handler: no wait, no lock."""
        coordinator = self.coordinator
        if coordinator is not None and coordinator.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(coordinator.proc.pid, signal.SIGINT)

    def _owns(self, pid: int) -> bool:
        """For `reap_orphans`: an executor or the coordinator is reaped through its Popen."""
        for child in [*self.executors, *(c for c in (self.coordinator, self._coordinator_standby) if c is not None)]:
            if child.proc.pid == pid:
                child.proc.poll()
                return True
        return False

    def _stop(self) -> None:
        with self._keeper_lock:  # no restart from here on
            keeper, self.keeper = self.keeper, None
        if keeper is not None:
            keeper.stopping = True
        if self._keeping is not None and self._keeping is not threading.current_thread():
            self._keeping.join()
        if keeper is not None:
            keeper.stop_standby()
        if self._coordinator_standby is not None:
            if self._coordinator_standby.log_file:
                self._coordinator_standby.log_file.close()
            self._coordinator_standby = None
        if self.coordinator is not None:
            _terminate([self.coordinator], coordinator_stop_timeout(self.config))
            if self.coordinator.log_file:
                self.coordinator.log_file.close()
            self.coordinator = None
        if keeper is not None:  # a coordinator that died and was not restarted left its fleet running
            keeper.stop(0.0)
        spec = self.config.shmdisagg.executors
        _terminate(self.executors, spec.stop_timeout_s if spec else STOP_TIMEOUT_S)
        for child in self.executors:
            if child.log_file:
                child.log_file.close()
        self.executors = []
        # A coordinator killed hard cannot unlink its segments and sockets; nobody holds their
        # lock now. The sockets are removed only if this launch started a coordinator, and only
        # under the lock of its dead control segment: a refused launch must never touch the
        # sockets of the live deployment it collided with (cleanup_stale raises
        # DeploymentRunning then, before removing anything).
        sockets = (self.config.coordinator_socket, self.config.kv_hint_socket) if self._started_coordinator else ()
        with contextlib.suppress(Exception):
            removed = cleanup_stale(self.config.shm_prefix, sockets)
            if removed:
                log.warning("removed stale shared memory: %s", ", ".join(removed))
        if self.node_claim is not None:  # every process that minted ids with it is gone
            self.node_claim.close()
            self.node_claim = None
        if self._claim_sock is not None:  # last: the next launch may start now
            self._claim_sock.close()
            self._claim_sock = None


@contextlib.contextmanager
def _stop_signals_ignored(forward_sigint: Callable[[], None] | None = None) -> Iterator[None]:
    """SIGINT and SIGTERM ignored for the block (main thread only: elsewhere signals cannot be
    changed); `forward_sigint`: called for a SIGINT instead (passing it on)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    if forward_sigint is not None:
        signal.signal(signal.SIGINT, lambda signum, frame: forward_sigint())
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM blocked in this thread for the block: one that arrives meanwhile is
    delivered (its handler runs) when the block ends, not in the middle of it."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _child_preexec() -> None:
    """In a child before exec: die with the launcher, and take the stop signals the launcher
    holds back while it starts the child (a blocked signal mask is inherited)."""
    die_with_parent()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _signal(child: Child, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if child.own_group:
            os.killpg(child.proc.pid, sig)
        elif child.proc.poll() is None:
            child.proc.send_signal(sig)


def _resolvable(addr: str) -> bool:
    """Whether the host of host:port resolves (a name that does not would look like a busy port)."""
    host, _, port = addr.rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return True


def address_bind_error(addr: str) -> int | None:
    """None if host:port can be bound right now (nothing listens there), else why not: the
    errno, EADDRNOTAVAIL when the host is no address of this machine, EADDRINUSE when taken."""
    host, _, port = addr.rpartition(":")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host.strip("[]"), int(port)))
    except OSError as err:
        return err.errno or errno.EADDRINUSE
    return None


def _terminate(children: list[Child], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, wait up to `timeout_s` in total, SIGKILL whatever is left, reap everything.
    A child that leads its own group takes the whole group with it (what it started, too)."""
    for child in children:
        if child.proc.poll() is None:
            _signal(child, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %g s; killing it", child.label, timeout_s)
            _signal(child, signal.SIGKILL)
            child.proc.kill()
            child.proc.wait()
        if child.own_group:
            _signal(child, signal.SIGKILL)  # anything of its group still running once it is gone


def _shell_line(argv: list[str], env: dict[str, str] | None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return f"{prefix} {shlex.join(argv)}" if prefix else shlex.join(argv)


def _last_line(path: Path, limit: int = 200) -> str:
    """The last non-empty line of a log file that is not indented, shortened to `limit`
    characters ('' if none): an indented line continues the one above it (a warning's source
    line, `  disagg_auth.validate(`, under its `FutureWarning: ...`; a traceback's frames, whose
    last line, the exception, is not indented)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [ln.rstrip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    headers = [i for i, ln in enumerate(lines) if ln.startswith("# ")]  # the launcher's, one a start
    lines = lines[headers[-1] + 1 :] if headers else lines
    if not lines:  # the executor wrote nothing since its last start
        return ""
    line = next((ln for ln in reversed(lines) if not ln[0].isspace()), lines[-1]).strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."
