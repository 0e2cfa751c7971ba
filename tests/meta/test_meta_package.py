"""The package as users install it: pyproject's package list matches the folders, and a built wheel, installed
into a fresh virtual environment (not editable), validates every shipped example and runs `rlbus up tiny` from a
directory outside the checkout.

The wheel's venv borrows the suite's site-packages for rlbus's dependencies (a `.pth` line: nothing downloads),
while rlbus itself comes from the wheel alone, which the test checks before running anything.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_SHIPPED = ("tests", "docs", ".ci")
"""Top-level folders of the repository that are not part of the package."""


def package_folders(root: Path = ROOT) -> set[str]:
    """Every folder of the repository holding an `__init__.py`, as its `rlbus.` dotted name."""
    names = set()
    for init in root.rglob("__init__.py"):
        parts = init.parent.relative_to(root).parts
        if not parts or parts[0] in NOT_SHIPPED or any(p.startswith(".") or p in {"build", "dist"} for p in parts):
            continue
        names.add(".".join(("rlbus", *parts)))
    return names


def listed_packages(root: Path = ROOT) -> set[str]:
    """`[tool.setuptools] packages` of pyproject.toml."""
    return set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def source_files(root: Path = ROOT) -> list[str]:
    """The checkout's files as git sees them (tracked, or new and not ignored), those present on disk."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True,
                            text=True, check=True).stdout
    return [rel for rel in listed.splitlines() if (root / rel).is_file()]


def shipped_files(root: Path = ROOT) -> set[str]:
    """The source files a wheel must carry, as paths inside it (`rlbus/...`): everything but the folders that
    are not shipped and the root's own files."""
    files = set()
    for rel in source_files(root):
        parts = Path(rel).parts
        if len(parts) < 2 or parts[0] in NOT_SHIPPED or parts[0].startswith("."):
            continue
        files.add("rlbus/" + rel)
    return files


def test_every_package_folder_is_listed_and_every_listed_package_exists() -> None:
    """A folder with an `__init__.py` that pyproject.toml does not list would be left out of the wheel."""
    folders, listed = package_folders(), listed_packages()
    assert folders - listed == set(), f"package folders missing from pyproject.toml: {sorted(folders - listed)}"
    assert listed - folders == set(), f"pyproject.toml lists packages with no folder: {sorted(listed - folders)}"


def test_the_folder_finder_sees_an_unlisted_package(tmp_path: Path) -> None:
    """The check above can fail: a new folder with an `__init__.py` is found, `tests/` is not."""
    (tmp_path / "model" / "newroom").mkdir(parents=True)
    (tmp_path / "model" / "__init__.py").write_text("")
    (tmp_path / "model" / "newroom" / "__init__.py").write_text("")
    (tmp_path / "tests" / "helpers").mkdir(parents=True)
    (tmp_path / "tests" / "helpers" / "__init__.py").write_text("")
    assert package_folders(tmp_path) == {"rlbus.model", "rlbus.model.newroom"}


def _run(argv: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    """Build the wheel from the source files, check it carries every package file, install it (not editable) into
    a fresh venv, then from an unrelated directory validate every shipped example and run two steps of `tiny`."""
    source = tmp_path / "source"
    for rel in source_files():
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        (source / rel).write_bytes((ROOT / rel).read_bytes())
    build = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                  "-w", str(tmp_path / "dist"), str(source)], cwd=tmp_path)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("rlbus-*.whl")
    inside = set(zipfile.ZipFile(wheel).namelist())
    missing = shipped_files() - inside
    assert not missing, f"the wheel leaves out: {sorted(missing)}"

    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path).returncode == 0
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path).stdout.strip())
    (site / "suite-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    str(wheel)], cwd=tmp_path)
    assert install.returncode == 0, install.stderr

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = _run([str(python), "-c", "import rlbus.model.env.agentic as m, rlbus.topology.examples as e, "
                  "importlib.resources as r; print(m.__file__); "
                  "print('\\n'.join(str(p) for p in r.files(e).iterdir() if p.name.endswith('.toml')))"],
                 cwd=outside)
    assert where.returncode == 0, where.stderr
    module, *examples = where.stdout.split()
    assert Path(module).is_relative_to(site), f"rlbus came from {module}, not the wheel's install in {site}"
    assert len(examples) >= 5, examples

    rlbus = str(venv / "bin" / "rlbus")
    for example in examples:
        checked = _run([rlbus, "validate", example], cwd=outside)
        assert checked.returncode == 0, f"{example}: {checked.stdout}{checked.stderr}"

    up = _run([rlbus, "up", "tiny", "--steps", "2", "--state-dir", str(outside / "state")], cwd=outside, timeout=280)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert "ledger (clean)" in up.stdout, up.stdout[-3000:]
    assert "optimizer steps 2" in up.stdout, up.stdout[-3000:]
