"""Who holds a deployment's public port: for `shmdisagg check-config`, which says so before a
launch or serve would fail on it.

This config's own deployment running is told apart from anything else: its coordinator holds
the control segment of the config's shared-memory prefix and is alive, and its fleet (if one
listens yet) serves this config file, not another one that shares the port and so the default
prefix. Otherwise the listeners
come from /proc (`procutil.listeners`): a shmdisagg fleet worker names its deployment's config
(its `SHMDISAGG_CONFIG`) and coordinator (its parent), another process its pid and command line,
another user's process only its uid.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from shmdisagg.config import DisaggConfig
from shmdisagg.procutil import Listener, bind_error, listeners, parent_pid

_FLEET_MODULE = "shmdisagg.fleet.worker"
_ARGV_CHARS = 80


@dataclass(frozen=True)
class PortUser:
    """The public port is taken: by this config's own running deployment (`ours`), or by what
    `who` describes ("by pid 123 (python3 -m http.server 8000)"); `problem` is the whole line."""

    ours: bool
    who: str
    problem: str


def public_port_user(config: DisaggConfig, config_path: str) -> PortUser | None:
    """None when a fleet could listen on the config's hostname:port now; else who holds it
    (`config_path`: the file `config` was read from). Raises socket.gaierror or UnicodeError if
    `hostname` does not resolve."""
    where = f"{config.hostname}:{config.port}"
    err = bind_error(config.hostname, config.port)
    if err is None:
        return None
    if err.errno != errno.EADDRINUSE:
        why = f"cannot listen there: {err.strerror or err}"
        return PortUser(False, why, f"public address {where}: {why}")
    pid = running_coordinator(config.shm_prefix)
    found = listeners(config.port)
    ours = [x for x in found if _same_file(_config_of(x), config_path)]
    fleet = [x for x in found if _FLEET_MODULE in x.argv]
    # the prefix's coordinator is this config's unless the fleet it runs serves another file (two
    # configs on one port share the default prefix, shmdisagg-<uid>-<port>)
    if pid is not None and (ours or not fleet):
        who = f"by this deployment, which runs now (coordinator pid {pid})"
        return PortUser(True, who, f"public address {where} is served {who}")
    if ours:  # its coordinator is starting or stopping: the segment is not there yet or any more
        who = f"by this deployment's fleet (coordinator pid {parent_pid(ours[0].pid)}), starting or stopping"
        return PortUser(True, who, f"public address {where} is served {who}")
    who = _describe(found)
    return PortUser(False, who, f"public address {where} already in use {who}")


def public_port_taken(config: DisaggConfig, config_path: str) -> str | None:
    """`public_port_user`'s whole line when the public port cannot be listened on now, else None
    (free, port 0, or a host that does not resolve: the config checks say that)."""
    if config.port == 0:
        return None
    try:
        user = public_port_user(config, config_path)
    except (OSError, UnicodeError):
        return None
    return user.problem if user is not None else None


def running_coordinator(prefix: str) -> int | None:
    """The pid of the live coordinator of the deployment with this shared-memory prefix, or None
    (no control segment, one still being created, or the leftover of a dead coordinator)."""
    from shmdisagg.shm.segment import SegmentNotReady, ShmError
    from shmdisagg.shm.table import ControlTable
    from shmdisagg.stats.snapshot import process_alive

    try:
        table = ControlTable.attach(prefix, read_only=True, timeout=0.2)
    except (FileNotFoundError, SegmentNotReady, ShmError):
        return None
    try:
        coord = table.coordinator()
    finally:
        table.close()
    return coord["pid"] if process_alive(coord["pid"], coord.get("starttime", 0)) else None


def _describe(found: list[Listener]) -> str:
    if not found:
        return "by a process not visible from here"
    first = found[0]
    if first.pid is None:
        # the socket is listed in /proc/net but no /proc/<pid>/fd here holds it: another user's process
        # this one may not inspect, or one in another pid namespace (a container), whoever we are
        return (
            f"by a process of uid {first.uid} whose pid is not visible from here "
            "(another user's, or another container's)"
        )
    if _FLEET_MODULE in first.argv:
        config = _config_of(first) or "?"
        return f"by another shmdisagg deployment (config {config}, coordinator pid {parent_pid(first.pid)})"
    line = " ".join(first.argv) or "?"
    if len(line) > _ARGV_CHARS:
        line = line[: _ARGV_CHARS - 3] + "..."
    return f"by pid {first.pid} ({line})"


def _config_of(worker: Listener) -> str | None:
    """The config file a fleet worker serves (its SHMDISAGG_CONFIG, resolved in its own cwd)."""
    path = worker.env.get("SHMDISAGG_CONFIG")
    if not path or worker.pid is None:
        return path
    if os.path.isabs(path):
        return path
    try:
        return os.path.realpath(os.path.join(os.readlink(f"/proc/{worker.pid}/cwd"), path))
    except OSError:
        return path


def _same_file(path: str | None, other: str) -> bool:
    if not path:
        return False
    try:
        return os.path.samefile(path, other)
    except OSError:
        return False
