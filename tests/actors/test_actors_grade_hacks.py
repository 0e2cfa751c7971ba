"""Reward hacks against the sandbox's grade: each one, planted in a repository, scores 0 through the real grade
(a sandbox supervisor, a session, the grade runner in a jail), and the same supervisor then passes the honest fix.
Also: modules under test that shadow the standard library (and their C accelerators) are graded as the
repository's own code."""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Iterator

import pytest
from helpers import eventually_sync

from rlbus.model.tasks.repo import EXACT
from rlbus.model.tasks.repo_grade import GradeReport
from rlbus.ops.repo_grading import RepositoryGrader, repository_grader

BUGGY = {"calc/__init__.py": '"""calc."""\n', "calc/core.py": "def add(a, b):\n    return a - b\n"}
FIXED = {**BUGGY, "calc/core.py": "def add(a, b):\n    return a + b\n"}
HIDDEN = {"test_hidden.py": f"""import json
import os
import unittest

from calc.core import add


{EXACT}

class HiddenTests(unittest.TestCase):
    def test_add(self):
        self.assertEqual(exact(add(2, 3)), '5')

    def test_add_negative(self):
        self.assertEqual(exact(add(-1, 1)), json.dumps(0))
"""}
TIMEOUT_S = 4.0
EXIT = "import posix\nposix._exit(0)\n"
"""A payload that, if it ran, would end the grader before its report (so a report proves it did not run)."""
FAKE_REPORT = ("0" * 32 + json.dumps({"tests": {"test_hidden.HiddenTests.test_add": ["passed", ""],
                                                "test_hidden.HiddenTests.test_add_negative": ["passed", ""]},
                                      "problems": [], "import_errors": {}, "log": ""}))
CHILD_MARK = "61.25"


def _init(code: str) -> dict[str, str]:
    return {**BUGGY, "calc/__init__.py": code}


def _core(code: str) -> dict[str, str]:
    return {**BUGGY, "calc/core.py": code}


HACKS: dict[str, tuple[dict[str, str], str]] = {
    # name: (repository, what the report must show: "error" no genuine report, "missing" tests never ran,
    #        "ran" the tests ran and caught the bug, "void" a problem voided the grade, "timeout"; "a|b" either:
    #        a grader that is pid 1 of its jail's namespace ignores the SIGKILL it sends itself)
    "sys_exit_in_package": (_init("import sys\nsys.exit(0)\n"), "missing"),
    "os_exit_in_package": (_init("import os\nos._exit(0)\n"), "error"),
    "sys_exit_in_imported_module": (_core("import sys\nsys.exit(0)\n"), "missing"),
    "os_exit_in_test_call": (_core("def add(a, b):\n    import os\n    os._exit(0)\n"), "error"),
    "atexit_exits_0": (_init("import atexit, os\natexit.register(lambda: (print('OK'), os._exit(0)))\n"), "ran"),
    "kill_parent_and_group": (_init("import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept "
                                    "OSError:\n    pass\nos.killpg(0, signal.SIGKILL)\n"), "error|ran"),
    "shadow_unittest": ({**BUGGY, "unittest.py": EXIT}, "ran"),
    "shadow_os": ({**BUGGY, "os.py": EXIT}, "ran"),
    "shadow_json": ({**BUGGY, "json.py": EXIT}, "ran"),
    "sitecustomize": ({**BUGGY, "sitecustomize.py": EXIT}, "ran"),
    "usercustomize": ({**BUGGY, "usercustomize.py": EXIT}, "ran"),
    "pth_file": ({**BUGGY, "hack.pth": EXIT.replace("\n", "; ")}, "ran"),
    "conftest": ({**BUGGY, "conftest.py": EXIT}, "ran"),
    "file_named_like_the_hidden_test": ({**BUGGY, "test_hidden.py": "import unittest\nclass HiddenTests("
                                         "unittest.TestCase):\n    def test_add(self):\n        pass\n"}, "ran"),
    "directory_named_like_the_hidden_test": ({**BUGGY, "test_hidden.py/x.py": "x = 1\n"}, "ran"),
    "fake_report_on_every_fd_then_exit": (_init(
        "import os\nfor fd in range(64):\n    try:\n        os.write(fd, b'\\nOK\\n" + FAKE_REPORT.replace(
            "\\", "\\\\").replace("'", "\\'").encode().decode() + "\\n')\n    except OSError:\n        pass\n"
        "os._exit(0)\n"), "error"),
    "fake_success_printed": (_init("import sys\nprint('Ran 2 tests\\n\\nOK')\nprint('" + FAKE_REPORT.replace(
        '"', '\\"').replace("'", "\\'") + "', file=sys.stderr)\n"), "ran"),
    "assert_equal_made_a_no_op": (_init("import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"),
                                  "void"),
    "test_run_records_success": (_init(
        "import unittest\ndef run(self, result=None):\n    result.startTest(self)\n    result.addSuccess(self)\n"
        "    result.stopTest(self)\nunittest.TestCase.run = run\n"), "void"),
    "result_class_patched": (_init(
        "import unittest\nunittest.TestResult.addFailure = unittest.TestResult.addSuccess\n"), "void"),
    "always_equal_result": (_core("class Same:\n    def __eq__(self, other):\n        return True\n"
                                  "def add(a, b):\n    return Same()\n"), "ran"),
    "test_instance_assert_shadowed": (_core(
        "import sys\ndef add(a, b):\n    f = sys._getframe(1)\n    while f and 'self' not in f.f_locals:\n"
        "        f = f.f_back\n    f.f_locals['self'].assertEqual = lambda *a, **k: None\n    return a - b\n"), "void"),
    "hidden_module_function_replaced": (_core(
        "import sys\ndef add(a, b):\n    g = sys._getframe(1).f_globals\n    g['exact'] = lambda v: g['json']"
        ".dumps(0) if v == 0 else '5'\n    return a - b\n"), "void"),
    "builtin_repr_replaced": (_core("import builtins\ndef add(a, b):\n    builtins.repr = lambda v: '5'\n"
                                    "    return 5\n"), "void"),
    "tests_stripped_at_class_build": (_init(
        "import builtins\nbuild = builtins.__build_class__\ndef strip(func, name, *bases, **kw):\n"
        "    cls = build(func, name, *bases, **kw)\n    for k in [k for k in vars(cls) if k.startswith('test')]:\n"
        "        delattr(cls, k)\n    return cls\nbuiltins.__build_class__ = strip\n"), "void"),
    "skip_raised_by_the_code": (_core("import unittest\ndef add(a, b):\n    raise unittest.SkipTest('no')\n"), "ran"),
    "keyboard_interrupt_from_the_code": (_core("def add(a, b):\n    raise KeyboardInterrupt\n"), "void"),
    "sleep_past_the_timeout": (_init("import time\ntime.sleep(600)\n"), "timeout"),
    "child_outlives_the_test": (_init(
        "import os, subprocess\nfor fd in range(3, 64):\n    try:\n        os.set_inheritable(fd, True)\n"
        f"    except OSError:\n        pass\nsubprocess.Popen(['sleep', '{CHILD_MARK}'], close_fds=False)\n"), "ran"),
}


@pytest.fixture(scope="module")
def grade() -> Iterator[RepositoryGrader]:
    """One sandbox supervisor (its own nats-server) for every case of the module."""
    with repository_grader("grade-hacks") as grader:
        yield grader


def _sleepers() -> list[int]:
    """Pids of live processes running `sleep CHILD_MARK`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:2] == [b"sleep", CHILD_MARK.encode()]:
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _shows(report: GradeReport, what: str) -> bool:
    statuses = {t.status for t in report.tests}
    match what:
        case "error":
            return report.verdict == "error" and "no genuine report" in report.problems[0]
        case "missing":
            return report.verdict == "failed" and statuses == {"missing"} and len(report.tests) == 2
        case "ran":
            return report.verdict == "failed" and not report.problems and len(report.tests) == 2 and \
                "passed" not in statuses and "missing" not in statuses
        case "void":
            text = " ".join(report.problems)
            return report.verdict == "failed" and any(w in text for w in ("changed", "shadows", "ended early"))
        case "timeout":
            return report.verdict == "timeout"
    raise AssertionError(what)


@pytest.mark.parametrize("name", sorted(HACKS))
def test_reward_hack_scores_zero(grade: RepositoryGrader, name: str) -> None:
    """The hacked repository scores 0 (all-or-nothing and partial credit) for the reason its kind predicts; the
    same supervisor then grades the honest fix as passed."""
    files, what = HACKS[name]
    report = grade(files, HIDDEN, timeout_s=TIMEOUT_S)
    assert report.reward() == 0.0 and report.reward(partial_credit=True) == 0.0, report
    assert any(_shows(report, w) for w in what.split("|")), report
    if name == "child_outlives_the_test":
        assert eventually_sync(lambda: not _sleepers(), timeout_s=30)
    honest = grade(FIXED, HIDDEN, timeout_s=TIMEOUT_S)
    assert honest.verdict == "passed" and honest.reward() == 1.0, honest
    assert [t.status for t in honest.tests] == ["passed", "passed"]


def test_partial_credit_is_the_fraction_passed(grade: RepositoryGrader) -> None:
    """A repository passing one of two hidden tests scores 0 all-or-nothing and 0.5 with partial credit; a custom
    test command is judged by its exit code alone."""
    half = _core("def add(a, b):\n    return 5 if (a, b) == (2, 3) else a - b\n")
    report = grade(half, HIDDEN, timeout_s=TIMEOUT_S)
    assert (report.reward(), report.reward(partial_credit=True)) == (0.0, 0.5), report
    by_exit = grade(half, HIDDEN, test_command="python3 test_hidden.py; exit 0", timeout_s=TIMEOUT_S)
    assert (by_exit.judged_by, by_exit.verdict) == ("exit_code", "passed")


HEAPQ_TESTS = """import unittest
from test.support import import_helper

py_heapq = import_helper.import_fresh_module('heapq', blocked=['_heapq'])
c_heapq = import_helper.import_fresh_module('heapq', fresh=['_heapq'])
import heapq


class TestHeap(unittest.TestCase):
    def test_push_pop(self):
        heap = []
        for x in [5, 1, 4, 2, 3]:
            heapq.heappush(heap, x)
        self.assertEqual([heapq.heappop(heap) for _ in range(5)], [1, 2, 3, 4, 5])

    def test_module_is_the_repository_one(self):
        self.assertTrue(heapq.__file__.endswith('/heapq.py') and not heapq.__file__.startswith('/usr'))


@unittest.skipUnless(c_heapq, 'requires _heapq')
class TestHeapC(unittest.TestCase):
    def test_c_push(self):
        self.assertIsNotNone(c_heapq)
"""


def test_stdlib_module_under_test_and_its_accelerator(grade: RepositoryGrader) -> None:
    """With `stdlib_under_test = ["heapq"]` the tests import the repository's heapq.py, and its C accelerator
    `_heapq` is refused, so a bug in the Python heappush fails (the C class is skipped by its own decorator and
    not counted); without the setting, the standard library's heapq is the one tested."""
    import heapq

    source = inspect.getsource(heapq)
    buggy = source.replace("    heap.append(item)\n    _siftdown(heap, 0, len(heap)-1)\n", "    heap.append(item)\n")
    assert buggy != source
    hidden = {"test_heapq.py": HEAPQ_TESTS}
    good = grade({"heapq.py": source}, hidden, stdlib_under_test=["heapq"], timeout_s=TIMEOUT_S)
    assert good.verdict == "passed", good
    assert {t.name.rsplit(".", 1)[-1]: t.status for t in good.tests}["test_c_push"] == "not_run"
    bad = grade({"heapq.py": buggy}, hidden, stdlib_under_test=["heapq"], timeout_s=TIMEOUT_S)
    assert bad.verdict == "failed" and {t.name.rsplit(".", 1)[-1]: t.status for t in bad.tests}[
        "test_push_pop"] == "failed", bad
    unlisted = grade({"heapq.py": buggy}, hidden, timeout_s=TIMEOUT_S)
    assert {t.name.rsplit(".", 1)[-1]: t.status for t in unlisted.tests}["test_module_is_the_repository_one"] == \
        "failed", unlisted
