"""rlbus.model.env: environments, the pure part between a task and the generator.

Re-exports the interface (model/env/base.py), the function-writing environment (function.py), the agentic
coding environment (agentic.py) and its tool format (model/tools/calls.py), the scripted policies (scripted.py), and
`encode_state` / `decode_state`, which round-trip any environment's state through msgpack (what a partial
rollout checkpoints after each turn).
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from rlbus.model.env.agentic import (
    COMPACT_TOOLS,
    AgenticBudgets,
    AgenticEnvironment,
    AgenticState,
    EndReason,
    SummaryPlan,
)
from rlbus.model.env.base import (
    Environment,
    EnvState,
    GradePort,
    SandboxPort,
    StepOutcome,
    WorkspacePort,
    state_context,
    state_tokens,
    summarized,
)
from rlbus.model.env.function import FunctionEnvironment, FunctionState, state_of
from rlbus.model.env.scripted import SUBMIT_SCRIPT, edits_script, reference_script, scripted_ids
from rlbus.model.tools.calls import TOOLS, BadCall, ToolCall, ToolOutcome, check_call, parse_turn

AnyState: TypeAlias = FunctionState | AgenticState
_DECODER = msgspec.msgpack.Decoder(AnyState)


def encode_state(state: AnyState) -> bytes:
    """An environment's state as msgpack bytes (its `env` tag names the environment)."""
    return msgspec.msgpack.encode(state)


def decode_state(data: bytes) -> AnyState:
    """The state `encode_state` wrote.

    :raises msgspec.DecodeError: the bytes are not a state (garbage, a wrong type, an unknown `env` tag).
    """
    return _DECODER.decode(data)


__all__ = [
    "COMPACT_TOOLS",
    "SUBMIT_SCRIPT",
    "TOOLS",
    "AgenticBudgets",
    "AgenticEnvironment",
    "AgenticState",
    "AnyState",
    "BadCall",
    "EndReason",
    "EnvState",
    "Environment",
    "FunctionEnvironment",
    "FunctionState",
    "GradePort",
    "SandboxPort",
    "StepOutcome",
    "SummaryPlan",
    "ToolCall",
    "ToolOutcome",
    "WorkspacePort",
    "check_call",
    "decode_state",
    "edits_script",
    "encode_state",
    "parse_turn",
    "reference_script",
    "scripted_ids",
    "state_context",
    "state_of",
    "state_tokens",
    "summarized",
]
