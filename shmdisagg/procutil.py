"""Process helpers: parent-death signal, SO_REUSEPORT socket binding."""

from __future__ import annotations

import ctypes
import signal
import socket

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux prctl).

    Used as `preexec_fn` for every child we start, so a SIGKILLed parent leaves no orphans.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def bind_reuseport(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket with SO_REUSEPORT, so every fleet worker has its own accept queue.

    IPv6 only when the host resolves to nothing but IPv6 (as TensorRT-LLM's fleet does).
    Raises OSError (e.g. EADDRINUSE when a non-reuseport process holds the port).
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = [i for i in infos if i[0] == socket.AF_INET]
    family, _, _, _, addr = (v4 or infos)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.set_inheritable(False)
    except BaseException:
        sock.close()
        raise
    return sock
