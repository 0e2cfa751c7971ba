"""A scripted expert for agentic repository tasks: the next tool call, planned from the task, a seed and what the
tools have answered so far.

- Owns: `Expert` (an episode as a careful engineer works it: list the files, read the relevant ones and some
  others, run a check, read its failure, edit with exact replacements from the task's solution, check again,
  submit; seeded variation in the order, the file read first, a search first, two reads in one turn, and an
  occasional wrong first edit that the check shows, or a review of the change finds, and the expert then
  corrects), `Step`, `Observed`, `check_command` (the check the expert runs), `edit_calls` (exact replacements
  turning one text into another) and `wrong_version` (a plausible wrong fix).
- Guarantee: pure: the same task, seed and observations give the same step; nothing here runs a tool.
- Does not: run tools or grade (the sandbox session, ops/tasks_demos.py), render turns for a tokenizer
  (model/env/agentic.py) or word summaries (model/env/summaries.py).
"""

from __future__ import annotations

import ast
import difflib
import random
import re
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Final

from rlbus.model.env.summaries import summary_text
from rlbus.model.tasks import mutators
from rlbus.model.tasks.repo import EditError, RepoTask, apply_edit
from rlbus.model.tasks.repo_grade import is_test_file
from rlbus.model.tools.calls import ToolCall

LONG_FILE_LINES: Final = 150
"""A file longer than this is searched first and read only around the change."""
WINDOW_LINES: Final = 40
"""Lines read on either side of a change in a long file."""
WRONG_FIRST: Final = 0.3
"""How often the expert's first edit is wrong (where the check can show it)."""
_WRONG_KINDS: Final = ("compare", "arith", "off_by_one", "variable", "constant")
_NAMED: Final = re.compile(r"`([A-Za-z_]\w*)")


@dataclass(frozen=True, slots=True)
class Step:
    """One assistant turn: a short note and the tool calls it makes (the last turn's only call is submit)."""

    content: str
    calls: tuple[ToolCall, ...]

    @property
    def submits(self) -> bool:
        return any(c.name == "submit" for c in self.calls)


@dataclass(frozen=True, slots=True)
class Observed:
    """A call that ran and the text the policy read of its outcome (model/tools/calls.py `outcome_text`)."""

    call: ToolCall
    text: str


# ---- what the expert knows of a task -----------------------------------------------------------------------
def changed_paths(task: RepoTask) -> list[str]:
    """The files the task's solution adds or changes, in path order."""
    return [p for p in sorted(task.solution) if task.files.get(p) != task.solution[p]]


def probe_cases(task: RepoTask) -> list[tuple[str, str, str]]:
    """(module, call, expected repr) for the calls of the functions the instruction names, read from hidden tests
    written as the built-in tasks write them (`assertEqual(exact(f(...)), ..., "f(...) should be V")`); none for
    other tests. The expected values are what the instruction describes; the tests themselves are never shown."""
    imported: dict[str, str] = {}
    cases: list[tuple[str, str, str]] = []
    for text in task.hidden_tests.values():
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.update((a.name, node.module) for a in node.names)
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "assertEqual" and len(node.args) == 3):
                continue
            first, message = node.args[0], node.args[2]
            if not (isinstance(first, ast.Call) and isinstance(first.func, ast.Name) and first.func.id == "exact"
                    and len(first.args) == 1 and isinstance(first.args[0], ast.Call)
                    and isinstance(first.args[0].func, ast.Name) and isinstance(message, ast.Constant)
                    and isinstance(message.value, str) and " should be " in message.value):
                continue
            call, want = message.value.split(" should be ", 1)
            cases.append((first.args[0].func.id, call, want))
    named = set(_NAMED.findall(task.instruction))
    chosen = [c for c in cases if c[0] in named and c[0] in imported] or [c for c in cases if c[0] in imported]
    return [(imported[name], call, want) for name, call, want in chosen]


def check_command(task: RepoTask, cases: Sequence[tuple[str, str, str]] | None = None) -> tuple[str, bool]:
    """(command, whether its exit code tells a fix from no fix): a script calling the named functions on the
    inputs the instruction describes and comparing each result's repr (`probe_cases`); else the repository's own
    tests (`test*.py` files in it); else an import smoke check of the changed Python files. Python runs with
    -B: bytecode cached by one run could otherwise outlive an edit of the same size within the same second."""
    cases = probe_cases(task) if cases is None else cases
    if cases:
        modules: dict[str, list[str]] = {}
        for module, call, _ in cases:
            name = call.partition("(")[0]
            if name not in modules.setdefault(module, []):
                modules[module].append(name)
        imports = "".join(f"from {m} import {', '.join(names)}\n" for m, names in modules.items())
        rows = "".join(f"    ({call!r}, {want!r}),\n" for _, call, want in cases)
        script = (f"{imports}cases = [\n{rows}]\nbad = 0\nfor call, want in cases:\n    got = repr(eval(call))\n"
                  "    print('ok  ' if got == want else 'FAIL', call, '=', got, '' if got == want else "
                  "f'(expected {want})')\n    bad += got != want\nraise SystemExit(1 if bad else 0)\n")
        return f"python3 -B - <<'EOF'\n{script}EOF", True
    if any(is_test_file(p) for p in task.files):
        return "python3 -B -m unittest discover -s . -p 'test*.py' 2>&1 | tail -n 30", True
    py = [p for p in changed_paths(task) if p.endswith(".py")]
    if not py:
        return "ls -R", False
    modules = [p.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for p in py]
    return f"python3 -B -c \"import {', '.join(modules)}\" && echo 'imports cleanly'", False


def passed(text: str) -> bool:
    """Whether a `run` outcome's text says exit code 0."""
    return text.startswith("exit code 0")


def failure_line(text: str) -> str:
    """The line of a check's output that says what is wrong: the first FAIL line, else the last line naming an
    error, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("FAIL"):
            return line
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line
    return lines[-1] if lines else ""


# ---- edits ------------------------------------------------------------------------------------------------
def edit_calls(path: str, before: str, after: str) -> tuple[ToolCall, ...]:
    """Calls turning `before` into `after` in `path`: an `edit_file` per changed hunk, each `old` grown by lines
    of context until it occurs once in the text it is applied to; a single `write_file` when that fails."""
    write = (ToolCall("write_file", {"path": path, "content": after}),)
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    calls: list[ToolCall] = []
    text = before
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        lo, hi = i1, i2
        for _ in range(12):
            old = "".join(a[lo:hi])
            if old and text.count(old) == 1:
                break
            lo, hi = (max(lo - 1, 0), hi) if (hi - lo) % 2 == 0 or hi >= len(a) else (lo, min(hi + 1, len(a)))
        else:
            return write
        new = "".join(a[lo:i1]) + "".join(b[j1:j2]) + "".join(a[i2:hi])
        call = ToolCall("edit_file", {"path": path, "old": "".join(a[lo:hi]), "new": new})
        try:
            text = apply_edit({path: text}, call)[path]
        except EditError:
            return write
        calls.append(call)
    return tuple(calls) if text == after and calls else write


def _functions_at(text: str, lines: Sequence[int]) -> list[str]:
    """Names of the functions of `text` containing any of `lines` (1-based)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    return [name for name, _, node in mutators.functions(tree)
            if any(node.lineno <= n <= (node.end_lineno or node.lineno) for n in lines)]


def _changed_lines(before: str, after: str) -> list[int]:
    """Lines (1-based) of `after` the change touches (for a deletion, the line after it)."""
    a, b = before.splitlines(), after.splitlines()
    out: list[int] = []
    for tag, _, _, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            out += list(range(j1 + 1, max(j2, j1 + 1) + 1))
    return out


def wrong_version(before: str, after: str, rng: random.Random) -> str | None:
    """`after` with one more seeded change (model/tasks/mutators.py: an operator, a bound, a name or a number) on a
    line the fix changes, else in a function it touches: a plausible wrong fix, different from `before` and
    `after`; None when there is none."""
    lines = set(_changed_lines(before, after))
    names = set(_functions_at(after, sorted(lines)))
    if not names:
        return None
    tree = ast.parse(after)
    inside = [s for s in mutators.sites(tree, _WRONG_KINDS) if s.function in names]
    on_line = [s for s in inside if getattr(mutators.resolve(tree, s.path), "lineno", 0) in lines]
    candidates = on_line or inside
    rng.shuffle(candidates)
    for site in candidates:
        changed = mutators.apply_site(after, site)
        if changed is not None and changed[0] not in (before, after):
            return changed[0]
    return None


# ---- the expert -------------------------------------------------------------------------------------------
_Plan = Generator[Step, tuple[str, ...], None]


class Expert:
    """A careful engineer working one repository task, with variation drawn from `seed`.

    `next_step(observed)` is the turn after the calls observed so far (each step's calls in order; the replay of
    the plan checks they are the ones it made). The plan reacts to what the tools answered: a check that fails
    after a wrong first edit is followed by its correction (one that passes, by a review of the changed lines and
    then the correction), an edit the workspace refused by a `write_file` of the solution. The edits come from the task's `solution` (never from its hidden tests); the check from
    `check_command`.
    """

    def __init__(self, task: RepoTask, seed: int) -> None:
        if not task.solution:
            raise ValueError(f"task {task.task_id} has no solution to demonstrate")
        self.task = task
        self.seed = seed
        self.changed = changed_paths(task)
        cases = probe_cases(task)
        self.check, self.check_tells = check_command(task, cases)
        self._probes = bool(cases)
        self.wrong_first = False
        """Whether the plan, as far as it was replayed, made a wrong first edit."""
        self._live: tuple[_Plan, list[Observed], Step] | None = None
        """The plan last replayed, the observations it was sent and the step it gave: a call with those observations
        and more goes on from it instead of replaying from the start."""

    def next_step(self, observed: Sequence[Observed]) -> Step:
        """The next turn given every call observed so far.

        :raises ValueError: `observed` is not what this expert's plan called, or the plan has submitted.
        """
        if self._live is not None and list(observed[:len(self._live[1])]) == self._live[1]:
            plan, seen, step = self._live
            i = len(seen)
        else:
            plan = self._plan(random.Random(f"demo:{self.task.task_id}:{self.seed}"))
            step = next(plan)
            i = 0
        self._live = None
        while i < len(observed):
            if step.submits:
                raise ValueError("the expert has submitted; the episode is over")
            got = tuple(o.call for o in observed[i:i + len(step.calls)])
            if got != step.calls:
                raise ValueError(f"observed calls {[c.name for c in got]} are not the expert's "
                                 f"{[c.name for c in step.calls]} (call {i})")
            step = plan.send(tuple(o.text for o in observed[i:i + len(got)]))
            i += len(got)
        self._live = (plan, list(observed), step)
        return step

    def summary(self, observed: Sequence[Observed]) -> str:
        """The expert's summary of its work after `observed` (model/env/summaries.py `summary_text`)."""
        first = self.task.instruction.strip().split("\n")[0]
        found = [f"the task: {first[:300]}"]
        reads = sorted({o.call.arguments["path"] for o in observed if o.call.name == "read_file"})
        if reads:
            found.append(f"read {', '.join(reads)}")
        checks = [o for o in observed if o.call.name == "run"]
        if checks:
            last = checks[-1].text
            found.append(f"the check (`run`) last {'passed' if passed(last) else 'failed'}: {failure_line(last)[:200]}")
        changed = [f"{o.call.arguments['path']} ({o.call.name})" for o in observed
                   if o.call.name in ("edit_file", "write_file") and not o.text.startswith("error:")]
        return summary_text(found=found, changed=changed, next_step=self.next_step(observed).content)

    # -- the plan ---------------------------------------------------------------------------------------------
    def _plan(self, rng: random.Random) -> _Plan:
        task = self.task
        named = [n for n in dict.fromkeys(_NAMED.findall(task.instruction)) if n.isidentifier()]
        existing = [p for p in self.changed if p in task.files]
        others = [p for p in sorted(task.files) if p not in self.changed]
        if named and rng.random() < 0.25:
            yield Step(rng.choice((f"Where is `{named[0]}` defined and used?",
                                   f"Let me find `{named[0]}` first.")),
                       (ToolCall("search", {"pattern": rf"\b{named[0]}\b", "path": "."}),))
        yield Step(rng.choice(("Let me see what is in the repository.", "First, the layout of the repository.",
                               "I'll start by listing the files.")), (ToolCall("list_files", {"path": "."}),))
        extra = rng.sample(others, k=min(len(others), rng.choice((0, 1, 1, 2))))
        reads = existing + extra
        rng.shuffle(reads)
        if existing and rng.random() < 0.5 and reads[0] not in existing:   # often the relevant file first
            reads.remove(existing[0])
            reads.insert(0, existing[0])
        early = rng.random() < 0.35
        failing = ""
        pending: list[ToolCall] = []
        for k, path in enumerate(reads):
            relevant = path in existing
            for step in self._read(path, relevant, rng):
                if len(step.calls) == 1 and step.calls[0].name == "read_file" and not relevant and not pending \
                        and rng.random() < 0.3 and k + 1 < len(reads):
                    pending.append(step.calls[0])        # read two files in one turn
                    continue
                if pending and step.calls[0].name == "read_file":
                    step = Step(f"Reading {pending[0].arguments['path']} and {path}.", (*pending, *step.calls))
                elif pending:
                    yield Step(f"Reading {pending[0].arguments['path']}.", tuple(pending))
                pending = []
                yield step
            if early and k == 0:
                failing = yield from self._first_check()
        if pending:
            yield Step(f"Reading {pending[0].arguments['path']}.", tuple(pending))
        if not (early and reads):
            failing = yield from self._first_check()
        why = f"The check fails: `{failing[:200]}`. I'll fix that." if failing else ""
        wrong_path = next((p for p in existing if p.endswith(".py")), None)
        wrong = (wrong_version(task.files[wrong_path], task.solution[wrong_path], rng)
                 if wrong_path and self.check_tells and rng.random() < WRONG_FIRST else None)
        self.wrong_first = wrong is not None
        if wrong is not None and wrong_path is not None:
            yield from self._edit(wrong_path, task.files[wrong_path], wrong, rng, why=why)
            result = yield Step("Let me run the check again.", (self._run(),))
            if passed(result[0]):                     # the check missed it: a review of the change finds it
                first = _changed_lines(task.solution[wrong_path], wrong)[0]
                yield Step(f"The check passes. Let me review my change in {wrong_path} before submitting.",
                           (ToolCall("read_file", {"path": wrong_path, "start_line": max(1, first - 5),
                                                   "end_line": first + 5}),))
                why = f"Line {first} is not what I meant to write; correcting it."
            else:
                why = f"Still wrong: `{failure_line(result[0])[:200]}`. My change was not right; I'll correct it."
            yield from self._edit(wrong_path, wrong, task.solution[wrong_path], rng, why=why)
            why = ""
        for path in self.changed:
            if path != wrong_path or wrong is None:
                yield from self._edit(path, task.files.get(path), task.solution[path], rng, why=why)
                why = ""
        if self.check:
            result = yield Step(rng.choice(("Now the check again.", "Let me verify the fix.",
                                            "Running the check again.")), (self._run(),))
            if not passed(result[0]) and self.check_tells:
                for path in self.changed:
                    yield Step(f"The check still fails (`{failure_line(result[0])[:200]}`); I'll write {path} "
                               "out in full.", (ToolCall("write_file", {"path": path, "content": task.solution[path]}),))
                yield Step("And the check once more.", (self._run(),))
        yield Step(rng.choice(("The change is done; submitting.", "Everything checks out. Submitting.",
                               "Done. I'll submit.")), (ToolCall("submit", {}),))

    def _run(self) -> ToolCall:
        return ToolCall("run", {"command": self.check})

    def _first_check(self) -> Generator[Step, tuple[str, ...], str]:
        """The first run of the check; the line of its output that says what is wrong ("" when it passed)."""
        if not self.check:
            return ""
        what = ("Let me reproduce the problem with a quick check of the functions the task names."
                if self.check_tells and self._probes else
                "Let me run the tests." if self.check_tells else "Let me check that the code compiles and imports.")
        result = yield Step(what, (self._run(),))
        return "" if passed(result[0]) else failure_line(result[0])

    def _read(self, path: str, relevant: bool, rng: random.Random) -> Generator[Step, tuple[str, ...], None]:
        text = self.task.files[path]
        lines = text.count("\n") + 1
        why = rng.choice((f"Reading {path}, the code the task is about.", f"Let me read {path}.")) if relevant \
            else rng.choice((f"And {path}, for context.", f"Let me also look at {path}."))
        if lines <= LONG_FILE_LINES or not relevant:
            if lines > LONG_FILE_LINES:
                yield Step(why, (ToolCall("read_file", {"path": path, "start_line": 1, "end_line": 60}),))
            else:
                yield Step(why, (ToolCall("read_file", {"path": path}),))
            return
        at = _changed_lines(text, self.task.solution[path])
        names = _functions_at(self.task.solution[path], at)
        if names:
            short = names[0].rpartition(".")[2]
            yield Step(f"{path} is long; let me find `{short}` in it.",
                       (ToolCall("search", {"pattern": rf"def {short}\b", "path": path}),))
        first = at[0] if at else 1
        yield Step(f"Reading {path} around line {first}.",
                   (ToolCall("read_file", {"path": path, "start_line": max(1, first - WINDOW_LINES),
                                           "end_line": first + WINDOW_LINES}),))

    def _edit(self, path: str, before: str | None, after: str, rng: random.Random, *,
              why: str = "") -> Generator[Step, tuple[str, ...], None]:
        """The edits turning `before` into `after` (a new file: written), one turn each; an edit the workspace
        refuses is followed by a `write_file` of `after`."""
        calls = (ToolCall("write_file", {"path": path, "content": after}),) if before is None else \
            edit_calls(path, before, after)
        for k, call in enumerate(calls):
            note = why if k == 0 and why else (
                f"I'll write {path}." if call.name == "write_file" else
                rng.choice((f"I'll fix this in {path}.", f"Editing {path}.", f"Changing {path}.")))
            answers = yield Step(note, (call,))
            if answers and answers[0].startswith("error:"):
                yield Step(f"That edit did not apply ({answers[0][:200]}); I'll write {path} in full.",
                           (ToolCall("write_file", {"path": path, "content": after}),))
                return


__all__ = ["Expert", "Observed", "Step", "changed_paths", "check_command", "edit_calls", "failure_line", "passed",
           "probe_cases", "wrong_version"]
