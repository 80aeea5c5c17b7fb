"""The chaos suite's table: one row per scenario (`ChaosRun.row`), carried from the xdist
workers to the controller as a test report's `user_properties` (which xdist transmits) and
printed at the end of the session."""

from __future__ import annotations

from typing import Any

COLUMNS = [
    ("scenario", "scenario"), ("layout", "layout"), ("seed", "seed"), ("load_s", "load s"), ("faults", "faults"),
    ("owed", "requests"), ("complete", "complete"), ("errors", "clean errors (status:n)"), ("cut", "cut by a kill"),
    ("abandoned", "left on purpose"), ("violations", "violations"), ("drain_s", "drain s"), ("start_s", "start s"), ("stop_s", "stop s"),
    ("wall_s", "wall s"),
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
