"""The README stays true: its topology reference is the generated one, and it shows the CI test command."""

from __future__ import annotations

from pathlib import Path

from rlbus.topology.reference import reference_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_readme_topology_reference_is_generated() -> None:
    """The README's key reference equals `rlbus validate --reference` (regenerate it when the schema changes)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("<!-- topology-reference:start -->\n") + len("<!-- topology-reference:start -->\n")
    end = text.index("<!-- topology-reference:end -->")
    assert text[start:end].strip() == reference_markdown().strip()


def test_readme_shows_the_ci_command() -> None:
    """.ci/run runs exactly the test command the README shows."""
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in (ROOT / "README.md").read_text()
