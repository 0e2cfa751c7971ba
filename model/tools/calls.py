"""The tools of the agentic coding environment and their text format: specs, schemas, parsing, rendering.

- Owns: `TOOLS` (the fixed names and arguments the sandbox implements), `TOOL_SCHEMAS` (the same in the OpenAI
  function format), `ToolCall`, `ToolOutcome`, `parse_turn` (a policy turn's text -> its tool calls, in a
  `CallStyle`), `check_call`, and the text of the tool list, a call and a tool response (`tools_text`,
  `response_text`, `outcome_text`).
- Does not: run tools (the sandbox, through `WorkspacePort`), hold budgets (model/env/agentic.py) or decide
  how a chat template frames the schemas and results (model/tools/template.py).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final, Literal

import msgspec

ToolName = Literal["list_files", "read_file", "write_file", "edit_file", "search", "run", "submit"]
CallStyle = Literal["hermes", "llama"]
"""How a policy writes a tool call: Hermes `<tool_call>` blocks (Qwen2.5, Qwen3) or a Llama-3.1 JSON turn."""
CALL_OPEN: Final = "<tool_call>"
CALL_CLOSE: Final = "</tool_call>"
RESPONSE_OPEN: Final = "<tool_response>"
RESPONSE_CLOSE: Final = "</tool_response>"
PYTHON_TAG: Final = "<|python_tag|>"
_CALL: Final = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)

_STR: Final = {"type": "string"}
_INT: Final = {"type": "integer"}
_NUMBER: Final = {"type": "number"}
TOOLS: Final[dict[str, dict[str, Any]]] = {
    "list_files": {"description": "List the files under a directory of the repository, one path a line.",
                   "properties": {"path": _STR}, "required": [], "defaults": {"path": "."}},
    "read_file": {"description": "Read a file, with line numbers; optionally only lines start_line..end_line "
                                 "(1-based, inclusive).",
                  "properties": {"path": _STR, "start_line": _INT, "end_line": _INT}, "required": ["path"]},
    "write_file": {"description": "Create or overwrite a file with the given content.",
                   "properties": {"path": _STR, "content": _STR}, "required": ["path", "content"]},
    "edit_file": {"description": "Replace the exact text `old`, which must occur exactly once in the file, "
                                 "by `new`.",
                  "properties": {"path": _STR, "old": _STR, "new": _STR}, "required": ["path", "old", "new"]},
    "search": {"description": "Search the files under a path for a regular expression (grep); matching lines "
                              "as path:line:text.",
               "properties": {"pattern": _STR, "path": _STR}, "required": ["pattern"], "defaults": {"path": "."}},
    "run": {"description": "Run a shell command in the repository's directory; its exit code and output.",
            "properties": {"command": _STR, "timeout_s": _NUMBER}, "required": ["command"]},
    "submit": {"description": "Submit the repository as it is now; the hidden tests run and the episode ends.",
               "properties": {}, "required": []},
}
"""Each tool: its description, its arguments (JSON types) and the required ones; `defaults` fill the rest."""
TOOL_SCHEMAS: Final[tuple[dict[str, Any], ...]] = tuple(
    {"type": "function", "function": {
        "name": name, "description": spec["description"],
        "parameters": {"type": "object", "properties": spec["properties"], "required": spec["required"]}}}
    for name, spec in TOOLS.items())
"""`TOOLS` as JSON schemas in the OpenAI function format (`apply_chat_template(messages, tools=TOOL_SCHEMAS)`)."""


class ToolCall(msgspec.Struct, frozen=True):
    """One tool call: a name of `TOOLS` and its arguments (checked, defaults filled: `check_call`)."""

    name: str
    arguments: dict[str, Any] = {}

    def text(self, style: CallStyle = "hermes") -> str:
        """The call as the policy writes it: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
        (hermes) or `{"name": ..., "parameters": {...}}` (llama)."""
        if style == "llama":
            return json.dumps({"name": self.name, "parameters": self.arguments}, ensure_ascii=False)
        body = json.dumps({"name": self.name, "arguments": self.arguments}, ensure_ascii=False)
        return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


class ToolOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What the sandbox answers to one tool call in a workspace.

    `output` is the tool's text (a file's lines, a listing, a command's stdout and stderr); `error` is
    non-empty when the call could not be done (no such file, a path outside the workspace, `old` not found
    once), and is what the policy is told. `exit_code` and `timed_out` are a `run` call's.
    """

    output: str = ""
    error: str = ""
    exit_code: int | None = None
    timed_out: bool = False


class BadCall(msgspec.Struct, frozen=True):
    """A `<tool_call>` block that is not a call of a tool: what it said and why (the policy is told)."""

    text: str
    problem: str


def _type_ok(value: Any, kind: str) -> bool:
    match kind:
        case "string":
            return isinstance(value, str)
        case "integer":
            return isinstance(value, int) and not isinstance(value, bool)
        case "number":
            return isinstance(value, int | float) and not isinstance(value, bool)
    return False


def check_call(name: Any, arguments: Any) -> ToolCall | str:
    """The call with defaults filled, or the problem with it (unknown tool, an argument missing, unknown or of
    the wrong type), as the one line the policy is told."""
    if not isinstance(name, str) or name not in TOOLS:
        return f"unknown tool {name!r}; the tools are {', '.join(TOOLS)}"
    spec = TOOLS[name]
    if not isinstance(arguments, dict):
        return f"{name}: arguments must be a JSON object, got {type(arguments).__name__}"
    props: dict[str, Any] = spec["properties"]
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        return f"{name}: unknown argument(s) {', '.join(unknown)}; it takes {', '.join(props) or 'none'}"
    missing = [k for k in spec["required"] if k not in arguments]
    if missing:
        return f"{name}: missing argument(s) {', '.join(missing)}"
    for key, value in arguments.items():
        if not _type_ok(value, props[key]["type"]):
            return f"{name}: argument {key} must be a {props[key]['type']}, got {type(value).__name__}"
    return ToolCall(name, {**spec.get("defaults", {}), **arguments})


def parse_turn(text: str, style: CallStyle = "hermes") -> list[ToolCall | BadCall]:
    """The tool calls of a policy turn's text, in order, in `style`: each a checked `ToolCall` or a `BadCall`
    (not JSON, not a call object, an unknown tool, bad arguments, and what else the style refuses). No call at all
    is an empty list.

    Call styles: "hermes", the one of Qwen2.5 and Qwen3 chat templates, `<tool_call>\\n{"name": ...,
    "arguments": {...}}\\n</tool_call>` (zero or more per turn, text around them ignored); "llama", the one of
    Llama-3.1 templates, `{"name": ..., "parameters": {...}}` as the whole turn (one call, optionally after
    `<|python_tag|>`).
    """
    return _parse_llama(text) if style == "llama" else _parse_hermes(text)


def _parse_hermes(text: str) -> list[ToolCall | BadCall]:
    """The `<tool_call>` blocks: each JSON `{"name", "arguments"}`. An opening tag left unclosed at the end is a
    `BadCall` too. Text outside the blocks is the policy's own (thinking aloud) and ignored."""
    out: list[ToolCall | BadCall] = []
    end = 0
    for found in _CALL.finditer(text):
        end = found.end()
        body = found.group(1).strip()
        out.append(_call_of(body, "arguments"))
    if CALL_OPEN in text[end:]:
        tail = text[end:][text[end:].index(CALL_OPEN) + len(CALL_OPEN):].strip()
        out.append(BadCall(tail, f"a {CALL_OPEN} without its {CALL_CLOSE}"))
    return out


def _parse_llama(text: str) -> list[ToolCall | BadCall]:
    """The turn as one Llama-3.1 call: JSON `{"name", "parameters"}` and nothing else (a leading `<|python_tag|>`
    allowed). A turn without `"name"` in it has no call; one that has it but is not exactly one JSON object is a
    `BadCall` saying why."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        if '"name"' not in body:
            return []
        return [BadCall(body, 'a tool call is the whole turn, one JSON object {"name": ..., "parameters": {...}}, '
                              "with no text before it")]
    try:
        _, stop = json.JSONDecoder().raw_decode(body)
    except (json.JSONDecodeError, RecursionError) as err:
        return [BadCall(body, f"the tool call is not valid JSON ({err})")]
    if body[stop:].strip():
        return [BadCall(body, 'a tool call is the whole turn, one JSON object {"name": ..., "parameters": {...}}, '
                              "with no text after it (one call a turn)")]
    return [_call_of(body, "parameters")]


def _call_of(body: str, key: str) -> ToolCall | BadCall:
    """One call's JSON text, its arguments under `key` (or the other style's key), checked."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as err:
        return BadCall(body, f"the tool call is not valid JSON ({err})")
    if not isinstance(doc, dict) or "name" not in doc:
        return BadCall(body, f'a tool call is a JSON object {{"name": ..., "{key}": {{...}}}}')
    other = "arguments" if key == "parameters" else "parameters"
    arguments = doc.get(key, doc.get(other, {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            pass
    checked = check_call(doc["name"], arguments)
    return checked if isinstance(checked, ToolCall) else BadCall(body, checked)


def tools_text() -> str:
    """The tool list and how to call a tool, as Qwen2/Qwen3 templates word it in their system turn.

    Used where the policy's chat template does not render tools (the built-in byte policy, ChatML): the tool
    list is given as a `<tools>` block of JSON function signatures in the user turn, calls are Hermes ones,
    and the results come back in one observation turn (`response_text`).
    """
    signatures = "\n".join(json.dumps(schema) for schema in TOOL_SCHEMAS)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n"
            f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_CLOSE}')


def response_text(results: list[str]) -> str:
    """Tool results as one observation: each `<tool_response>\\n...\\n</tool_response>`, joined by newlines.

    For a Hugging Face policy the observation role is the template's user turn, which is how Qwen templates
    render a run of `tool` messages; the built-in byte policy uses the same text, its results in its own
    observation role.
    """
    return "\n".join(f"{RESPONSE_OPEN}\n{r}\n{RESPONSE_CLOSE}" for r in results)


def outcome_text(call: ToolCall, outcome: ToolOutcome) -> str:
    """What the policy reads of one tool's outcome: `error: ...`, or the output (a `run` call's after its exit
    code, or "timed out")."""
    if outcome.error:
        return f"error: {outcome.error}"
    if call.name == "run":
        head = "timed out" if outcome.timed_out else f"exit code {outcome.exit_code}"
        return f"{head}\n{outcome.output}" if outcome.output else head
    return outcome.output
