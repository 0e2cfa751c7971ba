"""`rlbus tasks demos` as a real command on a real sandbox: rows in the shared SFT layout, only passing episodes
kept, observations that are what the sandbox answers, and tool calls that pass the hidden tests again when re-run
in a fresh session."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from helpers.sandbox_sessions import serving

from rlbus.actors.common.sessions import SandboxSession, SessionPort
from rlbus.messages.bus import Bus
from rlbus.model.env.agentic import AgenticBudgets
from rlbus.model.env.demos import wrong_version
from rlbus.model.env.summaries import SUMMARY_REQUEST
from rlbus.model.tasks.repo import RepoTask, repo_task
from rlbus.model.tools.calls import TOOL_SCHEMAS, ToolCall, outcome_text
from rlbus.model.training.sft import read_conversations
from rlbus.ops.tasks_demos import cut

GOOD = [repo_task(1, 11), repo_task(3, 12)]


def _row(task: RepoTask, solution: dict[str, str]) -> dict[str, Any]:
    return {"task_id": task.task_id, "instruction": task.instruction, "files": task.files,
            "hidden_tests": task.hidden_tests, "solution": solution, "level": task.level}


@pytest.fixture(scope="module")
def demos(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]], Path]:
    """The command run once on a file of two built-in tasks and one whose solution is wrong (a seeded change to
    the fixed function), with a summary mark low enough that some episodes summarise."""
    tmp = tmp_path_factory.mktemp("demos")
    for seed in range(13, 40):                       # the first level-2 task a seeded wrong fix exists for
        bad = repo_task(2, seed)
        path = next(p for p in sorted(bad.solution) if bad.solution[p] != bad.files.get(p))
        wrong = wrong_version(bad.files.get(path, ""), bad.solution[path], random.Random(1))
        if wrong is not None:
            break
    assert wrong is not None
    source = tmp / "tasks.jsonl"
    rows = [_row(GOOD[0], GOOD[0].solution), _row(bad, {**bad.solution, path: wrong}), _row(GOOD[1], GOOD[1].solution)]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp / "demos.jsonl"
    done = subprocess.run([sys.executable, "-m", "rlbus.ops.cli", "tasks", "demos", str(source), "-o", str(out),
                           "--n", "5", "--seed", "2", "--summary-at", "3600", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{bad.task_id} failed" in done.stderr
    return json.loads(done.stdout), [json.loads(line) for line in out.read_text().splitlines()], out


def test_only_passing_episodes_are_kept_in_the_shared_layout(demos: tuple[dict[str, Any], list[dict[str, Any]], Path]
                                                              ) -> None:
    """Two of three episodes pass (the wrong solution fails its hidden tests and is left out); every row
    round-trips through JSON, carries the tool schemas and its task id, its roles follow the chat layout (a user
    task, assistant turns with calls, a tool message per call), `rlbus sft` reads the file, and an episode past the
    summary mark has a summary step and a fresh context."""
    report, rows, out = demos
    assert set(report) == {"demos", "attempted", "pass_rate", "turns_mean"}
    assert (report["demos"], report["attempted"], report["pass_rate"]) == (2, 3, round(2 / 3, 4))
    assert report["turns_mean"] > 3
    assert {r["task_id"] for r in rows} == {t.task_id for t in GOOD}
    assert len(read_conversations(out)) == len(rows)
    for row in rows:
        assert json.loads(json.dumps(row)) == row and row["tools"] == list(TOOL_SCHEMAS)
        messages = row["messages"]
        assert messages[0]["role"] == "user" and messages[1]["role"] == "assistant"
        calls_left = 0
        for m in messages[1:]:
            assert m["role"] in ("user", "assistant", "tool") and isinstance(m["content"], str)
            if m["role"] == "tool":
                assert calls_left > 0 and m["name"]
                calls_left -= 1
                continue
            assert calls_left == 0
            if m["role"] == "assistant" and "tool_calls" in m:
                assert m["content"] and all(c["type"] == "function" and set(c["function"]) == {"name", "arguments"}
                                            and isinstance(c["function"]["arguments"], dict) for c in m["tool_calls"])
                calls_left = sum(c["function"]["name"] != "submit" for c in m["tool_calls"])
    contexts = [r for r in rows if r["meta"]["contexts"] > 1]
    assert contexts, "no episode reached the summary mark"
    first = next(r for r in contexts if r["meta"]["context"] == 0)
    assert first["messages"][-2] == {"role": "user", "content": SUMMARY_REQUEST}
    assert "tool_calls" not in first["messages"][-1] and first["messages"][-1]["content"]
    final = [r for r in rows if r["meta"]["context"] == r["meta"]["contexts"] - 1]
    assert all(r["messages"][-1]["tool_calls"][-1]["function"]["name"] == "submit" for r in final)


@pytest.mark.anyio
async def test_kept_calls_rerun_in_a_fresh_session_reproduce_the_observations_and_pass(
        admin_bus: Bus, demos: tuple[dict[str, Any], list[dict[str, Any]], Path]) -> None:
    """Each kept demonstration's tool calls, run in order in a fresh session on the task's files, answer exactly
    what the rows recorded, and the workspace they leave passes the hidden tests."""
    _, rows, _ = demos
    episodes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: r["meta"]["context"]):
        episodes[row["task_id"]].append(row)
    tasks = {t.task_id: t for t in GOOD}
    run_timeout = AgenticBudgets().run_timeout_s
    async with serving(admin_bus):
        for task_id, contexts in episodes.items():
            task = tasks[task_id]
            files = {p: t.encode() for p, t in task.files.items()}
            async with await SandboxSession.open(admin_bus, "hub", files) as session:
                port = SessionPort(session)
                replayed = 0
                for row in contexts:
                    messages = row["messages"]
                    for k, m in enumerate(messages):
                        for n, c in enumerate(m.get("tool_calls", ())):
                            call = ToolCall(c["function"]["name"], c["function"]["arguments"])
                            if call.name == "submit":
                                continue
                            args = {**call.arguments, **({"timeout_s": run_timeout} if call.name == "run" else {})}
                            text = cut(outcome_text(call, await port.tool(call.name, args)),
                                       AgenticBudgets().observation_chars)
                            assert text == messages[k + 1 + n]["content"], (task_id, call.name)
                            replayed += 1
                assert replayed >= 4
                report = await port.grade_workspace(task)
                assert report.verdict == "passed", (task_id, report.result().feedback[:500])



def test_the_held_out_split_is_never_drawn(tmp_path: Path) -> None:
    """Built-in demonstrations come from the training split's functions only; a file's rows of held-out functions
    are left out (rows naming no function are kept); a `:heldout` source is refused."""
    from rlbus.model.tasks.changes import split_of
    from rlbus.model.tasks.sources import TaskSourceError, held_out_functions
    from rlbus.ops.tasks_demos import training_tasks

    drawn = training_tasks("repo", 3, 60)
    assert len(drawn) == 60 and all(t.function and split_of(t.function) == "train" for t in drawn)
    assert not {t.function for t in drawn} & held_out_functions("repo:heldout")
    train, held = drawn[0], next(iter(sorted(held_out_functions("repo:heldout"))))
    rows = [{**_row(train, train.solution), "function": train.function},
            {**_row(GOOD[0], GOOD[0].solution), "task_id": "held", "function": held},
            {**_row(GOOD[1], GOOD[1].solution), "task_id": "unnamed"}]
    path = tmp_path / "split.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [t.task_id for t in training_tasks(str(path), 0, 10)] == [train.task_id, "unnamed"]
    for source in ("repo:heldout", "repo:2:heldout", f"{path}:heldout"):
        with pytest.raises(TaskSourceError, match="training split only"):
            training_tasks(source, 0, 5)
