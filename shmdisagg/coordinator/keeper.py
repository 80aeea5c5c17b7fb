"""The deployment's supervisor keeps its coordinator running: it starts the coordinator as a
child and, when it dies after it served, starts another, which adopts the dead one's segments and
fleet (`coordinator/adoption.py`). The fleet serves meanwhile from the last published table.

The supervisor is the launcher under `shmdisagg launch` (`launch.Deployment`) and a small
parent process under `shmdisagg serve` (`run_supervised`). Its identity ("pid:starttime",
`processes.SUPERVISOR_ENV`) goes to the coordinator and from it to every fleet worker, which
stops when the supervisor dies: a SIGKILLed supervisor leaves no process behind (the coordinator
gets a parent-death signal, the workers see the supervisor's pidfd become readable).

Restarting costs a fresh Python process's imports (about 1.5 s of CPU, several seconds on a
loaded machine), so once a coordinator serves, the keeper starts a **standby** coordinator: it
imports everything, then blocks on the pipe named in SHMDISAGG_STANDBY_FD; when the coordinator
dies, one byte on that pipe makes the standby the replacement at once (EOF: it exits quietly).

A coordinator tells its supervisor that its fleet serves by writing one byte to the pipe named
in SHMDISAGG_READY_FD. One that dies before that failed to start: its exit status is the
deployment's (a start-up failure is not retried, as before). One that dies after it is started
again at once (SHMDISAGG_ADOPT=1; with `port: 0`, SHMDISAGG_ADOPT_PORT names the port the first
one picked, read from its `--report_addr` file), then with a growing delay while replacements
keep dying before they serve (RESTART_BACKOFF_S), and after MAX_FAILED_RESTARTS of those in a
row the supervisor gives up and the deployment stops. A coordinator that exits 0 was stopped
(a SIGTERM sent to it alone stops the deployment in order) and is not restarted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from shmdisagg.config import DisaggConfig
from shmdisagg.coordinator.adoption import stop_stale_fleet
from shmdisagg.coordinator.supervisor import STOP_MARGIN_S
from shmdisagg.node_ids import NodeIdClaim, NodeIdError, claim_or_inherit
from shmdisagg.processes import (
    START_FAILED_EXIT,
    SUPERVISOR_ENV,
    ProcessId,
    become_subreaper,
    describe_exit,
    reap_orphans,
)
from shmdisagg.procutil import STOP_SIGNALS, die_with_parent
from shmdisagg.shm.segment import cleanup_stale

log = logging.getLogger("shmdisagg.keeper")

RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)  # after 0, 1, 2, 3, 4+ failed restarts in a row
MAX_FAILED_RESTARTS = 5
COORDINATOR_EXIT_S = 5.0  # the coordinator's own shutdown once its fleet is gone (API, segments)
POLL_S = 0.1

# spawn(extra environment, fds to pass) -> the coordinator process
Spawn = Callable[[dict[str, str], Sequence[int]], "subprocess.Popen[bytes]"]


def coordinator_stop_timeout(config: DisaggConfig) -> float:
    """Seconds to wait for the coordinator after SIGTERM before a SIGKILL: its fleet's grace
    period (`timeout_graceful_shutdown_s`), the supervisor's margin past it, then its own exit."""
    return config.shmdisagg.timeout_graceful_shutdown_s + STOP_MARGIN_S + COORDINATOR_EXIT_S


def exit_status(returncode: int) -> int:
    """A `Popen.returncode` as a shell reports it: -N (killed by signal N) is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class CoordinatorKeeper:
    """Starts the coordinator and restarts it; call `check` every POLL_S, `stop` to end.

    State: `proc` the current coordinator; `served` whether it reported ready; `restarts` how
    many were started after the first; `final` the deployment's exit status once the keeper
    stopped restarting (None while it runs)."""

    def __init__(
        self, spawn: Spawn, config: DisaggConfig, report_addr: str | None = None, node_claim: NodeIdClaim | None = None
    ) -> None:
        """`node_claim`: the deployment's node id (`node_ids.py`), held by the supervisor for the
        deployment's life and handed to every coordinator, so a replacement mints ids with the
        same node field and no other deployment on the host can take it meanwhile."""
        self.spawn = spawn
        self.node_claim = node_claim
        self.config = config
        self.report_addr = report_addr
        self.identity = ProcessId.of(os.getpid())
        self.proc: subprocess.Popen[bytes] | None = None
        self.served = False
        self.ever_served = False  # a coordinator's fleet started (F): a death is restarted
        self.ever_ready = False  # a coordinator reported ready (R): the deployment served
        self.restarts = 0
        self.failed_in_row = 0
        self._crash = ""  # the death of the last coordinator that served, in words
        self.final: int | None = None
        self.stopping = False
        self.adopt_port: int | None = None
        self._ready: int | None = None  # read end of the current coordinator's ready pipe
        self._restart_at: float | None = None
        self.standby: subprocess.Popen[bytes] | None = None  # a warm replacement, waiting
        self._standby_go: int | None = None  # write end of its go pipe
        self._standby_ready: int | None = None  # read end of its ready pipe

    def start(self, adopt: bool = False) -> subprocess.Popen[bytes]:
        """Start a coordinator (`adopt`: one that takes over from a dead one): the warm standby
        when one waits, else a new process."""
        if adopt and self._promote():
            assert self.proc is not None
            return self.proc
        proc, ready = self._spawn(adopt)
        self._close_ready()
        self.proc, self._ready, self.served = proc, ready, False
        return proc

    def _spawn(self, adopt: bool, go: int | None = None) -> tuple[subprocess.Popen[bytes], int]:
        """A coordinator process and the read end of its ready pipe; `go`: the read end of a
        standby's go pipe (it waits on it)."""
        read, write = os.pipe()
        os.set_blocking(read, False)
        env = {SUPERVISOR_ENV: str(self.identity), "SHMDISAGG_READY_FD": str(write)}
        if adopt:
            env["SHMDISAGG_ADOPT"] = "1"
            if self.adopt_port is not None:
                env["SHMDISAGG_ADOPT_PORT"] = str(self.adopt_port)
        if go is not None:
            env["SHMDISAGG_STANDBY_FD"] = str(go)
        fds = [write] if go is None else [write, go]
        if self.node_claim is not None:
            env.update(self.node_claim.env())
            fds.append(self.node_claim.fd)
        try:
            proc = self.spawn(env, fds)
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        return proc, read

    def _start_standby(self) -> None:
        """A standby coordinator (an adopter, waiting on its go pipe), once one serves."""
        go_read, go_write = os.pipe()
        try:
            self.standby, self._standby_ready = self._spawn(adopt=True, go=go_read)
        except OSError as err:  # no standby: a restart starts a process then
            os.close(go_write)
            log.warning("no standby coordinator (%s)", err)
            return
        finally:
            os.close(go_read)
        self._standby_go = go_write
        log.info("warm standby coordinator started (pid %d): it takes over at once if this one dies", self.standby.pid)

    def _promote(self) -> bool:
        """Make the standby the coordinator; False when there is none alive."""
        standby, go, ready = self.standby, self._standby_go, self._standby_ready
        self.standby = self._standby_go = self._standby_ready = None
        if standby is None or go is None or ready is None:
            return False
        try:
            if standby.poll() is not None:
                raise OSError("it exited")
            os.write(go, b"G")
        except OSError:
            os.close(ready)
            return False
        finally:
            os.close(go)
        self._close_ready()
        self.proc, self._ready, self.served = standby, ready, False
        return True

    def stop_standby(self) -> None:
        standby, self.standby = self.standby, None
        for fd in (self._standby_go, self._standby_ready):
            if fd is not None:
                os.close(fd)  # EOF on its go pipe: a waiting standby exits by itself
        self._standby_go = self._standby_ready = None
        if standby is not None:
            with contextlib.suppress(ProcessLookupError):
                standby.kill()
            standby.wait()

    def check(self) -> int | None:
        """One supervision step: None while a coordinator runs or is about to be restarted,
        else the deployment's exit status (the coordinator ended and is not restarted)."""
        if self.final is not None:
            return self.final
        if self._restart_at is not None:
            if time.monotonic() >= self._restart_at and not self.stopping:
                self._restart_at = None
                self.restarts += 1
                self.start(adopt=True)
            return None
        self._read_ready()
        assert self.proc is not None
        code = self.proc.poll()
        if code is None:
            if self.served and not self.stopping and (self.standby is None or self.standby.poll() is not None):
                self.stop_standby()  # reaps one that died
                self._start_standby()
            return None
        self._read_ready()  # a byte written just before it died still counts
        self._close_ready()
        if code == START_FAILED_EXIT:  # its fleet cannot start: a replacement's would not either
            self.final = 1
            self.stop_standby()
            return self.final
        if self.stopping or code == 0 or not self.ever_served:
            self.final = exit_status(code)  # stopped, or failed to start: not a crash to restart
            self.stop_standby()
            return self.final
        why = describe_exit(code)
        if self.served:
            self.failed_in_row, self._crash = 0, f"the coordinator (pid {self.proc.pid}) that served died ({why})"
        else:
            self.failed_in_row += 1
        if self.failed_in_row >= MAX_FAILED_RESTARTS:
            log.error(
                "coordinator restarts keep failing: %s, then %d replacements in a row never became ready "
                "(the last: %s): stopping the deployment",
                self._crash,
                self.failed_in_row,
                why,
            )
            self.final = 1
            self.stop_standby()
            return self.final
        delay = RESTART_BACKOFF_S[min(self.failed_in_row, len(RESTART_BACKOFF_S) - 1)]
        warm = self.standby is not None and self.standby.poll() is None
        log.warning(
            "coordinator (pid %d) died (%s); the fleet keeps serving; %s in %.1f s",
            self.proc.pid,
            why,
            f"its warm standby (pid {self.standby.pid}) takes over" if warm and self.standby else "starting a new one",
            delay,
        )
        self._restart_at = time.monotonic() + delay
        return None

    def stop(self, timeout_s: float | None = None) -> int:
        """Stop the coordinator (SIGTERM, SIGKILL after `timeout_s`, default
        `coordinator_stop_timeout`), then any fleet worker a dead one left; returns the exit status."""
        self.stopping = True
        self.stop_standby()
        timeout_s = coordinator_stop_timeout(self.config) if timeout_s is None else timeout_s
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("coordinator did not stop within %g s; killing it", timeout_s)
                proc.kill()
                proc.wait()
        self._close_ready()
        # a coordinator that died (and was not restarted) stopped nobody: its fleet may still run
        stop_stale_fleet(self.config.shm_prefix, self.config.shmdisagg.timeout_graceful_shutdown_s + STOP_MARGIN_S)
        if self.final is None:
            self.final = exit_status(proc.returncode) if proc is not None and proc.returncode is not None else 0
        return self.final

    def interrupt(self) -> None:
        """Pass a SIGINT on to the coordinator (a second Ctrl-C: its fleet then ends the requests
        still running at once). Safe in a signal handler: no wait, no lock."""
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGINT)

    def owns(self, pid: int) -> bool:
        """For `reap_orphans`: the current coordinator is ours (reaped through its Popen)."""
        for proc in (self.proc, self.standby):
            if proc is not None and proc.pid == pid:
                proc.poll()
                return True
        return False

    def _read_ready(self) -> None:
        """Take what the coordinator wrote on its ready pipe: F sets `ever_served` (its fleet
        started), R `served` too (every worker listens). Non-blocking."""
        if self._ready is None or self.served:
            return
        try:
            got = os.read(self._ready, 2)
        except BlockingIOError:
            return
        if got:
            self.ever_served = True  # b"F": its fleet started, so a death from now on is restarted
        if b"R" in got:  # ready: every fleet worker listens
            self.served = self.ever_ready = True
            if self.config.port == 0 and self.adopt_port is None:
                self.adopt_port = _reported_port(self.report_addr)
            if self.restarts:
                log.info(
                    "coordinator (pid %d) took over (restart %d)", self.proc.pid if self.proc else -1, self.restarts
                )

    def _close_ready(self) -> None:
        if self._ready is not None:
            os.close(self._ready)
            self._ready = None


def _reported_port(path: str | None) -> int | None:
    """The port in a `--report_addr` file ("host:port"), None if unreadable."""
    if path is None:
        return None
    try:
        with open(path) as f:
            port = f.read().strip().rpartition(":")[2]
    except OSError:
        return None
    return int(port) if port.isdigit() else None


def _status_after_signal(signum: int, keeper: CoordinatorKeeper, code: int) -> int:
    """`serve`'s exit status, and its one line for a stop before the deployment was ready:
    128 + the signal's number (README: the start-up contract). A terminal's Ctrl-C reaches the
    coordinator too, which may die by it, or by this keeper's SIGTERM, while Python starts, and
    which leaves the line to this keeper. `code` is the coordinator's status: under 128 it ended
    for its own reason and said so (0: it was ready and stopped, before this keeper read its R)."""
    if keeper.ever_ready or code < 128:
        return code
    if not signum:  # a signal to the coordinator alone
        if code - 128 not in (signal.SIGINT, signal.SIGTERM):
            return code
        signum = code - 128
    print(
        f"shmdisagg: interrupted during start-up ({signal.Signals(signum).name}); stopped what had started",
        file=sys.stderr,
    )
    return 128 + signum


def _serve_preexec() -> None:
    die_with_parent()


def run_supervised(config: DisaggConfig, argv: list[str], report_addr: str | None = None) -> int:
    """`shmdisagg serve`: run `python -m shmdisagg.coordinator ARGV` under a keeper until a stop
    signal or until the coordinator ends for good; returns the exit status. The coordinator
    shares this process group (a terminal's Ctrl-C reaches it and its fleet at once, as before);
    a SIGTERM to this process alone is passed on to it."""
    become_subreaper()
    stop = {"signal": 0}

    def on_signal(signum: int, frame: object) -> None:
        if stop["signal"] and signum == signal.SIGINT:  # a second Ctrl-C, maybe to this pid alone
            keeper.interrupt()
        stop["signal"] = signum

    def spawn(env: dict[str, str], fds: Sequence[int]) -> subprocess.Popen[bytes]:
        full = {**os.environ, **env, "SHMDISAGG_ENV_SHOWN": "1"}
        return subprocess.Popen(
            [sys.executable, "-m", "shmdisagg.coordinator", *argv],
            env=full,
            pass_fds=tuple(fds),
            preexec_fn=_serve_preexec,
        )

    try:
        claim = claim_or_inherit(config.node_id)
    except NodeIdError as err:
        print(f"shmdisagg: coordinator failed to start: {err}", file=sys.stderr)
        return 1
    keeper = CoordinatorKeeper(spawn, config, report_addr, claim)
    old = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    try:
        keeper.start()
        while not stop["signal"]:
            reap_orphans(keeper.owns)
            code = keeper.check()
            if code is not None:
                stop_stale_fleet(config.shm_prefix, config.shmdisagg.timeout_graceful_shutdown_s + STOP_MARGIN_S)
                return _status_after_signal(stop["signal"], keeper, code)
            time.sleep(POLL_S)
        return _status_after_signal(stop["signal"], keeper, keeper.stop())
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        with contextlib.suppress(Exception):
            cleanup_stale(config.shm_prefix, (config.coordinator_socket, config.kv_hint_socket))
        reap_orphans(keeper.owns)
        claim.close()
