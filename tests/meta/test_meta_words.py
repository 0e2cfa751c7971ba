"""The repository documents the project, not how it was built: no planning words in code, tests or docs.

Scans README.md, docs/ and every .py, .toml and .md file of the repository (virtual environments, .git,
caches and build folders left out) for words that only make sense to whoever organised the work: a
numbered work session, an issue a change was filed under, the name of the planning document, paths into
a folder outside the repository. Ordinary uses of the words stay fine: a sandbox session,
`start_new_session`, pytest's session scope.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Final

ROOT = Path(__file__).resolve().parents[2]

SUFFIXES: Final = {".py", ".toml", ".md"}
SKIP_DIRS: Final = {".venv", "venv", ".git", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache",
                    ".mypy_cache", ".hypothesis", ".rlbus", "node_modules"}

# Each pattern is written so that its own source text does not match it (this file is scanned too).
FORBIDDEN: Final[dict[str, re.Pattern[str]]] = {
    "a numbered work session": re.compile(r"\bsessions?[ -]+\d", re.IGNORECASE),
    "a filed issue": re.compile(r"\bthe\s+issue\b", re.IGNORECASE),
    "the planning document's name": re.compile(r"\bRL\.md\b"),
    "a path outside the repository": re.compile(r"\.\./shared\b"),
}


def scanned_files(root: Path) -> Iterator[Path]:
    """README.md, docs/ and every .py/.toml/.md below `root`, skipping environments, caches and builds."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            path = Path(folder) / name
            if path.suffix in SUFFIXES and not path.is_symlink():
                yield path


def findings(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the line) for every forbidden word in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for what, pattern in FORBIDDEN.items():
            if pattern.search(line):
                found.append((number, what, line.strip()))
    return found


def test_no_planning_words_in_the_repository() -> None:
    """No file speaks of numbered work sessions, filed issues, the planning document or paths outside the repo."""
    problems = [f"{path.relative_to(ROOT)}:{number}: {what}: {line}"
                for path in scanned_files(ROOT)
                for number, what, line in findings(path.read_text(errors="replace"))]
    assert not problems, "reword these to speak of the project:\n" + "\n".join(problems)


def test_the_scan_covers_readme_docs_code_and_config() -> None:
    """The scan reads the README, docs/, Python, TOML and itself, and none of the virtual environment."""
    files = {path.relative_to(ROOT).as_posix() for path in scanned_files(ROOT)}
    assert {"README.md", "pyproject.toml", "tests/meta/test_meta_words.py", "docs/design.md"} <= files
    assert not any(name.startswith(".venv/") for name in files)


def test_the_finder_flags_planning_words_and_spares_ordinary_ones() -> None:
    """Samples of each forbidden word are flagged; a sandbox session and pytest's session scope are not."""
    bad = [
        "measured in " + "session" + " 4",
        "the " + "session" + "-7 runs",
        "(" + "sessions" + " 4-8)",
        "The " + "issue" + "'s target of 2x",
        "contract 3 of RL" + ".md",
        "see .." + "/shared/DESIGN.md",
    ]
    for sample in bad:
        assert findings(sample), sample
    good = [
        "an agentic episode owns a sandbox session: a workspace",
        "subprocess.Popen(cmd, start_new_session=True)",
        '@pytest.fixture(scope="session")',
        "one real nats-server per session, session-scoped",
        "the issuer of the certificate",
        "shared/ folder of the repository",
    ]
    for sample in good:
        assert not findings(sample), sample
