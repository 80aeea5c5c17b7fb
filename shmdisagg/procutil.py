"""Process helpers: parent-death signal, SO_REUSEPORT socket binding (and a check that it can), who
listens on a port (and whether a given process does), a reserved port for `port: 0` and the
`--report_addr` file."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import tempfile
from dataclasses import dataclass, field

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux prctl).

    Used as `preexec_fn` for every child we start, so a SIGKILLed parent leaves no orphans.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})  # what stops a command: Ctrl-C, kill, timeout


def listen_addr(host: str, port: int) -> tuple[socket.AddressFamily, tuple[object, ...]]:
    """(family, sockaddr) a listener on host:port binds: the first IPv4 address `host` resolves
    to, else its first address. Raises socket.gaierror or UnicodeError if it does not resolve."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = [i for i in infos if i[0] == socket.AF_INET]
    family, _, _, _, addr = (v4 or infos)[0]
    return family, addr


def public_port_problem(host: str, port: int) -> str | None:
    """Why the fleet could not listen on host:port, or None if it can (checked now).

    Binds as `bind_reuseport` would but without SO_REUSEPORT, so any listener there counts, even
    another deployment's fleet (whose reuse-port group ours would otherwise join).
    """
    try:
        err = bind_error(host, port)
    except (socket.gaierror, UnicodeError) as exc:
        return f"public address {host}:{port}: cannot resolve {host!r}: {getattr(exc, 'strerror', None) or exc}"
    if err is None:
        return None
    if err.errno == errno.EADDRINUSE:
        return f"public address {host}:{port} already in use (is another deployment or server running there?)"
    return f"public address {host}:{port}: cannot listen there: {err.strerror or err}"


def bind_error(host: str, port: int) -> OSError | None:
    """The error a plain listener (SO_REUSEADDR, no SO_REUSEPORT) binding host:port gets now, or
    None. Raises socket.gaierror or UnicodeError if `host` does not resolve."""
    family, addr = listen_addr(host, port)
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
    except OSError as err:
        return err
    return None


@dataclass(frozen=True)
class Listener:
    """A process listening on a TCP port (from /proc): `pid` None when no process here is seen to
    hold it, another user's or one in another pid namespace (only the socket's `uid` is visible);
    `argv` its command line; `env` the few variables that say which shmdisagg deployment a fleet
    worker serves."""

    uid: int
    pid: int | None = None
    argv: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


_TCP_LISTEN = "0A"
_ENV_KEYS = ("SHMDISAGG_CONFIG", "SHMDISAGG_WORKER_INDEX")


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid`, or a process it started, has a TCP socket listening on `port`
    (any address): a trtllm-serve's listener may sit in a child it spawned. False if `pid` is
    gone. From `listeners` and the parent links in /proc."""
    for listener in listeners(port):
        p = listener.pid
        while p is not None and p > 1:
            if p == pid:
                return True
            p = parent_pid(p)
    return False


def parent_pid(pid: int | None) -> int | None:
    """The parent of process `pid` (/proc/<pid>/stat), or None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def listeners(port: int) -> list[Listener]:
    """The processes with a TCP socket listening on `port` (any address, IPv4 or IPv6), found
    through /proc/net/tcp{,6} and the fds in /proc/<pid>/fd that this user may read. Sockets
    of processes it cannot see come back with `pid` None. Linux only; [] where /proc is absent."""
    sockets: dict[int, int] = {}  # inode -> uid
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)  # the header
                for line in f:
                    parts = line.split()
                    if len(parts) > 9 and parts[3] == _TCP_LISTEN and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        sockets[int(parts[9])] = int(parts[7])
        except (OSError, ValueError):
            continue
    found: list[Listener] = []
    if not sockets:
        return found
    wanted = {f"socket:[{inode}]": inode for inode in sockets}
    seen: set[int] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        for link in _fd_links(entry.name) & wanted.keys():
            inode = wanted[link]
            seen.add(inode)
            found.append(Listener(sockets[inode], int(entry.name), _argv(entry.name), _env(entry.name)))
    found.extend(Listener(uid) for inode, uid in sockets.items() if inode not in seen)
    return found


def _fd_links(pid: str) -> set[str]:
    """What the fds of `pid` point at; empty for another user's process or one that exited."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    links = set()
    for fd in fds:
        try:
            links.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile (the listing's own fd, in this process)
            continue
    return links


def _argv(pid: str) -> tuple[str, ...]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return tuple(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except OSError:
        return ()


def _env(pid: str) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = (item.decode(errors="replace").partition("=") for item in f.read().split(b"\0") if item)
            return {k: v for k, _, v in pairs if k in _ENV_KEYS}
    except OSError:
        return {}


def bind_reuseport(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket with SO_REUSEPORT, so every fleet worker has its own accept queue.

    IPv6 only when the host resolves to nothing but IPv6 (as TensorRT-LLM's fleet does).
    Raises OSError (e.g. EADDRINUSE when a non-reuseport process holds the port).
    """
    return listening(_reuseport_socket(host, port), backlog)


def listening(sock: socket.socket, backlog: int) -> socket.socket:
    """`sock.listen(backlog)`, closing the socket if that fails; returns it."""
    try:
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def _reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEADDR and SO_REUSEPORT, not inheritable."""
    family, addr = listen_addr(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
        sock.set_inheritable(False)
    except BaseException:
        sock.close()
        raise
    return sock


def reserve_port(host: str) -> socket.socket:
    """A socket bound, not listening, to a port the kernel picks on `host` (`port: 0`), with
    SO_REUSEPORT: the fleet workers' listeners (`bind_reuseport`) join it on that port, and it
    accepts no connection itself (only listening sockets get them). Without SO_REUSEADDR, which
    would let any SO_REUSEADDR listener (uvicorn's, another trtllm-serve's) bind the port beside
    a socket that is not listening, and the fleet then fail to: no other process can take the
    port (only SO_REUSEPORT sockets of this user join). Close it when the deployment stops."""
    family, addr = listen_addr(host, 0)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
        sock.set_inheritable(False)
    except BaseException:
        sock.close()
        raise
    return sock


def unwritable(
    path: str | None, directory: bool = False, make_parents: bool = False, replaced: bool = False
) -> str | None:
    """Why a file could not be written at `path` (with `directory`: a folder made there), else
    None; `make_parents` (implied by `directory`): the writer creates missing parent folders;
    `replaced`: the writer replaces the path (a temporary file renamed over it), so only a
    regular file may stand there, not a link or a device. A command checks its output paths
    before it starts, rather than failing after its work: by creating and removing a file in the
    folder, since a process that may write anywhere (root) passes every access check, /proc too."""
    if path is not None and not path.strip():
        return "an empty path"
    if not path:
        return None
    if os.path.lexists(path):
        if os.path.isdir(path) != directory:
            return "is not a directory" if directory else "is a directory"
        if replaced and (os.path.islink(path) or not os.path.isfile(path)):
            return "is not a regular file (a link or a device would be replaced, not written through)"
    parent = path if directory and os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    missing = None  # the first directory that would have to be created
    while (directory or make_parents) and not os.path.exists(parent):
        parent, missing = os.path.dirname(parent), parent
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as err:
        if missing is not None:
            return f"cannot create {missing} ({err.strerror or err} in {parent})"
        return f"cannot write in {parent} ({err.strerror or err})"
    return None


def publish_address(path: str, host: str, port: int) -> None:
    """Write `host:port` and a newline to `path` atomically (a reader polling the file sees
    nothing or the whole line), creating missing parent directories: TensorRT-LLM's
    `--report_addr` contract (`commands/serve.py` `_publish_bound_address`, test id 57374853910).
    A wildcard host ("0.0.0.0", "::", "") is replaced by this machine's host name, which a reader
    can dial; an IPv6 literal is bracketed."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    if ":" in host:
        host = f"[{host}]"
    target = os.path.abspath(path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{host}:{port}\n")
    os.replace(tmp, target)


def private_unix_socket(path: str, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A non-blocking Unix socket bound at `path` that only this user can reach: mode 0600, bound
    under umask 0177, so it is never accessible to others, not even for a moment. Closed again
    if binding fails; the caller listens (streams) and unlinks `path` when done."""
    sock = socket.socket(socket.AF_UNIX, kind)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
