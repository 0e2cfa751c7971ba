"""rlbus.model: models, tasks, environments and the math of training, with no bus and no actors.

Rooms (each a subpackage whose docstring lists its modules):
- `policies/`: the policy interface and its implementations (built-in, Hugging Face), recipe, export.
- `tasks/`: task sources, the built-in families, repository tasks, grading.
- `tools/`: the agentic tools' vocabulary; `env/`: environments between a task and the generator.
- `sampling/`: generation with a KV cache, summaries, greedy evaluation.
- `training/`: RL losses, continued pretraining and its corpus.

Nothing is re-exported here, so no import of `rlbus.model` reaches a policy implementation.
"""
