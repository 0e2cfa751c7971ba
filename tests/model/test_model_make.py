"""Tasks made from standard-library modules (model/tasks/make.py), apart from grading: the module and its
CPython test file as read, adapted and seeded, tests set aside by decorator, fail-to-pass lists, failure messages
without the changed lines, the instruction's wording and the row a repository task file accepts."""

from __future__ import annotations

import ast
import itertools
import types
import unittest

import pytest

from rlbus.model.tasks.make import (
    LEVEL_OF_KIND,
    SEED_LINES,
    SKIP_REASON,
    MakeError,
    StdlibModule,
    fail_to_pass,
    failure_message,
    instruction,
    module_seed,
    quotas,
    seeded,
    skip_tests,
    stdlib_module,
    task_id,
    task_row,
)
from rlbus.model.tasks.mutators import KINDS, Mutation, mutations
from rlbus.model.tasks.repo_grade import GradeReport, TestReport
from rlbus.model.tasks.sources import repo_task_from_row

TESTS = '''\
import unittest


class T(unittest.TestCase):
    def test_ok(self):
        pass

    @unittest.expectedFailure
    def test_decorated(self):
        raise AssertionError

    def test_other(self):
        self.fail("no")
'''
TRACEBACK = '''Traceback (most recent call last):
  File "/w/test_textwrap.py", line 12, in test_wrap
    self.assertEqual(wrap(text, 5), expected)
  File "/w/textwrap.py", line 40, in wrap
    if len(chunks[-1]) <= width:
                       ^^^^^^^^
AssertionError: Lists differ: ['a'] != ['a', 'b']
Second list contains 1 additional elements.
'''


def _module(tests: str = TESTS) -> StdlibModule:
    return StdlibModule("mod", "mod.py", "def f():\n    return 1\n", "test_mod.py", tests)


def test_the_default_modules_and_their_tests_are_read_and_adapted() -> None:
    """Each default module is its one source file and CPython's test file for it; shlex's test no longer imports
    unittest.mock and heapq's imports heapq first; the adapted test files still parse."""
    for name in ("textwrap", "fractions", "statistics", "shlex", "heapq", "calendar"):
        module = stdlib_module(name)
        assert (module.path, module.test_path) == (f"{name}.py", f"test_{name}.py")
        assert f"import {name}" in module.tests or f"from {name} import" in module.tests
        compile(module.tests, module.test_path, "exec")
        compile(module.source, module.path, "exec")
    assert "mock" not in stdlib_module("shlex").tests.split("class ShlexTest")[0]
    assert stdlib_module("heapq").tests.count("import heapq\n") == 1
    heapq_tests = stdlib_module("heapq").tests
    assert heapq_tests.index(SEED_LINES) < heapq_tests.index("import random\nimport unittest")
    assert seeded('"""Doc."""\nfrom __future__ import annotations\nimport os\n') == (
        '"""Doc."""\nfrom __future__ import annotations\n' + SEED_LINES + "import os\n")
    assert seeded("x = 1\n") == SEED_LINES + "x = 1\n"
    with pytest.raises(MakeError, match="not a single Python source file"):
        stdlib_module("json")                                      # a package
    with pytest.raises(MakeError, match=r"Lib/test/test_this\.py is not installed"):
        stdlib_module("this")


def test_set_aside_tests_are_skipped_by_decorator() -> None:
    """The tests named are decorated `unittest.skip(SKIP_REASON)` above their other decorators; the others run;
    an id that is not a test method, or a file without `import unittest`, is refused."""
    module = skip_tests(_module(), ["test_mod.T.test_other", "test_mod.T.test_decorated"])
    namespace = types.ModuleType("test_mod")
    exec(compile(module.tests, "test_mod.py", "exec"), namespace.__dict__)
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromModule(namespace).run(result)
    assert (result.testsRun, len(result.skipped), result.failures, result.errors) == (3, 2, [], [])
    assert {reason for _, reason in result.skipped} == {SKIP_REASON}
    assert module.tests.count(f"    @unittest.skip({SKIP_REASON!r})\n    @unittest.expectedFailure\n") == 1
    assert skip_tests(_module(), []) == _module()
    with pytest.raises(MakeError, match="'merge' fails on the unmodified module"):
        skip_tests(_module(), ["merge"])
    with pytest.raises(MakeError, match="no top-level `import unittest`"):
        skip_tests(_module(TESTS.replace("import unittest\n", "from unittest import TestCase as _T\nunittest = 1\n")),
                   ["test_mod.T.test_ok"])


def test_fail_to_pass_counts_only_tests_that_passed_on_the_original() -> None:
    original = GradeReport(verdict="failed", tests=(TestReport("a", "passed"), TestReport("b", "failed"),
                                                     TestReport("c", "passed"), TestReport("d", "passed")))
    changed = GradeReport(verdict="failed", tests=(TestReport("a", "error"), TestReport("b", "failed"),
                                                    TestReport("c", "passed"), TestReport("d", "missing")))
    assert fail_to_pass(original, changed) == ["a", "d"]
    assert fail_to_pass(original, original) == []


def test_a_failure_message_leaves_out_the_frames() -> None:
    """Only the exception and its message: never a source line of a frame (it would show the change), also
    when the detail starts part-way through a traceback or holds several (subtests)."""
    message = failure_message(TRACEBACK)
    assert message == "AssertionError: Lists differ: ['a'] != ['a', 'b']\nSecond list contains 1 additional elements."
    cut = failure_message(TRACEBACK[TRACEBACK.index("qual(wrap"):])
    assert cut == message and "<=" not in cut
    two = failure_message(TRACEBACK + "\n" + TRACEBACK.replace("Lists differ", "Other"))
    assert two == message
    assert failure_message("x" * 2000 + "\nValueError: " + "y" * 900, max_chars=100).endswith("y ...")
    doctest = ('ple.source, filename, "single",\n      File "<doctest merge[1]>", line 1, in <module>\n'
               '        list(merge([1], [2]))\n      File "/workspace/heapq.py", line 261, in _siftup\n'
               '        endpos = len(heap)\n                 ^^^^^^^^^\n    TypeError: object has no len()\n\n')
    assert failure_message(doctest) == "TypeError: object has no len()"
    assert failure_message("cut line\n  File \"t.py\", line 3, in test\n    x <= y\n") == ""
    tail = "ists differ: [...]\n-  'eed-good-',\n+  'indeed-',\n : expected:\n  0: 'indeed-'\nbut got:\n  0: 'eed'\n"
    assert failure_message(tail) == "-  'eed-good-',\n+  'indeed-',\n : expected:\n  0: 'indeed-'\nbut got:\n  0: 'eed'"
    assert failure_message(TRACEBACK.replace("['a', 'b']", "<object at 0x7f3a2c1d9e80>")).startswith(
        "AssertionError: Lists differ: ['a'] != <object at 0x...>\n")


def _mutation(kind: str, function: str = "TextWrapper.wrap") -> Mutation:
    return Mutation("textwrap.py", function, kind, 40, "`<=` became `<`", "changed text\n")


def test_the_instruction_names_the_function_and_what_fails_never_the_change() -> None:
    module = stdlib_module("textwrap")
    failing = [TestReport(f"test_textwrap.W.test_{i}", "failed", TRACEBACK) for i in range(5)]
    text = instruction(module, _mutation("compare"), failing)
    assert text.startswith("The method `TextWrapper.wrap` in `textwrap.py` (the standard library's `textwrap` "
                           "module) behaves incorrectly.")
    assert "5 tests of the module's test suite fail:" in text and "- ... and 2 more" in text
    assert "`test_textwrap.W.test_2`" in text and "`test_textwrap.W.test_3`" not in text
    assert "AssertionError: Lists differ" in text
    assert "<=" not in text and "line 40" not in text and "became" not in text
    one = instruction(module, _mutation("variable", "wrap"), failing[:1])
    assert "The function `wrap`" in one and "1 test of the module's test suite fails:" in one and "It fails with" in one
    deletion = instruction(module, _mutation("deletion", "dedent"), failing[:2])
    assert deletion.startswith("Implement the function `dedent` in `textwrap.py`")
    assert "raises NotImplementedError" in deletion and "its docstring" in deletion
    assert "2 tests of the module's test suite exercise it" in deletion


def test_a_row_is_a_repository_task_the_file_format_accepts() -> None:
    """The row of a real change of textwrap: the changed file as the repository, the original as the solution,
    CPython's tests hidden, textwrap under test, level by kind, tags, the changed function's qualified name (what
    the splits go by) and fail-to-pass ids."""
    module = stdlib_module("textwrap")
    change = next(m for m in mutations({module.path: module.source}, 3) if m.kind == "compare")
    failing = [TestReport("test_textwrap.WrapTestCase.test_simple", "failed", TRACEBACK)]
    row = task_row(module, change, failing)
    task = repo_task_from_row(row)
    assert task.files == {"textwrap.py": change.text} and task.solution == {"textwrap.py": module.source}
    assert task.hidden_tests == {"test_textwrap.py": module.tests} and task.stdlib_under_test == ("textwrap",)
    assert (task.level, task.tags) == (1, ("textwrap", "compare"))
    assert task.function == row["function"] == f"textwrap.{change.function}"
    assert row["fail_to_pass"] == ["test_textwrap.WrapTestCase.test_simple"]
    assert task.task_id == task_id(module, change) and task.task_id.startswith("stdlib-textwrap-compare-")
    assert task.task_id != task_id(module, next(m for m in mutations({module.path: module.source}, 4)
                                                if m.text != change.text))
    with pytest.raises(ValueError, match="fail_to_pass"):
        repo_task_from_row({**row, "fail_to_pass": "test_simple"})


def test_levels_quotas_and_seeds() -> None:
    assert set(LEVEL_OF_KIND) == set(KINDS)
    assert {k for k, v in LEVEL_OF_KIND.items() if v == 3} == {"deletion"}
    assert quotas(200, ["a", "b", "c"]) == {"a": 67, "b": 67, "c": 66}
    assert sum(quotas(7, ["a", "b", "c", "d", "e", "f"]).values()) == 7
    assert module_seed(1, "textwrap") == module_seed(1, "textwrap") != module_seed(1, "shlex")
    assert module_seed(1, "textwrap") != module_seed(2, "textwrap")


def test_kinds_reach_every_default_module() -> None:
    """The first changes of each default module use several kinds and all parse."""
    for name in ("shlex", "heapq"):
        module = stdlib_module(name)
        first = list(itertools.islice(mutations({module.path: module.source}, module_seed(1, name)), 20))
        assert len({m.kind for m in first}) >= 6
        for m in first:
            ast.parse(m.text)
