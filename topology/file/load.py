"""Reading and validating topology files: every problem at once, each with file, key path and expectation.

Owns: `validate(path)` (never raises for bad input: unreadable, not UTF-8, not TOML, bad keys, bad
values, broken cross-field rules are all `Problem`s), `load(path)` (raises `TopologyError` with all
of them), and re-exports the pure `check(topology)`. Order of work: tomllib into a dict, walk the dict
against the schema collecting every key/type/range problem (msgspec alone stops at the first), decode
with msgspec for the typed object, then run the cross-field rules. Does not: start anything.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Final

import msgspec
import msgspec.inspect as mi
import structlog

from rlbus.actors.common.config import feeder_file_problem, names_task_file, task_source_problem
from rlbus.messages.errors import TopologyError
from rlbus.topology.file._walk import Walker, key_path
from rlbus.topology.file.problem import Problem
from rlbus.topology.file.rules import check, check_sections
from rlbus.topology.file.schema import Topology

__all__ = ["Problem", "check", "load", "validate", "validate_text"]

log = structlog.get_logger()

_TOPOLOGY_TYPE: Final = mi.type_info(Topology)


def validate(path: str | os.PathLike[str], *, local_cores: int | None = None) -> tuple[Topology | None, list[Problem]]:
    """(topology, problems) for the file at `path`; the topology is None when any problem is an error.

    Every problem carries `file=str(path)`. Also warns when a region's credentials file is missing, its
    credentials environment variable is unset, or a TLS file is missing (they may exist where the actors run),
    and names each `[regions.link]` when this host cannot make network namespaces (those regions run on loopback),
    and reports as errors an `[evaluator] tasks` that is neither a source name nor a file here, and a repository
    task file of `[feeder] tasks` or `[evaluator] tasks` that is missing or has a bad row (naming its line and key).
    """
    file = str(path)
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None, [Problem(key="", message="cannot read: no such file", file=file)]
    except IsADirectoryError:
        return None, [Problem(key="", message="cannot read: is a directory, expected a TOML file", file=file)]
    except PermissionError:
        return None, [Problem(key="", message="cannot read: permission denied", file=file)]
    except OSError as err:
        return None, [Problem(key="", message=f"cannot read: {err.strerror or err}", file=file)]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, [Problem(key="", message=f"not a TOML file: not UTF-8 text (byte 0x{data[err.start]:02x} at "
                              f"offset {err.start})", file=file)]
    topology, problems = validate_text(text, local_cores=local_cores)
    if topology is not None:
        problems += _environment(topology)
        if any(p.severity == "error" for p in problems):
            topology = None
    return topology, [msgspec.structs.replace(p, file=file) for p in problems]


def validate_text(text: str, *, local_cores: int | None = None) -> tuple[Topology | None, list[Problem]]:
    """(topology, problems) for TOML text; problems carry no file. Pure apart from `os.cpu_count()`."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        return None, [Problem(key="", message=f"not valid TOML: {err}")]
    walker = Walker()
    usable, cleaned = walker.walk(raw, _TOPOLOGY_TYPE, [])
    problems = walker.problems
    if not usable:
        return None, problems
    try:
        topology = msgspec.convert(cleaned, type=Topology)
    except msgspec.ValidationError as err:  # the walker should have caught it; report rather than crash
        return None, [*problems, _from_validation_error(err)]
    # Bad values were dropped so their defaults apply; a rule resting on such a section would judge the
    # default, so its problems wait until the key-level problems are fixed. A bad top-level key taints all.
    tainted = {p.key.split(".")[0].split("[")[0] for p in problems if p.severity == "error"}
    if not any(("." not in p.key and "[" not in p.key) for p in problems):
        problems += [p for p, sections in check_sections(topology, local_cores=local_cores) if not sections & tainted]
    if any(p.severity == "error" for p in problems):
        return None, problems
    return topology, problems


def load(path: str | os.PathLike[str], *, local_cores: int | None = None) -> Topology:
    """The topology in the file at `path`; logs its warnings.

    :raises TopologyError: naming the file and every problem (one per line) if any is an error.
    """
    topology, problems = validate(path, local_cores=local_cores)
    if topology is None:
        errors = [p for p in problems if p.severity == "error"]
        if len(errors) == 1 and len(problems) == 1:       # one line: the problem names the file and the key
            raise TopologyError(f"{errors[0]} (check with `rlbus validate {path}`)")
        lines = "\n".join(f"  {p}" for p in problems)
        raise TopologyError(f"{path}: {len(errors)} problem{'s' if len(errors) != 1 else ''}; fix them and run "
                            f"`rlbus validate {path}`:\n{lines}")
    for problem in problems:
        log.warning("topology_warning", file=problem.file, key=problem.key, message=problem.message)
    return topology


def _environment(topology: Topology) -> list[Problem]:
    out: list[Problem] = []
    for i, region in enumerate(topology.regions):
        if region.embedded:
            continue
        if region.credentials_file is not None and not Path(region.credentials_file).is_file():
            out.append(Problem(key=f"regions[{i}].credentials_file", severity="warning",
                               message=f"no file {region.credentials_file!r} here (relative paths are from the "
                                       "working directory); the actors will fail to connect without it"))
        if region.credentials_env is not None and region.credentials_env not in os.environ:
            out.append(Problem(key=f"regions[{i}].credentials_env", severity="warning",
                               message=f"environment variable {region.credentials_env} is not set here"))
    if topology.tls.enabled:
        for name in ("ca_file", "cert_file", "key_file"):
            value = getattr(topology.tls, name)
            if value is not None and not Path(value).is_file():
                out.append(Problem(key=f"tls.{name}", severity="warning",
                                   message=f"no file {value!r} here (relative paths are from the working "
                                           "directory); servers and actors need it where they run"))
    if any(region.link is not None for region in topology.regions):
        from rlbus.topology.network.links import namespaces_unavailable

        if (why := namespaces_unavailable()) is not None:
            out += [Problem(key=f"regions[{i}].link", severity="warning",
                            message=f"needs network namespaces, which this host cannot make ({why}); "
                                    f"rlbus up runs region {region.name!r} on loopback, unshaped")
                    for i, region in enumerate(topology.regions) if region.link is not None]
    if (problem := task_source_problem(topology.evaluator.tasks)) is not None:
        out.append(Problem(key="evaluator.tasks", message=f"{problem}; the evaluator and the feeder read it"))
    else:
        out += repo_file_problems("evaluator.tasks", topology.evaluator.tasks)
    if names_task_file(topology.feeder.tasks):
        out += repo_file_problems("feeder.tasks", topology.feeder.tasks, required=True)
    out += policy_problems(topology)
    return out


def repo_file_problems(key: str, tasks: str, *, required: bool = False) -> list[Problem]:
    """What is wrong with the repository task file `tasks` names here (`key`: feeder.tasks or evaluator.tasks): no
    such file (when `required`: `[feeder] tasks` names no other kind of file), or, naming the file, the line and
    the key, its first bad row (model/tasks/sources.py `load_repo_tasks`; with a `:train` or `:heldout` ending, that split), or no task in it. A file whose
    first row is no repository task is not judged here unless `required`."""
    if (problem := feeder_file_problem(tasks)) is not None:
        return [Problem(key=key, message=problem)] if required else []
    from rlbus.model.tasks.sources import TaskSourceError, is_repo_file, load_repo_tasks

    path = Path(tasks)
    if not required and not is_repo_file(path):
        return []
    try:
        if not load_repo_tasks(tasks, n=1 << 30):
            return [Problem(key=key, message=f"{tasks}: no task in the repository task file")]
    except TaskSourceError as err:
        hint = "" if is_repo_file(path) else " (a file of functions to write goes in feeder.tasks_file)"
        return [Problem(key=key, message=f"{err}{hint}")]
    return []


def policy_problems(topology: Topology) -> list[Problem]:
    """What is wrong with `[policy]` here: a model directory that is missing (without a recipe) or unusable
    (config, architecture, weights, tokenizer, chat template), router replay or an expert precision on a dense
    model, and, as warnings, `device = "cuda"` on a machine without CUDA (the actors may run elsewhere) and the
    older keys that named a model (`generator.weights = "local:..."`, `pretrain.preset` beside a Hugging Face
    policy)."""
    from rlbus.model.policies.interface import PolicyError, check_policy_dir, is_moe_dir

    policy = topology.policy
    out: list[Problem] = []
    path = Path(policy.path) if policy.path else None
    if policy.kind == "hf" and path is None and policy.recipe is None:
        out.append(Problem(key="policy.path", message="kind 'hf' needs a model directory (config.json, safetensors "
                                                      "weights, tokenizer.json) or a [policy.recipe] to build one"))
    if path is not None and (path.exists() or policy.recipe is None):
        try:
            check_policy_dir(policy.kind, path)
        except PolicyError as err:
            out.append(Problem(key="policy.path", message=str(err)))
    if policy.recipe is not None and policy.kind != "hf":
        out.append(Problem(key="policy.recipe", message="a recipe builds a Hugging Face model: set policy.kind = "
                                                        "\"hf\", or drop the recipe ([pretrain] builds the built-in one)"))
    if policy.router_replay:
        routed = path is not None and path.exists() and is_moe_dir(policy.kind, path)
        if not routed:
            out.append(Problem(key="policy.router_replay", message="router replay needs a mixture-of-experts model; "
                                                                   "this policy is dense (or not built yet): drop "
                                                                   "the key, replay follows the model"))
    trainer = topology.trainer
    if trainer.precision != "bf16" and trainer.precision_scope == "experts":
        routed = path is not None and path.exists() and is_moe_dir(policy.kind, path)
        if not routed:
            out.append(Problem(key="trainer.precision", message=f"{trainer.precision!r} quantises MoE expert layers "
                                                                "and this policy has none (dense, or not built "
                                                                "yet): use \"bf16\", or set precision_scope = "
                                                                "\"all\" to quantise every Linear layer"))
    if topology.generator.weights.startswith("local:"):
        out.append(Problem(key="generator.weights", severity="warning",
                           message="naming a model here is deprecated: [policy] path names the model of every "
                                   "actor (a 'local:' model is still loaded, fixed, as before)"))
    if policy.kind == "hf" and policy.recipe is not None and topology.pretrain.preset != "small":
        out.append(Problem(key="pretrain.preset", severity="warning",
                           message="ignored for kind 'hf': the model's size is [policy.recipe] size (the steps, "
                                   "seed, threads and eval_n of [pretrain] still apply)"))
    if policy.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            out.append(Problem(key="policy.device", severity="warning",
                               message="no CUDA device on this machine; actors that run here will fail to start "
                                       "(fine when they run on GPU nodes)"))
    return out


def _from_validation_error(err: msgspec.ValidationError) -> Problem:
    text = str(err)
    message, _, where = text.partition(" - at `$")
    parts: list[Any] = []
    for piece in where.rstrip("`").replace("[", ".[").split("."):
        if piece.startswith("[") and piece[1:-1].isdigit():
            parts.append(int(piece[1:-1]))
        elif piece:
            parts.append(piece)
    return Problem(key=key_path(parts), message=message)
