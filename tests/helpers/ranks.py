"""What the trainer-rank tests run inside each rank process of a `LocalGroup`, and the one-rank side they compare.

`steps_case` builds the same core on every rank (`build`), trains the steps it is given on the leader while the
followers `follow`, and saves sharded checkpoints along the way into the job's folder (`upload`), so the test
process can read every state back with `shards_to_payload` and compare it with one `TrainerCore`; then the
leader pings until the test kills it. `stall_case` stops a follower (SIGSTOP) as a step starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgspec
import torch

from rlbus.actors.trainer.core import Objective, TrainerCore
from rlbus.actors.trainer.ranks import RankError, RankSpec, ShardedCore, follow, join, leave
from rlbus.messages import codec
from rlbus.messages.schemas import Rollout
from rlbus.model.policies.interface import fresh_builtin, load_policy

LR = 1e-4


def build(policy: str) -> TrainerCore:
    """A core on the CPU: "builtin" (the fresh tiny built-in policy, seed 0) or a Hugging Face directory."""
    torch.manual_seed(0)
    net = fresh_builtin() if policy == "builtin" else load_policy(Path(policy), dtype=torch.float32)
    return TrainerCore(net, net.clone(), lr=LR, seed=0)


def write_rollouts(path: Path, steps: Sequence[Sequence[Rollout]]) -> None:
    path.write_bytes(msgspec.msgpack.encode([[codec.encode(r) for r in step] for step in steps]))


def read_rollouts(path: Path) -> list[list[Rollout]]:
    return [[codec.decode_as(data, headers, Rollout) for data, headers in step]
            for step in msgspec.msgpack.decode(path.read_bytes())]


def uploader(root: Path) -> Any:
    """An `upload` into the folder `root` as an object store every rank shares: a file is stored as
    "<sha256 prefix>-<its name>", and that is its object name."""
    def upload(name: str, data: bytes) -> tuple[str, str]:
        digest = hashlib.sha256(data).hexdigest()
        root.mkdir(parents=True, exist_ok=True)
        (root / f"{digest[:16]}-{name}").write_bytes(data)
        return f"{digest[:16]}-{name}", digest
    return upload


def read_files(root: Path, objects: Sequence[str]) -> dict[str, bytes]:
    """The checkpoint files of `objects` (stored by `uploader(root)`), by file name."""
    return {name.partition("-")[2]: (root / name).read_bytes() for name in objects}


def saved(root: Path, tag: str) -> dict[str, bytes]:
    """The files of the checkpoint `steps_case` saved as `tag` under `root`."""
    listing = json.loads((root / f"{tag}.json").read_text())
    return read_files(root / "store", listing["objects"])


def _objective(name: str) -> Objective:
    return Objective(aggregation=name)  # type: ignore[arg-type]


def steps_case(spec: RankSpec, job: dict[str, Any]) -> Any:
    """job: {"cases": [{"policy", "rollouts" (file), "aggregations", "out", "blob0", "blob3"}], "result" (file),
    "marks" (folder)}. On the leader, per case: steps 1-3 (stats kept), save "s3"; step 4, save "s4a"; load "s3",
    step 4 again, save "s4b"; load the one-rank blob0 (the initial state), steps 1-3 again, save "r3"; load the
    one-rank blob3 (after step 3), step 4, save "f4" and publish the version (its digest kept). After the last
    case the leader writes its results into `result` and pings every 0.1 s until it is killed; a follower
    writes "pinged-<rank>" into `marks` at the first of those pings and returns what `follow` then raised."""
    join(spec, torch.device("cpu"))
    out: list[Any] = []
    marks = Path(job["marks"])
    try:
        for n, case in enumerate(job["cases"]):
            last_case = n == len(job["cases"]) - 1
            root = Path(case["out"])
            upload = uploader(root / "store")
            sc = ShardedCore(build(case["policy"]), spec)
            if not spec.leader:
                def mark(op: str, last_case: bool = last_case) -> None:
                    if last_case and op == "ping" and not (marks / f"pinged-{spec.rank}").exists():
                        (marks / f"pinged-{spec.rank}").write_text("1")
                try:
                    follow(sc, upload, on_command=mark)
                except RankError as err:
                    return {"error": type(err).__name__, "message": str(err)}
                continue
            steps = read_rollouts(Path(case["rollouts"]))
            objectives = [_objective(a) for a in case["aggregations"]]

            def save(tag: str, sc: ShardedCore = sc, root: Path = root, upload: Any = upload) -> None:
                objects, digests = sc.save_shards({"tag": tag}, upload)
                (root / f"{tag}.json").write_text(json.dumps({"objects": objects, "digests": digests}))

            stats = [asdict(sc.train_step(steps[i], objectives[i])) for i in range(3)]
            save("s3")
            sc.train_step(steps[3], objectives[3])
            save("s4a")
            sc.load_shards(saved(root, "s3"))
            sc.train_step(steps[3], objectives[3])
            save("s4b")
            sc.load_full(Path(case["blob0"]).read_bytes())
            for i in range(3):
                sc.train_step(steps[i], objectives[i])
            save("r3")
            sc.load_full(Path(case["blob3"]).read_bytes())
            last = asdict(sc.train_step(steps[3], objectives[3]))
            save("f4")
            _, digest, raw = sc.published_version()
            out.append({"stats": stats, "last": last, "digest": digest, "raw": raw})
            if last_case:
                Path(job["result"]).write_text(json.dumps(out))
                while True:          # until the test kills this rank
                    sc.ping()
                    time.sleep(0.1)
            sc.stop()
    finally:
        leave()
    return out


def stall_case(spec: RankSpec, job: dict[str, Any]) -> Any:
    """job: {"rollouts", "out"}: rank 1 stops itself (SIGSTOP: alive, silent) when the "train" command arrives,
    while the leader trains step 1. -> {"error": the class of what this rank raised (None), "message"}."""
    join(spec, torch.device("cpu"))
    try:
        sc = ShardedCore(build("builtin"), spec)

        def stall(op: str) -> None:
            if op == "train":
                os.kill(os.getpid(), signal.SIGSTOP)

        if spec.leader:
            sc.ping()
            sc.train_step(read_rollouts(Path(job["rollouts"]))[0], Objective())
            sc.stop()
        else:
            follow(sc, uploader(Path(job["out"]) / "store"), on_command=stall)
        return {"error": None}
    except RankError as err:
        return {"error": type(err).__name__, "message": str(err)}
    finally:
        leave()
