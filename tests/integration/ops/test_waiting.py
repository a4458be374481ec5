"""The verbs' shared option factories: the range and the default their --help shows."""

from __future__ import annotations

from pathlib import Path

import click
from click.testing import CliRunner

from embedfleet.ops.waiting import count_option, input_file_option, seconds_option


@click.command()
@count_option("--page", default=1000, help="Rows at a time.")
@count_option("--overlap", minimum=0, maximum=64, help="Tokens shared.")
@seconds_option("--interval", minimum=0.1, default=2.0, help="Between refreshes.")
@seconds_option("--timeout", min_open=True, help="Give up after this.")
@input_file_option("--queries", help="One query per line.")
def verb(
    page: int, overlap: int | None, interval: float, timeout: float | None, queries: Path | None
) -> None:
    click.echo(f"{page} {overlap} {interval} {timeout} {queries}")


def test_help_shows_each_range_and_the_defaults_given() -> None:
    shown = " ".join(CliRunner().invoke(verb, ["--help"], terminal_width=200).output.split())
    assert "Rows at a time. [default: 1000; x>=1]" in shown
    assert "Tokens shared. [0<=x<=64]" in shown, "no default, none shown"
    assert "Between refreshes. [default: 2.0; x>=0.1]" in shown
    assert "Give up after this. [x>0]" in shown, "the bound as written: 0, not 0.0"


def test_the_values_are_checked(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(verb, []).output == "1000 None 2.0 None None\n"
    for wrong in (["--page", "0"], ["--overlap", "65"], ["--interval", "0"], ["--timeout", "0"]):
        assert runner.invoke(verb, wrong).exit_code == 2, wrong
    assert runner.invoke(verb, ["--queries", str(tmp_path)]).exit_code == 2, "a folder"
    assert runner.invoke(verb, ["--queries", str(tmp_path / "none")]).exit_code == 2
    (tmp_path / "q.txt").write_text("a query\n")
    assert runner.invoke(verb, ["--queries", str(tmp_path / "q.txt")]).exit_code == 0
