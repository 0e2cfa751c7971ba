"""rlbus.model.tools: the agentic tools' vocabulary: names and arguments, parsing a turn's calls, rendering.

Below both tasks (a repository task's reference edit is a list of tool calls) and environments.
- `calls`: `TOOLS`, `TOOL_SCHEMAS`, `ToolCall`, `ToolOutcome`, `parse_turn` (Hermes or Llama-3.1 calls), `check_call`.
- `template`: `TemplateTools`, `template_tools`: the tools in a chat template's own format (system turn, tool role).
"""
