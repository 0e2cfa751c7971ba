"""The text of an agentic episode's summary step: the request, a summary's layout, the fresh context after it.

- Owns: `SUMMARY_REQUEST` (the user turn asking for a summary of the work so far), `summary_text` (a summary laid
  out as the scripted expert writes one), `fitted` (one shortened to a token budget) and `fresh_context` (the user
  turn an episode continues from after a summary: the task, then the summary).
- Guarantee: pure text; the same arguments give the same text.
- Does not: decide when to summarise (the generator, model/env/agentic.py), count tokens, or sample a summary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

SUMMARY_REQUEST: Final = (
    "Your context is nearly full. Summarize your work on this task so far for yourself: what the task asks, "
    "what you found, what you changed and what is left to do. Call no tool in this turn. Your history is then "
    "replaced by the task and your summary, and you go on in the same repository.")
"""The user turn that asks for a summary; the answer is an assistant turn without tool calls."""
SUMMARY_HEAD: Final = "Summary of my work so far:"
FRESH_HEAD: Final = "Your earlier context was replaced by your own summary of it:"
FRESH_TAIL: Final = "The repository is as you left it. Go on from here."


def summary_text(*, found: Sequence[str] = (), changed: Sequence[str] = (), next_step: str = "") -> str:
    """A summary as the scripted expert writes one: `SUMMARY_HEAD`, then a bullet per finding and per change
    (a line saying nothing is changed yet when there is none), then the next step."""
    lines = [SUMMARY_HEAD, *(f"- {line}" for line in found)]
    lines += [f"- changed: {line}" for line in changed] or ["- nothing is changed yet"]
    if next_step:
        lines.append(f"Next: {next_step}")
    return "\n".join(lines)


def fitted(summary: str, fits: Callable[[str], bool]) -> str:
    """`summary` shortened until `fits` says it does (the policy's summary budget): its bullets dropped from the
    last one up (the head and the next step kept), then its text cut at the end."""
    lines = summary.split("\n")
    tail = 1 if len(lines) > 1 and lines[-1].startswith("Next: ") else 0
    while not fits("\n".join(lines)) and len(lines) > 1 + tail:
        del lines[len(lines) - 1 - tail]
    text = "\n".join(lines)
    lo, hi = 0, len(text)
    while lo < hi:             # the longest head of `text` that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(text[:mid]) else (lo, mid - 1)
    return text[:lo]


def fresh_context(task_text: str, summary: str) -> str:
    """The user turn of the context after a summary: the task as first rendered, then the summary between
    `FRESH_HEAD` and `FRESH_TAIL`."""
    return f"{task_text}\n\n{FRESH_HEAD}\n{summary}\n\n{FRESH_TAIL}"


__all__ = ["FRESH_HEAD", "FRESH_TAIL", "SUMMARY_HEAD", "SUMMARY_REQUEST", "fitted", "fresh_context", "summary_text"]
