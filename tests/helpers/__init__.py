"""What tests share, importable as `helpers` (pyproject: pytest `pythonpath = ["tests"]`).

`eventually` / `eventually_sync` poll with a hang guard; `hosted` / `Hosted` serve actors in the test's process;
`new_run` is a fresh run id (the `run_id` fixture of tests/conftest.py). Modules for groups of tests: `ops` (a
subcommand in-process, single-server targets), `rl_bus` (a provisioned one-region run for trainer tests),
`rollouts` (synthetic rollouts sampled from a real model), `samples` (one message of every kind),
`fuzz_payloads` (hostile payloads), `runs` (the finished `rlbus up` run of the `finished_run` fixture),
`ast_guard` (the audit hook that fails a test building an AST off the main thread), `procs` (a run's actor
processes in /proc), `generator_bus` (a module's server and a provisioned run per test for generator tests),
`function_partials` (function-writing partials as a generator saves them).
"""

from __future__ import annotations

from helpers.hosting import Hosted, hosted
from helpers.runs import new_run
from helpers.waiting import eventually, eventually_sync

__all__ = ["Hosted", "eventually", "eventually_sync", "hosted", "new_run"]
