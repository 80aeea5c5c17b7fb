"""`trtllm/*` entries of the metadata server as the deployment reads them (`cluster/metadata.py`)."""

from __future__ import annotations

import json
import logging

import pytest

from shmdisagg.cluster.metadata import parse_entry
from shmdisagg.shm.table import ROLE_CONTEXT


def _entry(url: str, role: str = "CONTEXT") -> str:
    return json.dumps({"model": "m", "version": "1", "timestamp": 1.0, "server_role": role, "url": url})


def test_an_http_entry_names_its_executor() -> None:
    info = parse_entry(_entry("http://127.0.0.1:8001"))
    assert info is not None
    assert (info.host, info.port, info.role) == ("127.0.0.1", 8001, ROLE_CONTEXT)


def test_an_https_entry_is_not_used_and_said_so_once(caplog: pytest.LogCaptureFixture) -> None:
    # upstream's router would speak TLS to it (`Router._ensure_url` keeps the scheme); the fleet
    # cannot, so routing to it over plain HTTP would be a setting silently not honoured
    with caplog.at_level(logging.WARNING, logger="shmdisagg.cluster"):
        assert parse_entry(_entry("https://gen7.example:8443", "GENERATION")) is None
        assert parse_entry(_entry("https://gen7.example:8443", "GENERATION")) is None
    lines = [r.getMessage() for r in caplog.records if "https://gen7.example:8443" in r.getMessage()]
    assert len(lines) == 1 and "https executors are not supported" in lines[0]
