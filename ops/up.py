"""`rlbus up [FILE]`: launch a topology on this machine and show its progress until Ctrl-C.

Owns: the command line of `up` (topology file, state dir, --fresh, backend, --for, --steps), the first
phase (pretraining when the run has a trainer and no pretrained policy yet), the live view (RL progress
lines from ops/runview.py, or a heartbeat table for the bus demo), and the closing summary and PNG.
The work of starting servers, streams and actors is topology/launch.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import IO, Any

DEFAULT_TOPOLOGY = "single"
"""The embedded default of `rlbus up`: one region running the whole RL run."""
LOCK_FILE = "up.lock"
"""In the state directory: flock-ed by the `rlbus up` using it, holding its pid."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "up", help="run the async RL job (default: the embedded single-region topology) and show progress",
        description="Pretrain the policy if the state directory has none, start the embedded NATS servers (one per "
                    "region, unless the topology names nats_urls), provision the streams, launch every actor through "
                    "the local or Ray backend, and show progress (version, reward, pass rate, staleness, throughput). "
                    "Ctrl-C drains the actors, stops the servers and leaves no process behind; the run ends with a "
                    "summary, the ledger and a PNG of reward and pass rate per version. A second `rlbus up` on the "
                    "same state directory resumes the run. `rlbus up demo` runs the 3-region bus demo.")
    p.add_argument("topology", nargs="?", default=DEFAULT_TOPOLOGY,
                   help=f"topology file, or the name of a shipped example (default: {DEFAULT_TOPOLOGY}; also: "
                        "three_regions, ray, tiny, demo)")
    p.add_argument("--state-dir", type=Path, default=None, help="run state directory (default ./.rlbus/<run>)")
    p.add_argument("--fresh", action="store_true", help="delete the run's state directory first and start over")
    p.add_argument("--backend", choices=["local", "ray"], default=None, help="override the topology's launch backend")
    p.add_argument("--for", dest="duration", type=float, default=None, metavar="SECONDS",
                   help="stop by itself after this many seconds (default: run until Ctrl-C)")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="stop by itself once the trainer has taken optimizer step N")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="actor heartbeat interval (default 1 s)")
    p.set_defaults(handler=_handler)


def _handler(args: argparse.Namespace) -> int:
    import anyio

    from rlbus.topology.examples import example_path
    from rlbus.topology.load import load

    path = Path(args.topology)
    if not path.exists() and "/" not in args.topology:
        path = example_path(args.topology)
    topology = load(path)
    state = (args.state_dir or topology.state_path).resolve()
    lock = hold_state_dir(state)
    try:
        if args.fresh:
            for child in state.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                elif child.name != LOCK_FILE:
                    child.unlink()
        rl = any(i.kind == "trainer" for i in topology.instances())
        base = _ensure_pretrained(topology, state) if rl else None
        return int(anyio.run(_up, topology, state, args, rl, base, backend="asyncio"))
    finally:
        lock.close()


def hold_state_dir(state: Path) -> IO[str]:
    """Create `state` and take its lock for as long as the returned file stays open: two `rlbus up` on
    one state directory would run two servers on one JetStream store and corrupt it.

    :raises RlbusError: another process holds it (its pid is named).
    """
    from rlbus.messages.errors import RlbusError

    state.mkdir(parents=True, exist_ok=True)
    lock = open(state / LOCK_FILE, "a+")  # noqa: SIM115 - held open for the whole run
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        owner = lock.read().strip() or "unknown"
        lock.close()
        raise RlbusError(f"state directory {state} is in use by another `rlbus up` (pid {owner}); stop it "
                         f"first, or give this run another --state-dir") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    if stopped := stop_leftovers(state):
        print(f"rlbus: stopped {len(stopped)} process(es) that a killed `rlbus up` on {state} had left running "
              f"(pids {', '.join(map(str, stopped))}): its nats-server(s) would have shared the JetStream store "
              f"with this run's", file=sys.stderr, flush=True)
    return lock


def leftover_processes(state: Path) -> list[int]:
    """PIDs of the nats-servers and actor processes (`python -m rlbus.ops.actor`) whose command line names
    `state`: what an `rlbus up` killed with SIGKILL leaves behind (it cannot stop them then). Nothing else
    that names the directory (an editor, a `tail -f` of a log) counts."""
    marker = str(state.resolve()).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not any(marker in arg for arg in argv):
            continue
        if os.path.basename(argv[0]) == b"nats-server" or b"rlbus.ops.actor" in argv:
            found.append(int(entry.name))
    return sorted(found)


def stop_leftovers(state: Path, *, grace_s: float = 10.0) -> list[int]:
    """SIGTERM the `leftover_processes` of `state` (the holder of its lock is gone, so they belong to no
    run), SIGKILL those still alive after `grace_s`; returns the PIDs found."""
    pids = leftover_processes(state)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ensure_pretrained(topology: Any, state: Path) -> dict[str, Any] | None:
    """Pretrain into `<state>/pretrained/` unless a policy is there; returns its summary (pass@1)."""
    from rlbus.model.pretrain import PretrainConfig, PretrainProgress, pretrain
    from rlbus.topology.launch import PRETRAINED_DIR

    out = state / PRETRAINED_DIR
    summary_path = out / "pretrain.json"
    if (out / "pretrain.pt").exists():
        print(f"rlbus up: pretrained policy found in {out}", flush=True)
        return _pass_summary(summary_path)
    settings = topology.pretrain
    # pretraining skips, and reports its base on, the evaluator's held-out set
    overrides: dict[str, Any] = {"task_seed": topology.evaluator.seed}
    if settings.eval_n is not None:
        overrides["eval_n"] = settings.eval_n
    config = PretrainConfig.preset(settings.preset, **overrides)
    steps = settings.steps or config.steps
    print(f"rlbus up: no pretrained policy yet: pretraining ({settings.preset}, {steps} steps, "
          f"{settings.threads} threads) into {out}", flush=True)
    every = max(1, steps // 10)

    def progress(p: PretrainProgress) -> None:
        if p.phase == "train" and (p.step % every == 0 or p.step == p.steps):
            print(f"  pretrain step {p.step}/{p.steps}  loss {p.loss:.3f}  {p.elapsed_s:.0f}s", flush=True)
        elif p.phase != "train":
            print(f"  pretrain {p.phase}: {p.note}", flush=True)

    result = pretrain(config, steps, settings.seed, out, settings.threads, progress=progress)
    ev = result.eval
    print(f"rlbus up: pretrained in {result.wall_s:.0f}s: held-out pass@1 {ev.pass_at_1:.3f} "
          f"[{ev.ci_low:.3f}, {ev.ci_high:.3f}] on {ev.n} tasks", flush=True)
    return _pass_summary(summary_path)


def _pass_summary(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ev = data.get("eval") or {}
    try:
        return {"pass_at_1": float(ev["pass_at_1"]), "ci_low": float(ev["ci95"][0]),
                "ci_high": float(ev["ci95"][1]), "n": int(ev["n"])}
    except (KeyError, IndexError, TypeError, ValueError):
        return None


async def _up(topology: Any, state: Path, args: argparse.Namespace, rl: bool, base: dict[str, Any] | None) -> int:
    import functools

    import anyio

    from rlbus.ops.logging import configure_logging
    from rlbus.ops.runview import RunView, summary, write_png
    from rlbus.topology.launch import Launch

    started = time.monotonic()
    print(f"rlbus up: run {topology.run!r}, {len(topology.regions)} region(s), "
          f"{len(topology.instances())} actor(s), backend {args.backend or topology.launch.backend}", flush=True)
    view: Any = RunView(base_pass=base, target_steps=args.steps) if rl else _HeartbeatTable(sys.stdout.isatty())
    async with Launch.open(topology, state_dir=state) as launch:
        where = ", ".join(f"{r}={u[0]}" for r, u in launch.endpoints.urls.items())
        print(f"rlbus up: bus ready ({where}); state in {launch.state_dir}", flush=True)
        async with anyio.create_task_group() as tg:
            tg.start_soon(view.watch, launch.admin)
            await tg.start(lambda task_status: launch.run_actors(
                backend=args.backend, heartbeat_s=args.heartbeat_s, task_status=task_status,
                worker_setup=functools.partial(configure_logging, json=True)))
            tg.start_soon(_cancel_on_signal, tg.cancel_scope)
            if rl and args.steps is not None:
                tg.start_soon(_cancel_when, view.step_reached, tg.cancel_scope)
            if args.duration is not None:
                await anyio.sleep(args.duration)
                tg.cancel_scope.cancel()
        print(f"rlbus up: stopping: actors drained, servers stopping ({time.monotonic() - started:.0f}s)", flush=True)
        if rl:
            text = await _rl_summary(view, launch, topology, summary, write_png)
        else:
            text = view.summary(launch)
    print(text, flush=True)
    return 0


async def _rl_summary(view: Any, launch: Any, topology: Any, summary: Any, write_png: Any) -> str:
    import anyio

    from rlbus.actors.common.ledger import read_all, read_ledger
    from rlbus.messages.errors import RlbusError
    from rlbus.messages.schemas import EvalReport, TrainStep
    from rlbus.ops.final_eval import REPORT_NAME, final_evaluation, write_report
    from rlbus.topology.launch import read_fed_tasks
    import nats.errors
    import nats.js.errors

    bus = launch.admin
    s = bus.subjects
    book = None
    with anyio.move_on_after(60):      # the streams hold the truth, also for steps taken before this `up`
        view.steps = await read_all(bus.js, s.trainlog_stream(), s.trainlog(), TrainStep)
        view.evals = {r.policy_version: r for r in await read_all(bus.js, s.evals_stream(), s.evals(), EvalReport)}
        book = await read_ledger(bus)
    tasks = None
    with anyio.move_on_after(60):
        try:
            tasks = await read_fed_tasks(topology, bus)
        except (RlbusError, nats.errors.Error, nats.js.errors.Error, TimeoutError) as err:
            print(f"rlbus up: tasks not accounted: {err!r}", flush=True)
    if any(i.kind == "evaluator" for i in topology.instances()) and view.steps:
        ev = topology.evaluator
        print(f"rlbus up: evaluating the final checkpoint on the {ev.n_tasks} held-out tasks "
              f"(the evaluator's last report may be older)", flush=True)
        began = time.monotonic()
        try:
            view.final = await final_evaluation(bus, launch.state_dir, seed=ev.seed, n_tasks=ev.n_tasks,
                                                max_tokens=topology.generator.max_tokens,
                                                threads=topology.pretrain.threads)
        except RlbusError as err:
            print(f"rlbus up: final evaluation skipped: {err}", flush=True)
        if view.final is not None:
            report = write_report(view.final, view.evals.get(0), launch.state_dir / REPORT_NAME)
            print(f"rlbus up: final evaluation took {time.monotonic() - began:.0f}s; per family in {report}",
                  flush=True)
    png = write_png(view, launch.state_dir / "plots" / "progress.png")
    return summary(view, book, tasks) + f"\n  progress plot: {png}"


async def _cancel_when(event: Any, scope: Any) -> None:
    await event.wait()
    print("rlbus up: reached the requested number of steps: draining", flush=True)
    scope.cancel()


async def _cancel_on_signal(scope: Any) -> None:
    """Ctrl-C (SIGINT) or SIGTERM: cancel, which drains the actors and stops the servers."""
    import signal

    import anyio

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            print(f"rlbus up: {signal.Signals(signum).name}: draining", flush=True)
            scope.cancel()
            return


class _HeartbeatTable:
    """The bus demo's view: the latest heartbeat per actor, printed as a table every few seconds."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.latest: dict[str, Any] = {}

    async def watch(self, bus: Any) -> None:
        from contextlib import aclosing

        from rlbus.messages.schemas import Heartbeat

        last = 0.0
        async with aclosing(bus.follow(bus.subjects.all_health(), Heartbeat)) as beats:
            async for hb in beats:
                self.latest[hb.actor_id] = hb
                if time.monotonic() - last > (1.0 if self.tty else 5.0):
                    last = time.monotonic()
                    print(self.render(), flush=True)

    def render(self) -> str:
        now = time.time()
        rows = [("actor", "region", "kind", "state", "age", "counters")]
        for hb in sorted(self.latest.values(), key=lambda h: (h.region, h.actor_kind, h.actor_id)):
            counters = " ".join(f"{k}={v}" for k, v in sorted(hb.counters.items()))
            rows.append((hb.actor_id, hb.region, hb.actor_kind, hb.state, f"{now - hb.sent_at:.0f}s", counters))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        return "\n".join([time.strftime("%H:%M:%S"), *lines, ""])

    def summary(self, launch: Any) -> str:
        lines = ["rlbus up: summary"]
        totals: dict[str, int] = {}
        for hb in self.latest.values():
            for k, v in hb.counters.items():
                totals[f"{hb.actor_kind}.{k}"] = totals.get(f"{hb.actor_kind}.{k}", 0) + v
        for key in sorted(totals):
            lines.append(f"  {key} = {totals[key]}")
        sup = launch.supervisor
        if sup is not None:
            for actor_id, entry in sorted(sup.actors.items()):
                lines.append(f"  {actor_id}: {entry.state}, restarts {entry.restarts}")
        return "\n".join(lines)
