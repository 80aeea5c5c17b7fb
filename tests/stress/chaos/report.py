"""The chaos suite's table: one row per scenario (`ChaosRun.row`, recorded by the `chaos_row`
fixture of `tests/stress/conftest.py`), carried from the xdist workers to the controller as a
test report's `user_properties` (which xdist transmits) and printed at the end of the session;
with `SHMDISAGG_CHAOS_REPORT=PATH` written to PATH too (`scripts/stress.sh`).

The two hooks are imported by `tests/conftest.py`: under xdist the controller collects nothing,
so only the conftests it loads at start-up (those of its command-line paths and their parents)
can print the table.
"""

from __future__ import annotations

import os
from typing import Any

import orjson
import pytest

COLUMNS = [
    ("scenario", "scenario"), ("layout", "layout"), ("seed", "seed"), ("load_s", "load s"), ("faults", "faults"),
    ("owed", "requests"), ("complete", "complete"), ("errors", "clean errors (status:n)"), ("cut", "cut by a kill"),
    ("abandoned", "left on purpose"), ("violations", "violations"), ("drain_s", "drain s"), ("start_s", "start s"),
    ("stop_s", "stop s"), ("wall_s", "wall s"),
    ("result", "result"), ("notes", "notes"),
]  # fmt: skip
PROPERTY = "chaos_row"


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of `rows`, in scenario order."""
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in sorted(rows, key=lambda r: str(r.get("scenario"))):
        lines.append("| " + " | ".join(_cell(row.get(key)) for key, _ in COLUMNS) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "" if value is None else str(value).replace("|", "/")


_rows: dict[str, dict[str, Any]] = {}


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
