"""A real etcd server for tests: the Debian `etcd-server` package's `etcd` binary (installed by
scripts/setup_env.sh), on loopback ports unique to the test and a data directory in its tmp_path."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import free_port
from tests.integration.harness import wait_until


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise AssertionError("no etcd binary on PATH: scripts/setup_env.sh installs it (apt-get install etcd-server)")
    return path


def _answers(port: int) -> bool:
    out = subprocess.run(
        ["etcdctl", f"--endpoints=http://127.0.0.1:{port}", "--command-timeout=1s", "endpoint", "health"],
        capture_output=True,
        env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
    )
    return out.returncode == 0


class EtcdServer:
    """One etcd member: `port` (clients), `uri` (`etcd://127.0.0.1:port`); `stop()` /
    `start()` keep the data directory (a restart), `kill()` is SIGKILL."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.with_suffix(".log")

    @property
    def uri(self) -> str:
        return f"etcd://127.0.0.1:{self.port}"

    def start(self) -> None:
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        argv = [
            etcd_binary(),
            "--name=t",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=t={peer}",
            "--log-level=error",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_until(lambda: _answers(self.port), 20.0, f"etcd on {self.port}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def etcdctl(self, *args: str) -> str:
        out = subprocess.run(
            ["etcdctl", f"--endpoints=http://127.0.0.1:{self.port}", *args],
            capture_output=True,
            env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
            check=True,
        )
        return out.stdout.decode()


@contextlib.contextmanager
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd-data")
    server.start()
    try:
        yield server
    finally:
        server.stop()
