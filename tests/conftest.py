"""Shared fixtures: every test gets its own ports and shared-memory names (safe under pytest -n auto)."""

from __future__ import annotations

import glob
import os
import socket
import uuid
from collections.abc import Iterator

import pytest

# the chaos suite's table at the end of the session (here: the xdist controller loads this conftest)
from tests.stress.chaos.report import pytest_runtest_logreport, pytest_terminal_summary  # noqa: F401


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
