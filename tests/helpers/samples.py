"""One valid sample of every message kind, shared by the codec tests and the fixture writer."""

from __future__ import annotations

from rlbus.messages.schemas import (
    CheckpointMark,
    DroppedRollout,
    EvalReport,
    Event,
    Heartbeat,
    Message,
    Rollout,
    SandboxLimits,
    SandboxRequest,
    SandboxResult,
    SandboxVerdict,
    StateUploaded,
    Task,
    TensorBlob,
    TrainStep,
    VersionReady,
    WeightManifest,
)


def samples() -> list[Message]:
    """Every message kind with non-default values in every field kind (fixed timestamps)."""
    t = 1_790_000_000.0
    return [
        Task(task_id="t1", prompt="def f(x):", verifier={"kind": "python_tests", "tests": "assert f(1)==2"},
             group_size=4, region="hub", seed=7, created_at=t),
        Rollout(rollout_id="r1", task_id="t1", group_index=2, group_size=4,
                prompt_tokens=TensorBlob.of([1, 2, 3], "int32"), completion_tokens=TensorBlob.of([4, 5], "int32"),
                behaviour_logprobs=TensorBlob.of([-0.5, -1.25], "float32"),
                policy_versions=TensorBlob.of([3, 4], "int32"), loss_mask=TensorBlob.of([1, 1], "uint8"), routing=TensorBlob(dtype="int64", shape=(2, 1, 1), data=bytes(16)),
                reward=1.0, verdict=SandboxVerdict(passed=3, total=3, exit_code=0, status="ok"),
                timings={"generate_s": 0.5}, region="eu", generator_id="g1", created_at=t),
        WeightManifest(version=5, base_version=4, encoding="delta", objects=["v5.0"], digests=["sha256:ab"],
                       sizes=[123], version_digest="blake2b:cd", raw_bytes=1000, regions_ready=["hub"],
                       created_at=t),
        CheckpointMark(step=10, policy_version=10, objects=["ckpt-10"], digests=["sha256:ef"],
                       consumed_rollout_ids=["r1", "r2"], parent_step=5, created_at=t),
        SandboxRequest(request_id="q1", code="def f(x): return x+1", tests="assert f(1)==2",
                       limits=SandboxLimits(cpu_seconds=1.0, memory_mb=128)),
        SandboxResult(request_id="q1", verdict=SandboxVerdict(passed=1, total=1, exit_code=0, status="ok"),
                      stdout="ok", stderr="", isolation="bwrap", cpu_seconds=0.01, max_rss_kb=9000,
                      wall_seconds=0.02),
        Heartbeat(actor_id="g1", actor_kind="generator", region="eu", state="busy", run="r", policy_version=4,
                  counters={"rollouts": 9}, gauges={"lag": 1.0}, restarts=1, last_error="", pid=42, sent_at=t),
        Event(event="restarted", actor_id="g1", actor_kind="generator", region="eu", detail="SIGKILL",
              data={"attempt": "1"}, at=t),
        TrainStep(step=3, policy_version=4, parent_checkpoint=2, rollout_ids=["r1"],
                  dropped=[DroppedRollout(rollout_id="r0", reason="stale: 5 versions behind")],
                  loss=0.25, kl=0.01, reward_mean=0.5, reward_std=0.5, staleness={"1": 1}, created_at=t),
        EvalReport(policy_version=4, task_seed=1, n=200, pass_at_1=0.2, ci_low=0.15, ci_high=0.26, created_at=t),
        VersionReady(version=4, step=4, object="weights/raw-v4", digest="sha256:01", version_digest="blake2b:02",
                     raw_bytes=2048, created_at=t),
        StateUploaded(step=4, policy_version=4, objects=["state/step-4"], digests=["sha256:03"],
                      consumed_rollout_ids=["r1"], parent_step=2, created_at=t),
    ]
