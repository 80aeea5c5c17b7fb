"""Refusals at parsing: exit 2, one error line naming the flag, before anything is read or started."""

from __future__ import annotations

import pytest

from shmdisagg.cli import main


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("command", ["check-config", "launch", "serve", "disaggregated"])
def test_an_empty_config_path_is_refused_naming_c(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`-c ''` was read as '.', and the refusal named a directory the user never gave."""
    line = _usage_error([command, "-c", ""], capsys)
    assert line.startswith(f"shmdisagg {command}: error: argument -c/--config"), line  # an alias by its own name
    assert line.endswith(": needs the path of a config file, not ''"), line


@pytest.mark.parametrize("value", ["0", "-1", "-7200"])
def test_a_start_timeout_below_one_second_is_refused_in_one_wording(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`serve -t 0` said "must be a positive number of seconds", `-t -1` "must not be negative"."""
    line = _usage_error(["serve", "-c", "cfg.yaml", "-t", value], capsys)
    assert line == "shmdisagg serve: error: argument -t/--server_start_timeout: must be a positive number of seconds"


@pytest.mark.parametrize(
    ("given", "style"), [("CONTEXT_FIRST", "context_first"), ("Generation_First", "generation_first")]
)
def test_the_schedule_style_is_read_in_any_case(given: str, style: str) -> None:
    """TensorRT-LLM's `-s` is a click.Choice with case_sensitive=False."""
    from shmdisagg.cli import build_parser

    assert build_parser().parse_args(["serve", "-c", "cfg.yaml", "-s", given]).schedule_style == style
