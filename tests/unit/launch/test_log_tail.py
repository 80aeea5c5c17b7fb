"""The line a launch error quotes from an executor's log (`launch._last_line`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shmdisagg.launch import _last_line

HEADER = "# 2026-12-07 12:31:04 shmdisagg launch: python -m shmdisagg.executors.sim --port 19821\n"
WARNING = (
    "/x/shmdisagg/executors/sim/app.py:256: FutureWarning: Internal disaggregated authentication key is required\n"
    "  disagg_auth.validate(\n"
)
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/x/serve.py", line 3, in <module>\n'
    "    main()\n"
    "ValueError: port 19821 is taken\n"
)


@pytest.mark.parametrize(
    ("log", "expected"),
    [
        (HEADER, ""),  # the executor wrote nothing yet
        (HEADER + WARNING, "/x/shmdisagg/executors/sim/app.py:256: FutureWarning: Internal disaggregated"),
        (HEADER + WARNING + TRACEBACK, "ValueError: port 19821 is taken"),
        (HEADER + "INFO: Started server process [5]\n\n", "INFO: Started server process [5]"),
        (HEADER + "  only indented\n", "only indented"),
        (HEADER + TRACEBACK + HEADER, ""),  # restarted: the last run's lines are not this one's
    ],
    ids=["header", "warning", "traceback", "plain", "indented", "restarted"],
)
def test_the_quoted_line_is_the_last_one_that_is_not_a_continuation(tmp_path: Path, log: str, expected: str) -> None:
    path = tmp_path / "generation-0.log"
    path.write_text(log)
    assert _last_line(path).startswith(expected) if expected else _last_line(path) == ""
