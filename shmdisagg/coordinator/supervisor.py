"""Fleet supervision: start `num_workers` fleet workers, notice a death at once, reclaim the dead
worker's counter row exactly, start a replacement in the same index.

Death is detected with a pidfd per worker registered on the event loop (readable the moment the
process exits, so a dead worker's picks are reclaimed at once), not by polling. The dead worker's
row is zeroed by `ControlTable.reclaim_rows_of_pid`, which is exact because the row is that
worker's whole contribution to every load sum.

Workers outlive their coordinator: when it dies they go on serving from the table, and the
coordinator the deployment's supervisor starts next **adopts** them (`adopt`): each live row
names its worker's fleet index, the worker gets a pidfd like a child (pidfds work for
non-children) and is signalled through it (`AdoptedProcess`); the rows of workers that died
meanwhile are reclaimed and their indexes started again. Workers die with the deployment's
supervisor instead (`shmdisagg/processes.py`): each watches the supervisor's pidfd, and gets
a parent-death signal only when the coordinator is its own supervisor (nothing would restart it).

A worker that is alive but stuck (a blocked event loop, SIGSTOP) still has connections queued on
its share of the port, so `watch` kills one whose row has not heart-beaten for `worker_timeout_s`
(gunicorn's worker `timeout`); the death path above then reclaims and replaces it.

A replacement must serve within a couple of seconds, but a fresh Python process spends most of a
second importing uvicorn, FastAPI and pydantic (measured: 0.8 s alone, 0.8-1.9 s to the first
answer on a loaded 2-core machine). So the supervisor keeps one warm **standby** process that
has done its imports and waits on stdin for the index it is to take over; a death promotes it at
once and a new standby is started in the background.

Until a worker has claimed its row it is judged against `CLAIM_GRACE_S` or `worker_timeout_s`,
whichever is longer: a process still importing on a loaded machine (seen: 2.4 s under pytest-xdist
on 2 cores) is starting, not stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from shmdisagg.processes import CONFIG_ERROR_EXIT, SUPERVISOR_ENV, ProcessId
from shmdisagg.procutil import die_with_parent
from shmdisagg.shm.table import ControlTable

log = logging.getLogger("shmdisagg.coordinator")

RESPAWN_BACKOFF_S = (0.0, 0.2, 1.0, 5.0)  # after 1, 2, 3, 4+ quick deaths in a row
QUICK_DEATH_S = 2.0


def _backoff(lived_s: float, quick_deaths: int) -> tuple[int, float]:
    """(quick deaths in a row, delay before the next start) for a process that lived `lived_s`
    after `quick_deaths` quick deaths: a backoff only while replacements keep dying young (a
    crash loop), never on a first death."""
    quick = quick_deaths + 1 if lived_s < QUICK_DEATH_S else 0
    return quick, RESPAWN_BACKOFF_S[min(max(quick - 1, 0), len(RESPAWN_BACKOFF_S) - 1)]


# On stop, how long past the workers' grace period (`timeout_graceful_shutdown_s`) they get to
# end their last requests and exit before the SIGKILL (they need END_MARGIN_S of it at most).
STOP_MARGIN_S = 5.0
CLAIM_GRACE_S = 15.0  # seconds a started or promoted worker may take to claim its row


class AdoptedProcess:
    """A fleet worker a dead coordinator started: not our child, so it is signalled through its
    pidfd (never a reused pid) and its exit status is not ours to read (`wait` gives None)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd = pidfd

    def send_signal(self, sig: int) -> None:
        """Raises ProcessLookupError once it has exited."""
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
        except OSError as err:  # EBADF: its pidfd is closed, it has exited
            raise ProcessLookupError(err.errno, "adopted worker has exited") from None

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self) -> int | None:
        return None


@dataclass
class WorkerProc:
    index: int
    proc: subprocess.Popen[bytes] | AdoptedProcess
    pidfd: int
    started: float  # loop.time() (CLOCK_MONOTONIC seconds) when started or promoted
    quick_deaths: int = 0
    killed: bool = False  # by kill_stuck, once
    listening: bool = False  # it said its socket on the public port listens (`mark_listening`)


def _worker_preexec() -> None:
    """In the child before exec: ignore a terminal's Ctrl-C (the coordinator stops workers with
    SIGTERM; a worker serving requests re-installs its own SIGINT handler, a standby waiting on
    stdin must not print a traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker_preexec_dying() -> None:
    """`_worker_preexec`, and die with the coordinator: it is the deployment's supervisor."""
    die_with_parent()
    _worker_preexec()


class FleetSupervisor:
    """Owns the fleet worker processes. Signal handlers only call `stop()` via the loop."""

    def __init__(
        self,
        table: ControlTable,
        config_path: str,
        num_workers: int,
        env: dict[str, str] | None = None,
        worker_timeout_s: float = 0.0,
        drop_env: tuple[str, ...] = (),
        supervisor: ProcessId | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        """`env` is added to this process's environment for every worker, `drop_env` removed
        from it (WEB_CONCURRENCY, as TensorRT-LLM's fleet launcher strips it); `pass_fds` stay
        open in every worker (the node-id lock, `node_ids.py`). `supervisor`: the process whose
        death ends the deployment (None: this coordinator)."""
        self.table = table
        self.supervisor = supervisor or ProcessId.of(os.getpid())
        self.adopted = 0  # live workers of a dead coordinator taken over by `adopt`
        self.drop_env = drop_env
        self.pass_fds = pass_fds
        self.worker_timeout_s = worker_timeout_s
        self.stuck_kills = 0  # workers killed by `watch` for a stale heartbeat
        self.config_path = os.path.abspath(config_path)
        self.num_workers = num_workers
        self.env = env or {}
        self.workers: dict[int, WorkerProc] = {}
        self.restarts = 0
        self._stopping = False
        self._exited: dict[int, asyncio.Event] = {}
        # fleet index -> exit status of a worker that exited with a config error before it listened
        self.config_errors: dict[int, int] = {}
        self._standby: subprocess.Popen[bytes] | None = None
        self._standby_fd: int | None = None  # its pidfd, read by the loop: a standby that dies is replaced
        self._standby_started = 0.0
        self._standby_quick_deaths = 0
        self.on_exit: Callable[[int], None] | None = (
            None  # called with the index of a worker that exited, before any replacement
        )

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers.values()]

    def mark_listening(self, pid: int) -> bool:
        """A worker's word (`POST /listening`) that its socket on the public port listens, so
        the kernel queues connections for it from now on. False for a pid that is not ours."""
        for w in self.workers.values():
            if w.proc.pid == pid:
                w.listening = True
                return True
        return False

    def not_listening(self) -> list[int]:
        """The fleet indexes without a worker that listens (adopted workers listen already)."""
        return [
            i
            for i in range(self.num_workers)
            if i not in self.workers
            or not (self.workers[i].listening or isinstance(self.workers[i].proc, AdoptedProcess))
        ]

    def start(self) -> None:
        """Start a worker for every fleet index not held by an adopted one, and the standby."""
        for index in range(self.num_workers):
            if index not in self.workers:
                self._spawn(index, quick_deaths=0)
        self._start_standby()

    def adopt(self) -> list[int]:
        """A restarted coordinator, before `start`: take over the live workers the table's rows
        name (fleet index, pid, start time), reclaim the rows of those that died meanwhile, and
        stop any live worker whose index this fleet no longer has. Returns the adopted indexes."""
        loop = asyncio.get_running_loop()
        for row in self.table.rows():
            proc = ProcessId(row.pid, row.starttime)
            pidfd = proc.pidfd()
            if pidfd is None or row.fleet_index in self.workers or row.fleet_index < 0:
                if pidfd is not None:  # a duplicate index, or not a fleet worker: not ours to keep
                    with contextlib.suppress(OSError):
                        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
                    os.close(pidfd)
                    continue
                held = row.dispatched - row.completed
                self.table.reclaim_row(row.row)
                if 0 <= row.fleet_index < self.num_workers and self.on_exit is not None:
                    self.on_exit(row.fleet_index)
                log.warning(
                    "fleet worker %d (pid %d) died while no coordinator ran; reclaimed its row (%d unreleased pick(s))",
                    row.fleet_index,
                    row.pid,
                    held,
                )
                continue
            w = WorkerProc(row.fleet_index, AdoptedProcess(row.pid, pidfd), pidfd, loop.time())
            self.workers[w.index] = w
            self._exited[w.index] = asyncio.Event()
            loop.add_reader(pidfd, self._on_exit, w.index)
            if w.index >= self.num_workers:  # the config now has fewer: it finishes its requests and goes
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGTERM)
        self.adopted = sum(isinstance(w.proc, AdoptedProcess) for w in self.workers.values())
        if self.workers:
            log.info(
                "adopted %d live fleet worker(s): %s",
                self.adopted,
                ", ".join(f"{w.index} (pid {w.proc.pid})" for w in self.workers.values()),
            )
        return sorted(self.workers)

    def _popen(self, index: str, stdin: int | None = None) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k not in self.drop_env}
        env.update(self.env, SHMDISAGG_CONFIG=self.config_path, SHMDISAGG_WORKER_INDEX=index)
        env[SUPERVISOR_ENV] = str(self.supervisor)
        # die with the coordinator only when nothing would restart it (it is its own supervisor)
        alone = self.supervisor.pid == os.getpid()
        return subprocess.Popen(
            [sys.executable, "-m", "shmdisagg.fleet.worker"],
            env=env,
            stdin=stdin,
            preexec_fn=_worker_preexec_dying if alone else _worker_preexec,
            close_fds=True,
            pass_fds=self.pass_fds,
        )

    def _start_standby(self) -> None:
        if not self._stopping and (self._standby is None or self._standby.poll() is not None):
            loop = asyncio.get_running_loop()
            self._unwatch_standby()
            self._standby = proc = self._popen("standby", stdin=subprocess.PIPE)
            self._standby_started = loop.time()
            self._standby_fd = os.pidfd_open(proc.pid)
            loop.add_reader(self._standby_fd, self._on_standby_exit, proc)
            log.info("warm standby fleet worker started (pid %d): it replaces a worker that dies", proc.pid)

    def _unwatch_standby(self) -> None:
        """Stop watching the standby's pidfd (it was promoted, or it exited)."""
        if self._standby_fd is not None:
            asyncio.get_running_loop().remove_reader(self._standby_fd)
            os.close(self._standby_fd)
            self._standby_fd = None

    def _on_standby_exit(self, proc: subprocess.Popen[bytes]) -> None:
        """The standby exited before any worker needed it (killed, or it failed to start): reap
        it and start another, backing off while they keep dying young, as workers do."""
        self._unwatch_standby()
        code = proc.wait()  # already exited: reaps the zombie without blocking
        if proc is not self._standby or self._stopping:
            return
        self._standby = None
        loop = asyncio.get_running_loop()
        self._standby_quick_deaths, delay = _backoff(loop.time() - self._standby_started, self._standby_quick_deaths)
        log.warning(
            "warm standby fleet worker (pid %d) exited with %s; starting another in %.1f s", proc.pid, code, delay
        )
        loop.call_later(delay, self._start_standby)

    def _take_standby(self, index: int) -> subprocess.Popen[bytes] | None:
        """Hand `index` to the warm standby process; None if there is none alive."""
        proc, self._standby = self._standby, None
        self._unwatch_standby()  # from now on it is a worker, watched by its own pidfd
        if proc is None or proc.poll() is not None or proc.stdin is None:
            return None
        try:
            proc.stdin.write(b"%d\n" % index)
            proc.stdin.close()
        except OSError:  # it died a moment ago
            return None
        return proc

    def _spawn(self, index: int, quick_deaths: int) -> None:
        proc = self._take_standby(index)
        warm = proc is not None
        if proc is None:
            proc = self._popen(str(index))
        loop = asyncio.get_running_loop()
        loop.call_soon(self._start_standby)  # another, whether one was taken or dead
        pidfd = os.pidfd_open(proc.pid)
        self.workers[index] = WorkerProc(index, proc, pidfd, loop.time(), quick_deaths)
        self._exited[index] = asyncio.Event()
        loop.add_reader(pidfd, self._on_exit, index)
        log.info("fleet worker %d started (pid %d%s)", index, proc.pid, ", the warm standby" if warm else "")

    def _on_exit(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        w = self.workers.pop(index)
        loop.remove_reader(w.pidfd)
        os.close(w.pidfd)
        code = w.proc.wait()  # already exited: reaps the zombie without blocking (None: adopted, not ours to reap)
        if code == CONFIG_ERROR_EXIT and not w.listening:
            self.config_errors[index] = code
        held = sum(r.dispatched - r.completed for r in self.table.rows() if r.pid == w.proc.pid)
        rows = self.table.reclaim_rows_of_pid(w.proc.pid)
        if held:  # a clean stop releases every pick first (worker.GracefulStop): a crash or a SIGKILL
            log.warning(
                "fleet worker %d (pid %d) exited holding %d unreleased pick(s); its row is zeroed",
                index,
                w.proc.pid,
                held,
            )
        if self.on_exit is not None:
            try:
                self.on_exit(index)
            except Exception:  # metrics must not stop supervision
                log.exception("on_exit hook failed for fleet worker %d", index)
        self._exited[index].set()
        if self._stopping:
            return
        self.restarts += 1
        quick, delay = _backoff(loop.time() - w.started, w.quick_deaths)
        how = f"with {code}" if code is not None else "(adopted: its status is not ours to read)"
        log.warning(
            "fleet worker %d (pid %d) exited %s; reclaimed %d row(s); restarting in %.1f s",
            index,
            w.proc.pid,
            how,
            rows,
            delay,
        )
        loop.call_later(delay, self._respawn, index, quick)

    async def watch(self) -> None:
        """Kill every worker silent for longer than `worker_timeout_s` (`kill_stuck`), checked
        a few times per timeout."""
        if self.worker_timeout_s <= 0:
            return
        while True:
            await asyncio.sleep(min(1.0, self.worker_timeout_s / 4))
            try:
                self.kill_stuck(time.monotonic_ns())
            except Exception:  # keep watching; the next round retries
                log.exception("stuck-worker check failed")

    def kill_stuck(self, now_ns: int) -> list[int]:
        """One `watch` round at `now_ns` (CLOCK_MONOTONIC); returns the indexes it killed. A
        worker is judged by its row's heartbeat, or, until it has claimed a row, by the time
        since it was started or promoted (a standby stopped before its promotion never claims
        one) against `max(worker_timeout_s, CLAIM_GRACE_S)`."""
        if self._stopping:  # workers finishing their graceful stop are not judged
            return []
        beats = {r.pid: r.heartbeat_ns for r in self.table.rows()}
        killed = []
        for w in list(self.workers.values()):
            beat = beats.get(w.proc.pid)
            silent_s = (now_ns - beat) / 1e9 if beat is not None else now_ns / 1e9 - w.started
            limit_s = self.worker_timeout_s if beat is not None else max(self.worker_timeout_s, CLAIM_GRACE_S)
            if w.killed or silent_s <= limit_s:  # killed: its exit is on its way
                continue
            w.killed = True
            what = "has not heart-beaten" if beat is not None else "has not claimed its row"
            log.warning(
                "fleet worker %d (pid %d) %s for %.1f s (worker_timeout_s %g): killing it",
                w.index,
                w.proc.pid,
                what,
                silent_s,
                self.worker_timeout_s,
            )
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()
            self.stuck_kills += 1
            killed.append(w.index)
        return killed

    def _respawn(self, index: int, quick_deaths: int) -> None:
        if not self._stopping and index not in self.workers and index < self.num_workers:
            self._spawn(index, quick_deaths)

    def force_quit(self) -> None:
        """A second Ctrl-C while stopping: SIGINT every worker, which then ends the requests still
        running at once instead of after its grace period (`fleet.worker.GracefulStop`); `stop`
        goes on waiting for them to exit."""
        for w in list(self.workers.values()):
            with contextlib.suppress(ProcessLookupError):  # it may have just exited
                w.proc.send_signal(signal.SIGINT)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every worker, wait up to `timeout_s` seconds (their grace period plus
        STOP_MARGIN_S), SIGKILL the rest; rows are reclaimed."""
        self._stopping = True
        self._unwatch_standby()
        if self._standby is not None:
            self._standby.kill()  # it holds no row and no socket
            self._standby.wait()
            self._standby = None
        waiters = [self._exited[i].wait() for i in self.workers]
        for w in list(self.workers.values()):
            with contextlib.suppress(ProcessLookupError):  # it may have just exited
                w.proc.send_signal(signal.SIGTERM)
        if not waiters:
            return
        done, pending = await asyncio.wait([asyncio.ensure_future(x) for x in waiters], timeout=timeout_s)
        for w in list(self.workers.values()):
            with contextlib.suppress(ProcessLookupError):  # it may have just exited
                w.proc.kill()
        if pending:
            await asyncio.wait(pending, timeout=5.0)
