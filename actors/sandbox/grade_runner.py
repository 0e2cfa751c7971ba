"""The grader inside a grading jail: runs a task's hidden unittest files and reports each test.

- Owns: the jail's side of a grade (`main`; actors/sandbox/tools.py `grade` starts it as `python -I -c <this
  file's text> SPEC` in a fresh copy of the workspace, so nothing of it lives in the copy).
- Guarantee: the nonce is never in the environment, the argv or a file the tested code can still read; a
  framework changed by workspace or test code voids the grade.
- Does not: decide the verdict (the supervisor checks the nonce, the names of the tests and the problems:
  actors/sandbox/tools.py), run a custom test command, or stop code that reads this process's memory.
"""

import builtins
import importlib.abc
import importlib.util
import json
import os
import sys
import tempfile
import traceback
import types
import unittest

DETAIL_CHARS = 2000
REPORT_DETAIL_CHARS = 24000
"""What the failures of all tests may say together (the report fits the jail's output cap)."""


class _Record(unittest.TestResult):
    """Every outcome the framework reports, by test id."""

    def __init__(self, check):
        super().__init__()
        self.outcomes = {}
        self.check = check

    def _put(self, test, status, err=None):
        detail = "" if err is None else err if isinstance(err, str) else self._exc_info_to_string(err, test)
        self.outcomes.setdefault(test.id(), []).append((status, detail[-DETAIL_CHARS:]))

    def addSuccess(self, test):
        self._put(test, "passed")

    def addFailure(self, test, err):
        self._put(test, "failed", err)

    def addError(self, test, err):
        self._put(test, "error", err)

    def addSkip(self, test, reason):
        self._put(test, "skipped", str(reason))

    def addExpectedFailure(self, test, err):
        self._put(test, "passed")

    def addUnexpectedSuccess(self, test):
        self._put(test, "failed", "unexpected success of a test marked expectedFailure")

    def addSubTest(self, test, subtest, err):
        if err is not None:
            self._put(test, "failed", err)

    def stopTest(self, test):
        super().stopTest(test)
        self.check(f"after {test.id()}", test)


class _Shadow(importlib.abc.MetaPathFinder):
    """Imports the modules under test from the repository and refuses their C accelerators."""

    def __init__(self, root, names):
        self.root, self.names = root, set(names)
        self.blocked = {f"_{n}" for n in names if not _source_of(root, f"_{n}")}

    def find_spec(self, name, path=None, target=None):
        if name in self.blocked:
            raise ImportError(f"{name} is refused while grading the repository's {name[1:]}", name=name)
        if name in self.names or (name.startswith("_") and name[1:] in self.names):
            found = _source_of(self.root, name)
            if found is None:
                return None
            where, package = found
            locations = [os.path.dirname(where)] if package else None
            return importlib.util.spec_from_file_location(name, where, submodule_search_locations=locations)
        return None


def _source_of(root, name):
    package = os.path.join(root, name, "__init__.py")
    if os.path.isfile(package):
        return package, True
    module = os.path.join(root, f"{name}.py")
    return (module, False) if os.path.isfile(module) else None


def _framework(record_class):
    """Every object the verdict depends on, by a stable key (compared by identity)."""
    out = {}
    modules = [m for n, m in sorted(sys.modules.items()) if n == "unittest" or n.startswith("unittest.")]
    for mod in modules:
        for key, value in vars(mod).items():
            out[(mod.__name__, key)] = value
            if isinstance(value, type) and value.__module__.startswith("unittest"):
                for k, v in vars(value).items():
                    out[(mod.__name__, key, k)] = v
    for k, v in vars(record_class).items():
        out[("record", k)] = v
    for k, v in vars(builtins).items():
        if k != "_":
            out[("builtins", k)] = v
    out[("sys", "modules.unittest")] = sys.modules.get("unittest")
    out[("sys", "trace")] = sys.gettrace()
    out[("sys", "profile")] = sys.getprofile()
    out[("sys", "excepthook")] = sys.excepthook
    for i, finder in enumerate(sys.meta_path):
        out[("sys", "meta_path", i)] = finder
    out[("os", "_exit")] = os._exit
    out[("os", "write")] = os.write
    out[("json", "dumps")] = json.dumps
    return out


def _differences(before, after):
    changed = [k for k in before if k not in after or after[k] is not before[k]]
    added = [k for k in after if k not in before]
    return [".".join(map(str, k)) for k in changed + added]


def _classes_of(module):
    return [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, unittest.TestCase)]


def _methods(cls):
    """The callables of a test class and its bases below TestCase, by (class, name)."""
    out = {}
    for klass in cls.__mro__:
        if klass.__module__.startswith("unittest") or klass is object:
            continue
        for k, v in vars(klass).items():
            if callable(v) or isinstance(v, (staticmethod, classmethod, property)):
                out[(klass.__qualname__, k)] = v
    return out


def _flatten(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _flatten(item)
        else:
            yield item


def main():
    """Grade the hidden tests of the spec file named by argv[1]. In order:

    - reads the spec `{"nonce", "tests": {path: source}, "stdlib_under_test": [...]}` from the file SPEC and
      deletes it, then points fds 1 and 2 at an unlinked temporary file (what the tests print) and keeps a
      private duplicate of the old fd 1 for the report; nothing of the workspace has run yet;
    - copies the framework (every attribute of unittest's classes and modules, this file's result class,
      builtins, the import machinery, trace and profile hooks) before any workspace or test code is
      imported, and each hidden test module's functions and its test classes' methods once it is imported;
    - puts the repository root on the path after the standard library (before site-packages); a module named
      in `stdlib_under_test` is imported from the repository instead of the standard library, and its C
      accelerator (`_heapq` for `heapq`) is refused unless the repository ships one, so the tests exercise
      the repository's code;
    - compiles each hidden test from the spec's text (never a `.pyc` or the copy's file), collects its tests
      with the framework's loader and runs them; after the imports and after each test the framework is
      compared with the copies, and the test instance must not shadow a framework method; any difference
      voids the grade;
    - writes one line `<nonce><json>` to the private fd and ends with `os._exit(0)` (no atexit handler runs).
    """
    spec_path = sys.argv[1]
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    os.unlink(spec_path)
    del sys.argv[1:]
    nonce = spec.pop("nonce")
    report_fd = os.dup(1)
    log = tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.dont_write_bytecode = True
    root = os.getcwd()
    problems = []
    framework_names = dir(unittest.TestCase)

    def check(when, test=None):
        diff = _differences(before, _framework(_Record))
        if diff:
            problems.append(f"{when}: the test framework changed ({', '.join(diff[:5])})")
        for cls, methods in classes.items():
            now = _methods(cls)
            moved = [f"{a}.{b}" for (a, b), v in methods.items() if now.get((a, b)) is not v]
            moved += [f"{a}.{b}" for (a, b) in now if (a, b) not in methods and b in framework_names]
            if moved:
                problems.append(f"{when}: test class methods changed ({', '.join(moved[:5])})")
        for module, functions in module_functions.items():
            moved = [k for k, v in functions.items() if vars(module).get(k) is not v]
            if moved:
                problems.append(f"{when}: functions of {module.__name__} changed ({', '.join(moved[:5])})")
        if test is not None:
            shadowed = [k for k in vars(test) if k in framework_names and callable(getattr(unittest.TestCase, k))]
            if shadowed:
                problems.append(f"{when}: the test instance shadows {', '.join(shadowed[:5])}")

    shadow = _Shadow(root, spec["stdlib_under_test"])
    for name in list(sys.modules):
        top = name.split(".")[0]
        if top in shadow.names or top in shadow.blocked or top.lstrip("_") in shadow.names:
            del sys.modules[name]
    sys.meta_path.insert(0, shadow)
    site = [i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))]
    sys.path.insert(site[0] if site else len(sys.path), root)
    loader = unittest.TestLoader()
    before = _framework(_Record)
    classes = {}
    module_functions = {}
    record = _Record(check)
    import_errors = {}
    tests = []
    for path, source in sorted(spec["tests"].items()):
        name = path[:-3].replace("/", ".")
        module = types.ModuleType(name)
        module.__file__ = os.path.join(root, path)
        sys.modules[name] = module
        try:
            exec(compile(source, module.__file__, "exec"), module.__dict__)
        except BaseException:                     # SystemExit and KeyboardInterrupt at import are failures too
            import_errors[path] = traceback.format_exc()[-DETAIL_CHARS:]
            continue
        module_functions[module] = {k: v for k, v in vars(module).items() if isinstance(v, types.FunctionType)}
        for cls in _classes_of(module):
            classes.setdefault(cls, _methods(cls))
        tests += list(_flatten(loader.loadTestsFromModule(module)))
    check("after the imports")
    for test in tests:
        method = getattr(test, getattr(test, "_testMethodName", ""), None)
        if getattr(type(test), "__unittest_skip__", False) or getattr(method, "__unittest_skip__", False):
            record.outcomes[test.id()] = [("not_run", "skipped by the tests' own decorator")]
    try:
        unittest.TestSuite(tests).run(record)
    except BaseException:
        problems.append(f"the run ended early: {traceback.format_exc()[-DETAIL_CHARS:]}")
    check("after the run")
    out = {"tests": {}, "problems": problems, "import_errors": import_errors}
    budget = max(200, REPORT_DETAIL_CHARS // max(1, len(tests)))
    for test in tests:
        got = record.outcomes.get(test.id(), [])
        statuses = {status for status, _ in got}
        if statuses == {"not_run"} or statuses == {"not_run", "skipped"}:
            status = "not_run"
        elif statuses == {"passed"} and len(got) == 1:
            status = "passed"
        elif not got:
            status = "missing"
        else:
            status = next((s for s in ("error", "failed", "skipped") if s in statuses), "failed")
        details = "\n".join(d for _, d in got if d)
        out["tests"][test.id()] = [status, "" if status == "passed" else details[-budget:]]
    log.seek(0, 2)
    size = log.tell()
    log.seek(max(0, size - DETAIL_CHARS))
    out["log"] = log.read().decode("utf-8", "replace")
    data = ("\n" + nonce + json.dumps(out) + "\n").encode()
    while data:
        data = data[os.write(report_fd, data):]
    os._exit(0)


main()
