"""rlbus.model.tasks: where coding tasks come from and how a candidate is graded.

- `builtin`: the function-writing family (held-out set and training stream disjoint by prompt hash).
- `repo`: built-in repository tasks (small packages with a bug to fix or a function to add).
- `sources`: task sources by name (built-in, HumanEval, repo, JSONL files), read into tasks.
- `grading` and `harness`: grading code against hidden tests through a pluggable runner; the child harness.
"""
