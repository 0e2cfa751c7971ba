"""rlbus.model.tools: the agentic tools' vocabulary: names and arguments, parsing a turn's calls, rendering.

Below both tasks (a repository task's reference edit is a list of tool calls) and environments.
- `calls`: `TOOLS`, `ToolCall`, `ToolOutcome`, `parse_turn`, `check_call`.
"""
