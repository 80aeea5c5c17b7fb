"""The chaos suite's report: each scenario's row (`tests/stress/chaos/scenario.py`) travels in
its test report's `user_properties` (xdist transmits them to the controller); the controller
prints the table at the end of the session and, with `SHMDISAGG_CHAOS_REPORT=PATH`, writes it
to PATH too (`scripts/stress.sh`)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from tests.stress.chaos.report import PROPERTY, table

_rows: dict[str, dict[str, Any]] = {}


@pytest.fixture
def chaos_row(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The scenario's row of the report, filled by its `ChaosRun`; recorded at teardown, pass or fail."""
    row: dict[str, Any] = {"scenario": request.node.name}
    began = time.monotonic()
    yield row
    row["wall_s"] = round(time.monotonic() - began, 1)
    request.node.user_properties.append((PROPERTY, orjson.dumps(row).decode()))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == PROPERTY:
            _rows[report.nodeid] = orjson.loads(value)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if not _rows or hasattr(config, "workerinput"):
        return
    text = table(list(_rows.values()))
    terminalreporter.write_sep("=", "chaos suite")
    terminalreporter.write_line(text)
    path = os.environ.get("SHMDISAGG_CHAOS_REPORT")
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
