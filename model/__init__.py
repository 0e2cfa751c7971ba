"""rlbus.model: models, tasks, environments and the math of training, with no bus and no actors.

- Owns: the rooms, each a subpackage whose docstring lists its modules: `policies/` (the policy interface,
  built-in and Hugging Face implementations, recipe, export), `tasks/` (sources, built-in families,
  repository tasks, grading), `tools/` (the agentic tools' vocabulary), `env/` (environments between a task
  and the generator), `sampling/` (generation with a KV cache, summaries, greedy evaluation), `training/`
  (RL losses, continued pretraining and its corpus).
- Guarantee: nothing is re-exported here, so no import of `rlbus.model` reaches a policy implementation.
- Does not: touch the bus or run actors (messages/, actors/).
"""
