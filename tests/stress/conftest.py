"""The chaos scenarios' report row (`tests/stress/chaos/report.py` prints the table)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from tests.stress.chaos.report import PROPERTY


@pytest.fixture
def chaos_row(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The scenario's row of the report, filled by its `ChaosRun`; recorded at teardown, pass or fail."""
    row: dict[str, Any] = {"scenario": request.node.name}
    began = time.monotonic()
    yield row
    row["wall_s"] = round(time.monotonic() - began, 1)
    request.node.user_properties.append((PROPERTY, orjson.dumps(row).decode()))
