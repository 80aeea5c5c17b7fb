"""`shmdisagg --help`: what a new user reads first."""

from __future__ import annotations

import pytest

from shmdisagg.cli import main


def test_help_opens_with_what_the_command_is_for(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    description = out.split("\n\n", 1)[1]  # after the usage line
    assert description.startswith("shmdisagg: disaggregated LLM serving on one machine")
    assert "trtllm-serve disaggregated" in description.split("\n\n", 1)[0]
    assert "turns exceptions into exit codes" not in out  # a note on the code, not for users


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"shmdisagg {version('shmdisagg')}"
