"""The TRL arm of `rlbus bench peer`: TRL's `GRPOTrainer` in its standard synchronous loop, on the CPU.

Owns: `run_trl` (the trainer built from the shared settings, a reward function that grades every completion in
the rlbus sandbox, a wall-clock budget that excludes the time spent saving snapshots, or else a fixed number of
optimizer steps, and a bf16 snapshot of the policy at each mark or after the last step) and `prompt_text` (a
task's prompt as the text TRL tokenizes back to the ids rlbus generators start from).
Does not: score snapshots (ops/bench/peer.py), run the sandbox service (ops/local_sandbox.py).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

# rlbus.model imports torch, and every `rlbus` command imports this module (ops/bench/peer.py builds its options)
if TYPE_CHECKING:
    from rlbus.model.tasks.builtin import Task

Grader = Callable[[Sequence["Task"], Sequence[str]], list[bool]]
"""(tasks, completion texts) → passed, one per completion: the sandbox's verdict."""


@dataclass(frozen=True, slots=True)
class Shared:
    """The settings both arms run with (ops/bench/peer.py fills them from the rlbus topology)."""

    group_size: int
    tasks_per_step: int
    temperature: float
    max_tokens: int
    lr: float
    kl_coef: float
    grad_clip: float
    seed: int


@dataclass(slots=True)
class ArmRun:
    """What one arm did within its budget: snapshot (time, file) pairs and counters over the clocked wall."""

    wall_s: float
    steps: int
    rollouts_trained: int
    rollouts_generated: int
    completion_tokens: int
    snapshots: list[tuple[float, Path]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def prompt_text(tokenizer: Any, task: Task) -> str:
    """The prompt as text whose plain tokenization (`tokenizer.hf(text)`) is exactly `tokenizer.prompt_ids`.

    :raises ValueError: the tokenizer does not round-trip it (the arms would start from different prompts).
    """
    ids = tokenizer.prompt_ids(task.prompt)
    text = tokenizer.decode(ids, specials=True)
    back = list(tokenizer.hf(text).input_ids)
    if back != ids:
        raise ValueError(f"bench peer: task {task.task_id}'s prompt does not tokenize back to the policy's prompt "
                         f"ids ({len(back)} vs {len(ids)} ids); TRL would start from another prompt")
    return text


def run_trl(base: Path, tasks: Sequence[Task], shared: Shared, *, budget_s: float | None, marks: Sequence[float],
            out: Path, grade: Grader, threads: int, progress: Callable[[str], None],
            steps: int | None = None) -> ArmRun:
    """Train the policy of `base` with GRPOTrainer on `tasks` (in order) for `budget_s` of training wall-clock,
    or (`steps` given) for exactly `steps` optimizer steps, however long they take.

    The clock runs from the start of `trainer.train()` and excludes each snapshot's save. A snapshot (the bf16
    cast of the weights, as rlbus publishes versions) is saved at the end of the first step past each of
    `marks` (seconds); training stops at the end of the first step past `budget_s`, which is the last mark. With
    `steps`, `budget_s` and `marks` are not used: one snapshot is saved at the end of the last step.
    """
    if (steps is None) == (budget_s is None):
        raise ValueError("run_trl: give a wall-clock budget or a number of steps, not both")
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlbus.model.env.episodes import completion_text
    from rlbus.model.policies.hf import HFPolicy

    torch.set_num_threads(threads)
    policy = HFPolicy.load(base, dtype=torch.float32)
    tok = policy.tokenizer
    model = policy.module
    model.generation_config.eos_token_id = list(tok.stop_ids)     # a completion ends where rlbus's ends
    model.generation_config.pad_token_id = tok.pad_id
    rows = [{"prompt": prompt_text(tok, t), "task_index": i} for i, t in enumerate(tasks)]
    counters = {"generated": 0, "tokens": 0, "passed": 0}

    def reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
               task_index: list[int], **_: Any) -> list[float]:
        texts = [completion_text(ids, tok) for ids in completion_ids]
        passed = grade([tasks[i] for i in task_index], texts)
        counters["generated"] += len(texts)
        counters["tokens"] += sum(len(ids) for ids in completion_ids)
        counters["passed"] += sum(passed)
        return [1.0 if p else 0.0 for p in passed]

    clock = _Clock(policy, marks=sorted(marks) if steps is None else [], budget_s=budget_s, steps=steps, out=out,
                   progress=progress)

    class Marks(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            clock.start()

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            if clock.step_end(state.global_step):
                control.should_training_stop = True

    batch = shared.group_size * shared.tasks_per_step
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-peer-trl-") as tmp:
        config = GRPOConfig(
            output_dir=tmp, use_cpu=True, use_vllm=False, report_to=[], disable_tqdm=True, save_strategy="no",
            logging_steps=10**9, seed=shared.seed, data_seed=shared.seed, bf16=False,
            per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=shared.group_size,
            max_completion_length=shared.max_tokens, temperature=shared.temperature, top_p=1.0, top_k=0,
            learning_rate=shared.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=shared.grad_clip, beta=shared.kl_coef,
            num_iterations=1, scale_rewards="none", loss_type="dapo", shuffle_dataset=False,
            max_steps=steps or max(1, len(tasks) // shared.tasks_per_step), dataloader_num_workers=0,
            run_name=f"peer-{uuid.uuid4().hex[:6]}")
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):   # its log lines: not the JSON
            warnings.simplefilter("ignore", FutureWarning)        # transformers 5's renames, inside TRL
            trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                                  train_dataset=Dataset.from_list(rows), processing_class=tok.hf, callbacks=[Marks()])
            trainer.train()
    if steps is not None and clock.steps < steps:
        raise RuntimeError(f"bench peer: TRL ran out of training tasks after {clock.steps} of {steps} steps; give it "
                           f"more tasks")
    if budget_s is not None and clock.wall_s < budget_s:
        raise RuntimeError(f"bench peer: TRL ran out of training tasks after {clock.steps} steps ({clock.wall_s:.0f}s "
                           f"of {budget_s:.0f}s); give it more tasks")
    return ArmRun(wall_s=clock.wall_s, steps=clock.steps, rollouts_trained=clock.steps * batch,
                  rollouts_generated=counters["generated"], completion_tokens=counters["tokens"],
                  snapshots=clock.snapshots, extra={"save_s": round(clock.paused_s, 2),
                                                    "train_pass_rate": counters["passed"] / max(1, counters["generated"])})


class _Clock:
    """Training wall-clock minus snapshot saves; saves a snapshot past each mark (with `steps`: after the last
    step), says when the budget (or the number of steps) is spent."""

    def __init__(self, policy: Any, *, marks: list[float], budget_s: float | None, out: Path,
                 progress: Callable[[str], None], steps: int | None = None) -> None:
        self.policy, self.marks, self.budget_s, self.out, self.progress = policy, marks, budget_s, out, progress
        self.max_steps = steps
        self.started = 0.0
        self.paused_s = 0.0
        self.wall_s = 0.0
        self.steps = 0
        self.snapshots: list[tuple[float, Path]] = []

    def start(self) -> None:
        self.started = time.perf_counter()

    def step_end(self, step: int) -> bool:
        import torch

        self.steps = step
        self.wall_s = time.perf_counter() - self.started - self.paused_s
        last = self.max_steps is not None and step >= self.max_steps
        if last or (self.marks and self.wall_s >= self.marks[0]):
            while self.marks and self.wall_s >= self.marks[0]:
                self.marks.pop(0)
            paused = time.perf_counter()
            path = self.out / f"trl-{len(self.snapshots) + 1:02d}.pt"
            torch.save(self.policy.published_state(torch.bfloat16), path)
            self.snapshots.append((self.wall_s, path))
            self.paused_s += time.perf_counter() - paused
            self.progress(f"trl: snapshot {len(self.snapshots)} at {self.wall_s:.0f}s (step {step})")
        return last or (self.budget_s is not None and self.wall_s >= self.budget_s)
