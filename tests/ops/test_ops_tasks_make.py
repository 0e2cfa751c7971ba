"""`rlbus tasks make` as a real command on a real sandbox: tasks made from shlex and its CPython tests, which
`rlbus tasks check` then passes (every original file passes, every changed one fails); the same seed, the same
tasks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rlbus.model.tasks.make import LEVEL_OF_KIND
from rlbus.model.tasks.sources import read_repo_tasks_file


def _rlbus(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlbus.ops.cli", "tasks", *args], capture_output=True, text=True,
                          timeout=300)


def test_made_tasks_pass_the_check_and_are_seeded(tmp_path: Path) -> None:
    """Four tasks from shlex: each row's repository is shlex.py changed, its solution the original, its hidden
    test CPython's test_shlex.py, and its fail-to-pass tests named; `rlbus tasks check` grades every solution
    passing and every untouched repository failing; a make of two with the same seed writes the first two rows."""
    out = tmp_path / "shlex.jsonl"
    made = _rlbus("make", "-o", str(out), "--n", "4", "--modules", "shlex", "--seed", "5")
    assert made.returncode == 0, made.stderr[-3000:]
    summary = json.loads(made.stdout)
    assert (summary["tasks"], summary["kept"]) == (4, 4) and summary["tried"] >= 4
    assert summary["outcomes"]["shlex"]["kept"] == 4
    assert "shlex: the unmodified module passes" in made.stderr and "shlex: 4/4 kept" in made.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    tasks = read_repo_tasks_file(out)
    original = Path(__import__("shlex").__file__).read_text()
    for row, task in zip(rows, tasks, strict=True):
        assert task.solution == {"shlex.py": original} and task.files["shlex.py"] != original
        assert set(task.hidden_tests) == {"test_shlex.py"} and task.stdlib_under_test == ("shlex",)
        assert task.tags[0] == "shlex" and task.level == LEVEL_OF_KIND[task.tags[1]]
        assert row["fail_to_pass"] and all(t.startswith("test_shlex.") for t in row["fail_to_pass"])
        assert f"`{row['fail_to_pass'][0]}`" in task.instruction
    checked = _rlbus("check", str(out), "--json")
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    report = json.loads(checked.stdout)
    assert (report["tasks"], report["reference_passed"], report["broken_rejected"]) == (4, 4, 4)
    fewer = tmp_path / "fewer.jsonl"
    assert _rlbus("make", "-o", str(fewer), "--n", "2", "--modules", "shlex", "--seed", "5").returncode == 0
    assert fewer.read_text().splitlines() == out.read_text().splitlines()[:2]


def test_a_module_without_cpython_tests_is_refused(tmp_path: Path) -> None:
    """A module whose test file is not installed is refused before any sandbox starts: exit 2, named."""
    done = _rlbus("make", "-o", str(tmp_path / "x.jsonl"), "--n", "1", "--modules", "this")
    assert done.returncode == 2 and "test_this.py is not installed" in done.stderr
    assert not (tmp_path / "x.jsonl").exists()
