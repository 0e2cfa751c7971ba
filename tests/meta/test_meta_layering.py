"""Repository rules that code review alone would miss: imports point one way, and subject strings are
built only in messages/subjects.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED: dict[str, set[str]] = {
    "messages": set(),
    "kernels": set(),
    "model": {"kernels"},
    "actors": {"messages", "model", "kernels"},
    "topology": {"messages", "actors", "model"},
    "ops": {"messages", "model", "kernels", "actors", "topology"},
}
SHARED_ROOTS: frozenset[str] = frozenset({"rlbus.messages.errors"})
"""Modules every layer may import whatever its place: the root of rlbus's errors lives in the lowest layer."""


def rlbus_imports(path: Path) -> set[str]:
    """The top-level rlbus folders a module imports (absolute `rlbus.<folder>` imports)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if name in SHARED_ROOTS:
                continue
            if parts[0] == "rlbus" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_imports_point_down() -> None:
    """ops → topology → actors → model|messages|kernels; nothing below imports upward (the error root,
    messages/errors.py, is for everyone)."""
    bad = []
    for layer, allowed in ALLOWED.items():
        for path in (ROOT / layer).rglob("*.py"):
            for imported in rlbus_imports(path) - allowed - {layer}:
                bad.append(f"{path.relative_to(ROOT)} imports rlbus.{imported}")
    assert not bad, "\n".join(bad)


ACTOR_INFRASTRUCTURE: frozenset[str] = frozenset({"base", "common", "host", "process", "kinds"})
"""Modules of actors/ that are not an actor kind: the base, the shared layer and the launch plumbing."""
LAUNCHERS: frozenset[str] = frozenset({"host", "process", "kinds"})
"""The only modules of actors/ that may import actor kinds (`kinds.build_actor` is the one `match`)."""


def actor_unit(path: Path, root: Path = ROOT) -> str:
    """The unit of actors/ a file belongs to: `base`, `common`, `trainer` (actors/trainer/...), `feeder`, …"""
    rel = path.relative_to(root / "actors")
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def actor_imports(path: Path, root: Path = ROOT) -> set[str]:
    """The units of actors/ a module imports: absolute (`rlbus.actors.x[.y]`, `from rlbus.actors import x`)
    and relative (`from . import x`, `from .x import y`, `from ..x import y`) forms alike."""
    here = path.relative_to(root).with_suffix("").parts          # ("actors", "trainer", "core")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        modules: list[tuple[str, ...]] = []
        if isinstance(node, ast.Import):
            modules = [tuple(a.name.split(".")) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = here[:-1]
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ("rlbus", *base, *(node.module.split(".") if node.module else ()))
            else:
                target = tuple((node.module or "").split("."))
            modules = [target]
            if len(target) == 2 and target[:2] == ("rlbus", "actors"):   # from rlbus.actors import x
                modules = [(*target, a.name) for a in node.names]
        for parts in modules:
            if parts[:2] == ("rlbus", "actors") and len(parts) > 2:
                found.add(parts[2])
    return found


def test_no_actor_kind_imports_another() -> None:
    """An actor kind imports only actors.base, the shared layer actors/common/ and its own modules; the
    shared layer imports no actor kind; only the launch plumbing (host, process, kinds) knows every kind."""
    bad = []
    for path in (ROOT / "actors").rglob("*.py"):
        unit = actor_unit(path)
        if unit in LAUNCHERS or unit == "__init__":
            continue
        allowed = {"base", "common", unit}
        for imported in actor_imports(path) - allowed:
            bad.append(f"{path.relative_to(ROOT)} ({unit}) imports rlbus.actors.{imported}")
    assert not bad, "\n".join(bad)


def test_the_actor_checker_sees_every_import_form(tmp_path: Path) -> None:
    """Absolute, `from rlbus.actors import x` and relative imports are all seen (so the rule above can fail)."""
    (tmp_path / "actors" / "trainer").mkdir(parents=True)
    sample = tmp_path / "actors" / "sample.py"
    nested = tmp_path / "actors" / "trainer" / "sample.py"
    sample.write_text("import rlbus.actors.feeder\nfrom rlbus.actors import publisher, base\n"
                      "from .generator.actor import Generator\nfrom . import evaluator\n")
    nested.write_text("from ..checkpointer import x\nfrom .core import y\nfrom .. import demo\n")
    assert actor_imports(sample, tmp_path) == {"feeder", "publisher", "base", "generator", "evaluator"}
    assert actor_imports(nested, tmp_path) == {"checkpointer", "trainer", "demo"}
    assert actor_unit(nested, tmp_path) == "trainer"


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The import walker recognises both import forms (so the rule above can fail)."""
    sample = tmp_path / "x.py"
    sample.write_text("import rlbus.ops.cli\nfrom rlbus.actors.base import Actor\nfrom . import y\n")
    assert rlbus_imports(sample) == {"ops", "actors"}


POLICY_INTERFACE = "policies.interface"
"""The one module of model/policies/ that actors may import: every other one is a policy implementation (or
builds, exports or quantises one), and pretraining (model/training/pretrain.py) builds policies too."""
POLICY_BUILDERS: frozenset[str] = frozenset({"training.pretrain"})


def model_imports(path: Path) -> set[str]:
    """The modules of model/ a file imports, as dotted paths below `rlbus.model` (`policies.hf`, `env`), from
    `import rlbus.model.x.y`, `from rlbus.model.x import y` and `from rlbus.model import x`, inside functions too."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.removeprefix("rlbus.model.") for a in node.names if a.name.startswith("rlbus.model.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "rlbus.model" or node.module.startswith("rlbus.model."):
                package = node.module.removeprefix("rlbus.model").lstrip(".")
                found |= {f"{package}.{a.name}".lstrip(".") for a in node.names}
                if package:
                    found.add(package)
    return found


def reaches_an_implementation(module: str) -> bool:
    """A model module path that is (or is inside) a policy implementation: anything under `policies` but the
    interface, `policies` itself only when it names a submodule, and the policy builders."""
    if module in POLICY_BUILDERS or any(module.startswith(b + ".") for b in POLICY_BUILDERS):
        return True
    return module.startswith("policies.") and not (module == POLICY_INTERFACE or module.startswith(POLICY_INTERFACE + "."))


def test_no_actor_imports_a_policy_implementation() -> None:
    """Actors see models only through the policy interface (model/policies/interface.py): never the built-in
    transformer or tokenizer, the Hugging Face policy, export, or pretraining, directly."""
    bad = [f"{path.relative_to(ROOT)} imports rlbus.model.{name}"
           for path in (ROOT / "actors").rglob("*.py") for name in model_imports(path)
           if reaches_an_implementation(name)]
    assert not bad, "\n".join(bad)


def test_the_model_package_re_exports_nothing() -> None:
    """`rlbus.model` and `rlbus.model.policies` import nothing, so `from rlbus.model import X` cannot reach an
    implementation past the rule above."""
    for init in (ROOT / "model" / "__init__.py", ROOT / "model" / "policies" / "__init__.py"):
        tree = ast.parse(init.read_text())
        assert not [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)
                    and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")], init


def test_the_model_import_checker_sees_every_form(tmp_path: Path) -> None:
    """Absolute, from-package and function-level imports are all seen (so the rule above can fail)."""
    sample = tmp_path / "x.py"
    sample.write_text("import rlbus.model.policies.transformer\nfrom rlbus.model.policies import tokenizer, interface\n"
                      "def f():\n    from rlbus.model.policies.hf import HFPolicy\n"
                      "from rlbus.model.training import pretrain\n")
    found = model_imports(sample)
    assert {"policies.transformer", "policies.tokenizer", "policies.interface", "policies.hf.HFPolicy",
            "training.pretrain"} <= found
    assert {m for m in found if reaches_an_implementation(m)} == {
        "policies.transformer", "policies.tokenizer", "policies.hf", "policies.hf.HFPolicy", "training.pretrain"}


TOPOLOGY_ROOMS: dict[str, set[str]] = {
    "network": set(),
    "file": {"network"},
    "backends": {"file", "network"},
    "examples": set(),
}
"""The rooms of topology/ each may import besides its own: the servers and links know no topology file and no
launcher; the file's schema reads link shapes and a region's cluster size from network/; only backends/ launches."""


def topology_imports(path: Path) -> set[str]:
    """The rooms of topology/ a module imports (`rlbus.topology.<room>...`, `from rlbus.topology import <room>`),
    inside functions too."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            base = node.module.split(".")
            modules = [[*base, a.name] for a in node.names] if base == ["rlbus", "topology"] else [base]
        else:
            continue
        found |= {parts[2] for parts in modules if parts[:2] == ["rlbus", "topology"] and len(parts) > 2}
    return found


def test_topology_rooms_point_one_way() -> None:
    """topology/: backends → file → network; network/ (servers, regions, links) imports neither the file nor
    the launchers, and nothing but backends/ imports backends/."""
    bad = []
    for room, allowed in TOPOLOGY_ROOMS.items():
        for path in (ROOT / "topology" / room).rglob("*.py"):
            for imported in topology_imports(path) - allowed - {room}:
                bad.append(f"{path.relative_to(ROOT)} ({room}/) imports rlbus.topology.{imported}")
    assert not bad, "\n".join(bad)
    assert set(TOPOLOGY_ROOMS) == {p.name for p in (ROOT / "topology").iterdir() if (p / "__init__.py").exists()}


def test_the_topology_room_checker_sees_every_form(tmp_path: Path) -> None:
    """Absolute, from-package and function-level imports are all seen (so the rule above can fail)."""
    sample = tmp_path / "x.py"
    sample.write_text("import rlbus.topology.backends.launch\nfrom rlbus.topology import file\n"
                      "def f():\n    from rlbus.topology.network.servers import EmbeddedServer\n")
    assert topology_imports(sample) == {"backends", "file", "network"}


_PACKAGES = ("actors", "messages", "model", "kernels", "topology", "ops", "tests")
_SUBJECT_START = re.compile(r"(rlbus\.(?!({})\b)|\$KV\.|\$O\.|\$JS\.|\$SRV\.)".format("|".join(_PACKAGES)))


def subject_literals(path: Path) -> list[str]:
    """String constants (f-string parts included) that begin like a subject: `rlbus.<x>`, `$KV.`, `$O.`, `$JS.`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _SUBJECT_START.match(node.value):
            found.append(f"{path.name}:{node.lineno}: {node.value[:60]!r}")
    return found


def test_no_subject_literals_outside_subjects_module() -> None:
    """Subject strings appear only in messages/subjects.py."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv", "build") or rel == Path("messages/subjects.py"):
            continue
        offenders += subject_literals(path)
    assert not offenders, "\n".join(offenders)


def test_the_literal_finder_sees_subjects(tmp_path: Path) -> None:
    """The finder flags plain and f-string subjects but not module paths (so the rule above can fail)."""
    sample = tmp_path / "x.py"
    sample.write_text('a = "rlbus.r1.tasks"\nb = f"rlbus.{run}.x"\nc = "rlbus.ops.cli"\nd = "$KV.B.k"\n')
    assert len(subject_literals(sample)) == 3


def test_root_is_a_namespace_package() -> None:
    """No __init__.py at the root (pytest would import the repository twice)."""
    assert not (ROOT / "__init__.py").exists()
    assert not (ROOT / "tests" / "__init__.py").exists()
