"""Shared fixtures: every test gets its own ports and shared-memory names (safe under pytest -n auto)."""

from __future__ import annotations

import glob
import os
import random
import socket
import uuid
from collections.abc import Iterator

import pytest

# the chaos suite's table at the end of the session (here: the xdist controller loads this conftest)
from tests.stress.chaos.report import pytest_runtest_logreport, pytest_terminal_summary  # noqa: F401


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to `bind(port 0)` and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _port_candidates() -> Iterator[int]:
    """This test process's own slice of the ports below the ephemeral range, endlessly, from a
    random offset. Port 0 (the kernel's pick) lets two xdist workers get the same port in the
    moment between one's check and its server's bind: an executor then failed to bind and the
    other worker's server answered its /health. Below the ephemeral range no port-0 bind or
    outgoing connection takes a port either. Another pytest run on the machine may share a
    slice; the bind check in `free_port` and the random offset keep that as rare as before."""
    low, high = 10000, _ephemeral_low()
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    size = (high - low) // max(count, 1)
    if size < 64:  # a machine with a low ephemeral range: the kernel's pick
        while True:
            yield 0
    start = low + index * size
    offset = random.randrange(size)
    while True:
        yield start + offset
        offset = (offset + 1) % size


_CANDIDATES = _port_candidates()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 a moment ago that no other test of this run is handed:
    each xdist worker draws from its own range (`_port_candidates`), skipping ports in use."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", next(_CANDIDATES)))
            except OSError:
                continue  # in use (or TIME_WAIT): the next one
            return int(s.getsockname()[1])


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    """A unique shared-memory name prefix; any segment left under it fails the test."""
    prefix = f"shmdisagg-t{uuid.uuid4().hex[:10]}"
    yield prefix
    leftovers = glob.glob(f"/dev/shm/{prefix}*")
    for path in leftovers:
        os.unlink(path)
    assert not leftovers, f"shared-memory segments left behind: {leftovers}"


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small byte-level BPE Hugging Face tokenizer with Llama-3 special tokens and a chat
    template, built offline once per test process (`tests/hf_tokenizer.py`)."""
    from tests.hf_tokenizer import build_tokenizer

    return str(build_tokenizer(tmp_path_factory.mktemp("hf-tokenizer") / "tinytok"))
