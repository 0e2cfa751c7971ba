"""The README and docs/ stay true: the topology reference is the generated one, the README shows the CI
test command and a valid topology, and every repository path, test and link they cite exists."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

from rlbus.topology.file.reference import reference_markdown

ROOT = Path(__file__).resolve().parents[2]
DOCS: Final = ("README.md", "docs/design.md", "docs/experiments.md", "docs/topology.md", "docs/recording.md")

_CITED: Final = re.compile(
    r"`((?:actors|messages|model|kernels|topology|ops|tests|docs|\.ci)/[\w./-]*?)(?:::(\w+))?`")
"""A repository path in backticks, optionally `::test_name` (a path ends at the backtick or at `::`)."""
_LINK: Final = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
"""The target of a Markdown link `[text](target)`, anchor dropped."""


def test_topology_reference_is_generated() -> None:
    """docs/topology.md equals `rlbus validate --reference` (regenerate it when the schema changes:
    `.venv/bin/rlbus validate --reference > docs/topology.md`)."""
    assert (ROOT / "docs" / "topology.md").read_text().strip() == reference_markdown().strip()


def test_readme_shows_the_ci_command() -> None:
    """.ci/run runs exactly the test command the README shows."""
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in (ROOT / "README.md").read_text()


def test_readme_topology_example_is_valid() -> None:
    """The annotated TOML in the README is a topology `rlbus validate` accepts without an error or a warning."""
    from rlbus.topology.file.load import validate_text

    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```toml\n(.*?)^```$", text, re.M | re.S)
    assert blocks, "the README shows no ```toml block"
    for block in blocks:
        topology, problems = validate_text(block, local_cores=2)
        assert topology is not None and not problems, [str(p) for p in problems]


def cited(text: str) -> list[tuple[str, str | None]]:
    """(path, test or function name or None) for every repository path the text cites in backticks."""
    return [(m.group(1), m.group(2)) for m in _CITED.finditer(text)]


def missing(root: Path, text: str) -> list[str]:
    """Cited paths that do not exist under `root`, cited names their file does not define, links that go nowhere."""
    problems = []
    for path, name in cited(text):
        target = root / path
        if not target.exists():
            problems.append(path)
        elif name and not re.search(rf"^\s*(?:async\s+)?def {name}\(|^class {name}\b", target.read_text(), re.M):
            problems.append(f"{path}::{name}")
    for link in _LINK.findall(text):
        if not re.match(r"[a-z]+:", link) and not (root / link).exists():
            problems.append(f"link {link}")
    return problems


def test_every_cited_path_test_and_link_exists() -> None:
    """Each path, `path::test_name` and relative link in the README and docs/ names something that exists."""
    problems = []
    for doc in DOCS:
        path = ROOT / doc
        if path.exists():
            base = ROOT if doc == "README.md" else path.parent
            problems += [f"{doc}: {p}" for p in missing(ROOT, path.read_text())
                         if not p.startswith("link ")]
            problems += [f"{doc}: {p}" for p in missing(base, path.read_text()) if p.startswith("link ")]
    assert not problems, "\n".join(problems)


def test_the_checker_sees_a_missing_path_test_and_link(tmp_path: Path) -> None:
    """A cited file that is not there, a test its file lacks and a dead link are each reported."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_real() -> None:\n    pass\n")
    text = ("`tests/test_x.py::test_real` `tests/test_x.py::test_gone` `actors/nothing.py` "
            "[design](docs/none.md) [web](https://example.org)")
    assert missing(tmp_path, text) == ["tests/test_x.py::test_gone", "actors/nothing.py", "link docs/none.md"]
