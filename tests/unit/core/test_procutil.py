"""Port ownership: the reserved `port: 0` port and whether a process listens on a port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from shmdisagg.procutil import bind_reuseport, listens_on, reserve_port
from tests.conftest import free_port


def _plain_listener(port: int) -> socket.socket:
    """What uvicorn or another trtllm-serve binds: SO_REUSEADDR, no SO_REUSEPORT."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def test_a_reserved_port_takes_the_fleets_listeners_and_no_other_server() -> None:
    reserved = reserve_port("127.0.0.1")
    port = reserved.getsockname()[1]
    try:
        with pytest.raises(OSError) as err:
            _plain_listener(port).close()
        assert err.value.errno == 98  # EADDRINUSE: the port stays the deployment's
        workers = [bind_reuseport("127.0.0.1", port) for _ in range(2)]
        for w in workers:
            w.close()
        bind_reuseport("127.0.0.1", port).close()  # a restarted worker joins again
    finally:
        reserved.close()


def test_listens_on_names_the_process_that_holds_the_listener() -> None:
    port = free_port()
    code = (
        "import socket, sys\n"
        "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
        "print('up', flush=True); sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        assert listens_on(child.pid, port)
        assert not listens_on(child.pid, free_port())  # another port
        assert listens_on(os.getpid(), port)  # a process it started: trtllm-serve's may be a child's
        other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            assert not listens_on(other.pid, port)  # any other process does not
        finally:
            other.communicate(b"")
    finally:
        child.communicate("")
    assert not listens_on(child.pid, port)  # gone
