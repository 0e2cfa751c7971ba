"""The built-in coding-task family: "write `f` so that it does these steps", with examples and hidden tests.

Owns: task generation (deterministic from a seed), the held-out evaluation set and the training stream
that skips it (disjoint by prompt hash), canonical solutions.
Does not own: running code (`grading.py`), multi-turn episodes (`episodes.py`).

A task is a pipeline of 1-3 typed steps over an int `x`, a str `s` or a list `xs` ("add 3, then
multiply by 2"); some steps change the type ("take its length"), and the "branch" family wraps two
steps in an if/else. Difficulty grows with the number of steps and with branching.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, Literal

Kind = Literal["int", "str", "list"]
VAR: Final[dict[str, str]] = {"int": "x", "str": "s", "list": "xs"}
EVAL_POOL: Final = 2000
"""`train_tasks` skips the prompts of the first EVAL_POOL held-out tasks, so any `eval_tasks(n<=EVAL_POOL)` is disjoint."""
N_TESTS: Final = 6
N_SHOWN: Final = 2
_LETTERS: Final = "abcdeilnorst"


@dataclass(frozen=True, slots=True)
class HiddenTest:
    """One hidden test: `f(*literal_eval(args)) == literal_eval(expected)`; both are Python reprs."""

    args: str
    expected: str


@dataclass(frozen=True, slots=True)
class Task:
    """One coding task: the prompt the policy sees, the tests it is graded on, and a canonical solution.

    The prompt is a Python function header with a docstring (steps and two examples); `solution` is
    the canonical body that continues it, so `prompt + solution` is the reference program.
    """

    task_id: str
    family: str
    level: int
    prompt: str
    entry_point: str
    solution: str
    tests: tuple[HiddenTest, ...]
    test_source: str = ""
    """Hidden tests as Python source, run after `tests` (either may be empty, not both): top-level asserts
    (each one a test), or a `check(candidate)` function, called with the entry point as one test
    (`model/tasks/grading.py` `source_tests`)."""

    def program(self, completion: str) -> str:
        """The code to run for a completion: the prompt (header + docstring) followed by the body.

        A completion whose first non-blank line is its own unindented `def`, `import` or `from` line is run as
        is (an indented `import` is the first line of a body).
        """
        first = completion.lstrip("\r\n")
        if first.startswith(("def ", "import ", "from ")):
            return completion
        return self.prompt + completion

    def verifier_spec(self) -> dict[str, str]:
        """The tests as a flat str -> str map (the `Task` message's `verifier` field); no solution inside.
        A test source goes under "test" (absent when empty, so older readers see the same map)."""
        spec = {"kind": "python_tests", "entry": self.entry_point, "family": self.family, "level": str(self.level),
                "tests": json.dumps([[t.args, t.expected] for t in self.tests])}
        if self.test_source:
            spec["test"] = self.test_source
        return spec

    @classmethod
    def from_spec(cls, task_id: str, prompt: str, spec: dict[str, str]) -> Task:
        """Rebuild a gradable task from a prompt and `verifier_spec()`; the solution is left empty."""
        if spec.get("kind") != "python_tests":
            raise ValueError(f"task {task_id}: verifier kind {spec.get('kind')!r} is not 'python_tests'")
        tests = tuple(HiddenTest(str(a), str(e)) for a, e in json.loads(spec["tests"]))
        return cls(task_id, spec.get("family", ""), int(spec.get("level", "0")), prompt, spec["entry"], "", tests,
                   spec.get("test", ""))

    @property
    def prompt_hash(self) -> str:
        """sha256 of the prompt text (hex, 16 chars): the identity used for train/eval disjointness."""
        return prompt_hash(self.prompt)


def prompt_hash(prompt: str) -> str:
    """First 16 hex digits of sha256(prompt as UTF-8)."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class _Step:
    """One pipeline step: words for the docstring and a statement (or a condition for branches)."""

    words: str
    code: str
    out: Kind


def _int_step(rng: random.Random) -> _Step:
    k = rng.randint(2, 9)
    options: list[tuple[str, str]] = [
        (f"add {k}", f"x = x + {k}"),
        (f"subtract {k}", f"x = x - {k}"),
        (f"multiply by {min(k, 5)}", f"x = x * {min(k, 5)}"),
        (f"floor-divide by {min(k, 5)}", f"x = x // {min(k, 5)}"),
        (f"take it modulo {k}", f"x = x % {k}"),
        ("square it", "x = x * x"),
        ("negate it", "x = -x"),
        ("take the absolute value", "x = abs(x)"),
        (f"raise it to at least {k}", f"x = max(x, {k})"),
        (f"cap it at {k}", f"x = min(x, {k})"),
    ]
    words, code = rng.choice(options)
    return _Step(words, code, "int")


def _str_step(rng: random.Random) -> _Step:
    k = rng.randint(1, 3)
    a, b = rng.sample(_LETTERS, 2)
    w = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 3)))
    options: list[tuple[str, str, Kind]] = [
        ("reverse it", "s = s[::-1]", "str"),
        ("make it upper case", "s = s.upper()", "str"),
        (f"keep the first {k} characters", f"s = s[:{k}]", "str"),
        (f"drop the first {k} characters", f"s = s[{k}:]", "str"),
        (f"keep the last {k} characters", f"s = s[-{k}:]", "str"),
        (f"repeat it {k + 1} times", f"s = s * {k + 1}", "str"),
        (f"replace '{a}' with '{b}'", f"s = s.replace('{a}', '{b}')", "str"),
        (f"append '{w}'", f"s = s + '{w}'", "str"),
        (f"prepend '{w}'", f"s = '{w}' + s", "str"),
        ("take its length", "x = len(s)", "int"),
        (f"count the '{a}' characters", f"x = s.count('{a}')", "int"),
    ]
    words, code, out = rng.choice(options)
    return _Step(words, code, out)


def _list_step(rng: random.Random) -> _Step:
    k = rng.randint(2, 7)
    options: list[tuple[str, str, Kind]] = [
        (f"add {k} to each element", f"xs = [v + {k} for v in xs]", "list"),
        (f"multiply each element by {min(k, 4)}", f"xs = [v * {min(k, 4)} for v in xs]", "list"),
        (f"keep the elements greater than {k}", f"xs = [v for v in xs if v > {k}]", "list"),
        (f"keep the elements less than {k}", f"xs = [v for v in xs if v < {k}]", "list"),
        ("keep the even elements", "xs = [v for v in xs if v % 2 == 0]", "list"),
        ("keep the odd elements", "xs = [v for v in xs if v % 2 == 1]", "list"),
        ("sort it", "xs = sorted(xs)", "list"),
        ("reverse it", "xs = xs[::-1]", "list"),
        (f"keep the first {k - 1} elements", f"xs = xs[:{k - 1}]", "list"),
        ("take the sum", "x = sum(xs)", "int"),
        ("count the elements", "x = len(xs)", "int"),
    ]
    words, code, out = rng.choice(options)
    return _Step(words, code, out)


_STEP: Final[dict[str, Callable[[random.Random], _Step]]] = {"int": _int_step, "str": _str_step, "list": _list_step}


def _inputs(kind: Kind, rng: random.Random) -> list[object]:
    """N_TESTS distinct inputs of a kind: ints in -9..20, lowercase words of 3-6 letters, 3-5 ints in -2..9."""
    seen: list[object] = []
    while len(seen) < N_TESTS:
        value: object
        if kind == "int":
            value = rng.randint(-9, 20)
        elif kind == "str":
            value = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 6)))
        else:
            value = [rng.randint(-2, 9) for _ in range(rng.randint(3, 5))]
        if value not in seen:
            seen.append(value)
    return seen


def _pipeline(kind: Kind, n_steps: int, rng: random.Random) -> tuple[list[str], list[str], Kind]:
    words: list[str] = []
    lines: list[str] = []
    current: Kind = kind
    for _ in range(n_steps):
        step = _STEP[current](rng)
        words.append(step.words)
        lines.append(step.code)
        current = step.out
    return words, lines, current


def _branch(rng: random.Random) -> tuple[str, list[str]]:
    """An if/else over an int: condition words and code, then one int step per arm."""
    k = rng.randint(2, 9)
    cond_words, cond_code = rng.choice(
        [("x is even", "x % 2 == 0"), ("x is odd", "x % 2 == 1"),
         (f"x is greater than {k}", f"x > {k}"), (f"x is less than {k}", f"x < {k}")]
    )
    yes, no = _int_step(rng), _int_step(rng)
    words = f"if {cond_words}, {yes.words}; otherwise {no.words}"
    lines = [f"if {cond_code}:", f"    {yes.code}", "else:", f"    {no.code}"]
    return words, lines


def _render(kind: Kind, words: str, lines: list[str], out: Kind, cases: list[tuple[object, object]]) -> tuple[str, str]:
    """(prompt, solution): the prompt is a header with a docstring; the solution is the body that follows it."""
    shown = "".join(f"\n    f({arg!r}) == {res!r}" for arg, res in cases[:N_SHOWN])
    prompt = f'def f({VAR[kind]}):\n    """{words[0].upper()}{words[1:]}.{shown}"""\n'
    body = "".join(f"    {line}\n" for line in lines)
    return prompt, f"{body}    return {VAR[out]}\n"


def _run_canonical(solution: str, inputs: list[object]) -> list[object]:
    namespace: dict[str, object] = {}
    exec(solution, namespace)  # our own generated code, never a policy's
    fn = namespace["f"]
    assert callable(fn)
    return [fn(value) for value in inputs]


FAMILIES: Final[tuple[tuple[str, Kind, int, float], ...]] = (
    ("int", "int", 1, 0.10),
    ("int", "int", 2, 0.12),
    ("int", "int", 3, 0.06),
    ("str", "str", 1, 0.10),
    ("str", "str", 2, 0.12),
    ("str", "str", 3, 0.06),
    ("list", "list", 1, 0.10),
    ("list", "list", 2, 0.12),
    ("list", "list", 3, 0.06),
    ("branch", "int", 1, 0.16),
)
"""(family, input kind, steps, sampling weight); weights sum to 1."""


def make_task(rng: random.Random, task_id: str) -> Task:
    """One task drawn from FAMILIES with `rng`; redraws until the tests are not a constant function."""
    family, kind, n_steps, _ = rng.choices(FAMILIES, weights=[w for *_, w in FAMILIES])[0]
    while True:
        if family == "branch":
            words, lines = _branch(rng)
            out: Kind = "int"
        else:
            step_words, lines, out = _pipeline(kind, n_steps, rng)
            words = ", then ".join(step_words)
        inputs = _inputs(kind, rng)
        prompt, solution = _render(kind, words, lines, out, [])
        outputs = _run_canonical(prompt + solution, inputs)
        if len({repr(o) for o in outputs}) < 3 or outputs == inputs:
            continue  # constant, near-constant or identity on the tests: no signal
        cases = list(zip(inputs, outputs, strict=True))
        prompt, solution = _render(kind, words, lines, out, cases)
        tests = tuple(HiddenTest(args=repr((arg,)), expected=repr(res)) for arg, res in cases)
        return Task(task_id, family, n_steps, prompt, "f", solution, tests)


def eval_tasks(seed: int, n: int = 200) -> list[Task]:
    """The held-out set: the first `n` distinct-prompt tasks of the eval stream of `seed` (n <= EVAL_POOL)."""
    if not 1 <= n <= EVAL_POOL:
        raise ValueError(f"eval set size {n} must be in 1..{EVAL_POOL}")
    return list(_distinct(_stream(seed, "eval"), n))


def train_tasks(seed: int, *, eval_seed: int | None = None) -> Iterator[Task]:
    """Endless training tasks of `seed`, skipping every prompt hash of the EVAL_POOL held-out tasks.

    The held-out set skipped is that of `eval_seed` (default: `seed`), so a run may draw training
    data from several seeds while keeping one fixed evaluation set.
    """
    held_out_seed = seed if eval_seed is None else eval_seed
    held_out = {t.prompt_hash for t in _distinct(_stream(held_out_seed, "eval"), EVAL_POOL)}
    for task in _stream(seed, "train"):
        if task.prompt_hash not in held_out:
            yield task


def _stream(seed: int, split: str) -> Iterator[Task]:
    index = 0
    while True:
        rng = random.Random(f"rlbus-tasks:{seed}:{split}:{index}")
        yield make_task(rng, f"{split}-{seed}-{index}")
        index += 1


def _distinct(tasks: Iterator[Task], n: int) -> Iterator[Task]:
    seen: set[str] = set()
    for task in tasks:
        if len(seen) == n:
            return
        if task.prompt_hash not in seen:
            seen.add(task.prompt_hash)
            yield task
