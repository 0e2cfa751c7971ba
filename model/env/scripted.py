"""Scripted policies for the agentic environment: fixed turns instead of sampled ones, for tests and harness runs.

Owns: `reference_script` (the task's reference edit, one call a turn, then `submit`), `edits_script` (turns that
change the workspace in every way a tool can, the reference edit, a listing of every file's digest, `submit`),
`SUBMIT_SCRIPT` (submit at once) and `scripted_ids` (the ids of a script's next turn for a state, ending with the tokenizer's stop,
as a sampled turn that closed itself would; a script is written in Hermes calls, and a turn of one call is
rewritten in the call style of a chat template that renders tools, model/tools/template.py).
Does not own: sampling (model/sampling/generate.py) or the environment (model/env/agentic.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from rlbus.model.env.agentic import AgenticState
from rlbus.model.policies.interface import ChatTokenizer
from rlbus.model.tasks.repo import RepoTask, repo_task_of_id
from rlbus.model.tools.calls import ToolCall, parse_turn
from rlbus.model.tools.template import TemplateTools

SUBMIT: Final = ToolCall("submit", {}).text()
SUBMIT_SCRIPT: Final = (SUBMIT,)
"""Submits the repository as given: the hidden tests fail on it (reward 0)."""


def reference_script(task: RepoTask) -> tuple[str, ...]:
    """One turn per call of the task's reference edit, then a submit turn (reward 1). A task rebuilt from its
    verifier spec carries no reference: it is regenerated from the task's id.

    :raises ValueError: the task has no reference and its id names no built-in task.
    """
    reference = task.reference or repo_task_of_id(task.task_id).reference
    return (*(f"I will change {c.arguments['path']}.\n{c.text()}" for c in reference), SUBMIT)


def edits_script(task: RepoTask) -> tuple[str, ...]:
    """Turns that each change the workspace in another way (a new file, a `run` that deletes a task file and
    writes a new folder, an edit of the new file), the reference edit, a `run` that lists every file's sha256
    (what the workspace holds, in the episode's own tokens), then submit (reward 1): a harness script for resumes.

    :raises ValueError: as `reference_script`.
    """
    *reference, submit = reference_script(task)
    return (ToolCall("write_file", {"path": "notes/plan.md", "content": "plan: edit, then submit\n"}).text(),
            ToolCall("run", {"command": "rm README.md && mkdir -p notes/more && echo more > notes/more/b.txt"}).text(),
            ToolCall("edit_file", {"path": "notes/plan.md", "old": "plan:", "new": "done:"}).text(),
            *reference,
            ToolCall("run", {"command": "find . -type f | sort | xargs sha256sum"}).text(),
            submit)


def scripted_ids(script: Sequence[str], state: AgenticState, tokenizer: ChatTokenizer) -> list[int]:
    """The ids of the script's turn for `state` (turn `state.policy_turns`; the last one once it runs out),
    closed by the tokenizer's stop id. For a template of another call style (`TemplateTools.style`), a turn
    of one call is that call alone in that style."""
    if not script:
        raise ValueError("a script needs at least one turn")
    text = script[min(state.policy_turns, len(script) - 1)]
    if isinstance(tokenizer, TemplateTools) and tokenizer.style != "hermes":
        calls = parse_turn(text)
        if len(calls) == 1 and isinstance(calls[0], ToolCall):
            text = calls[0].text(tokenizer.style)
    return [*tokenizer.encode(text), tokenizer.stop_id]
