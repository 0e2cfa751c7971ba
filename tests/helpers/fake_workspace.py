"""A `WorkspacePort` over an in-memory dict of files, for the agentic environment's tests: the file tools on the
dict, `run` answering 10,000 characters, grading by whether the files equal the task's reference solution."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rlbus.model.env import ToolCall, ToolOutcome
from rlbus.model.tasks.repo import EditError, RepoTask, apply_edit
from rlbus.model.tasks.repo_grade import GradeReport, TestReport


class FakeWorkspace:
    """The file tools on a dict; grading says whether the files equal the task's reference solution."""

    def __init__(self, task: RepoTask) -> None:
        self.files = dict(task.files)
        self.solution = task.solution
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.graded: list[RepoTask] = []

    async def tool(self, name: str, args: Mapping[str, Any]) -> ToolOutcome:
        self.calls.append((name, dict(args)))
        match name:
            case "list_files":
                return ToolOutcome(output="\n".join(sorted(p for p in self.files if p.startswith(
                    "" if args["path"] == "." else args["path"]))))
            case "read_file":
                if args["path"] not in self.files:
                    return ToolOutcome(error=f"no such file: {args['path']}")
                return ToolOutcome(output=self.files[args["path"]])
            case "write_file" | "edit_file":
                try:
                    self.files = apply_edit(self.files, ToolCall(name, dict(args)))
                except EditError as err:
                    return ToolOutcome(error=str(err))
                return ToolOutcome(output="ok")
            case "search":
                return ToolOutcome(output="\n".join(f"{p}:{i}:{line}" for p, text in sorted(self.files.items())
                                                    for i, line in enumerate(text.splitlines(), 1)
                                                    if re.search(args["pattern"], line)))
            case "run":
                return ToolOutcome(output="x" * 10_000, exit_code=0)
        raise AssertionError(f"the environment passed an unchecked tool {name}")

    async def grade_workspace(self, task: RepoTask) -> GradeReport:
        self.graded.append(task)
        ok = self.files == self.solution
        return GradeReport(verdict="passed" if ok else "failed", tests=(
            TestReport("test_hidden.HiddenTests.test_fixed", "passed" if ok else "failed"),
            TestReport("test_hidden.HiddenTests.test_kept", "passed")))
