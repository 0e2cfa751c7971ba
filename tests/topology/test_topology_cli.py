"""`rlbus validate`: output lines FILE: KEY: MESSAGE, the OK line, --json, --reference, exit codes, and
never a traceback for bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from rlbus.ops.validate import register
from rlbus.topology.examples import example_path

BAD = Path(__file__).resolve().parent / "bad"


def run_validate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Parse argv with a parser holding only `validate`, run its handler; (exit code, stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="rlbus")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["validate", *argv])
    code = args.handler(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_ok_file_prints_the_summary_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """A clean file prints `OK: FILE: run R, N regions, M actors` and exits 0."""
    path = example_path("three_regions")
    code, out, _ = run_validate([str(path)], capsys)
    assert code == 0
    assert out.splitlines()[-1] == f"OK: {path}: run three, 3 regions, 11 actors"


def test_example_name_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    """A bare example name resolves to the shipped file."""
    code, out, _ = run_validate(["tiny"], capsys)
    assert code == 0 and out.splitlines()[-1] == f"OK: {example_path('tiny')}: run tiny, 1 region, 6 actors"


def test_bad_file_prints_every_problem_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """Every problem is one FILE: KEY: MESSAGE line on stdout; the exit code is 2."""
    path = Path(__file__).resolve().parent / "several_defects.toml"
    code, out, err = run_validate([str(path)], capsys)
    lines = out.splitlines()
    assert code == 2
    assert len(lines) == 7 and all(line.startswith(f"{path}: ") for line in lines)
    assert f"{path}: trainer.lr: expected a number > 0, found the string 'fast'" in lines
    assert f"{path}: trainer.staleness_version: unknown key 'staleness_version'; did you mean 'staleness_versions'?" in lines
    assert err.strip() == f"FAILED: {path}: 7 errors, 0 warnings"


@pytest.mark.parametrize("target", ["binary.toml", "not_toml.toml", "", "missing.toml"])
def test_unusable_inputs_exit_2_without_traceback(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A binary file, broken TOML, a directory and a missing file each give one line and exit code 2."""
    path = BAD / target if target else BAD
    code, out, err = run_validate([str(path)], capsys)
    assert code == 2
    assert "Traceback" not in out + err
    assert len(out.splitlines()) == 1 and out.startswith(f"{path}: ")


def test_warnings_are_marked_and_do_not_fail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A warning-only file prints `FILE: KEY: warning: MESSAGE`, then the OK line, and exits 0."""
    path = tmp_path / "warn.toml"
    path.write_text(example_path("tiny").read_text().replace("staleness_versions = 2", "staleness_versions = 0"))
    code, out, _ = run_validate([str(path)], capsys)
    lines = out.splitlines()
    assert code == 0
    assert f"{path}: trainer.staleness_versions: warning: 0 drops every rollout that saw a weight update while it " \
           "was generated; expect most rollouts dropped" in lines
    assert lines[-1] == f"OK: {path}: run tiny, 1 region, 6 actors"


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints one object with ok, counts and each problem's file, key, severity and message."""
    path = BAD / "two_hubs.toml"
    code, out, _ = run_validate([str(path), "--json"], capsys)
    report = json.loads(out)
    assert code == 2
    assert report["ok"] is False and report["errors"] == 1 and report["run"] is None
    assert report["problems"][0]["key"] == "regions[1].role"
    assert report["problems"][0]["file"] == str(path)
    code, out, _ = run_validate(["single", "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["ok"] is True
    assert (report["run"], report["regions"], report["actors"], report["errors"]) == ("single", 1, 8, 0)


def test_reference_flag_prints_the_key_table(capsys: pytest.CaptureFixture[str]) -> None:
    """--reference prints the generated Markdown reference (no FILE needed)."""
    code, out, _ = run_validate(["--reference"], capsys)
    assert code == 0
    assert "| `group_size` | an integer >= 1 | `8` |" in out


def test_no_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Without FILE or --reference the command says what it expected and exits 2."""
    code, _, err = run_validate([], capsys)
    assert code == 2 and "expected a topology FILE" in err


def test_through_the_rlbus_main(capsys: pytest.CaptureFixture[str]) -> None:
    """`rlbus validate` is reachable from the real console-script entry point."""
    from rlbus.ops.cli import main

    assert main(["validate", str(BAD / "bad_backend.toml")]) == 2
    assert "launch.backend: expected one of 'local', 'ray'" in capsys.readouterr().out
