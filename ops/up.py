"""`rlbus up [FILE]`: launch a topology on this machine and show its progress until Ctrl-C.

Owns: the command line of `up` (topology file, state dir, --fresh, backend, --for, --steps, --record,
--tensorboard, --no-pretrained-cache), the first phase (a pretrained policy for a run with a trainer: kept, reused from the
shared cache `<parent>/pretrained/<settings digest>/` when identical settings were pretrained before, or
pretrained), the live view (RL progress lines from ops/runview.py, or a heartbeat table for the bus demo),
the recording of the run as it goes (--record), TensorBoard event files of what the view follows (--tensorboard or
`[logging] tensorboard`, written by ops/tensorboard.py), and the closing summary and PNGs
(`closing_plots`).
The work of starting servers, streams and actors is topology/backends/launch.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
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
PRETRAINED_CACHE = "pretrained"
"""Beside the state directories (`<parent of the state dir>/pretrained/<settings key>/`): pretrained bases
shared by every run whose pretraining settings are identical (model/training/pretrain.py `settings_key`)."""
ORIGIN_FILE = "origin.json"
"""In a cached base's folder: which run (and state directory) pretrained it."""
RECIPE_LOG = "recipe.jsonl"
"""In the state directory: one JSON object a line for each stage `rlbus up` ran (pretraining phases,
demonstrations, the base, RL, the closing evaluations) with its seconds; `--summary-json` repeats them."""
DEMOS_DIR = "demos"
"""In the state directory: the demonstrations of `[pretrain.demos]`, `<settings digest>.jsonl` and its report."""
CLOCK_TICK_S = 0.5
"""How often `--for`'s clock looks at the evaluators' heartbeats."""


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
                        "three_regions, ray, tiny, hf, agentic, demo)")
    p.add_argument("--state-dir", type=Path, default=None, help="run state directory (default ./.rlbus/<run>)")
    p.add_argument("--fresh", action="store_true", help="delete the run's state directory first and start over")
    p.add_argument("--backend", choices=["local", "ray"], default=None, help="override the topology's launch backend")
    p.add_argument("--for", dest="duration", type=float, default=None, metavar="SECONDS",
                   help="stop by itself after this many seconds of RL (default: run until Ctrl-C); pretraining, "
                        "demonstrations and the time an evaluator spends evaluating are not counted")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="stop by itself once the trainer has taken optimizer step N")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="actor heartbeat interval (default 1 s)")
    p.add_argument("--no-pretrained-cache", dest="pretrained_cache", action="store_false",
                   help="pretrain into the state directory even when a base with the same settings is cached "
                        f"(the cache: {PRETRAINED_CACHE}/<settings digest>/ beside the state directories)")
    p.add_argument("--record", type=Path, default=None, metavar="FILE",
                   help="record the run's streams into FILE as it goes (what `rlbus record` writes), complete "
                        "once the run has stopped")
    p.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                   help="write every step's and evaluation's figures, the generators' throughput and every actor's "
                        "heartbeat counters as TensorBoard event files under DIR (relative: to the working "
                        "directory); overrides the topology's [logging] tensorboard (relative: to the state "
                        "directory). Needs the metrics extra: pip install 'rlbus[metrics]'")
    p.add_argument("--summary-json", type=Path, default=None, metavar="FILE",
                   help="write the run's summary as one JSON object into FILE when it ends (also by --for or "
                        "--steps): steps, the ledger, every evaluation, and `base` and `final`: the held-out "
                        "evaluation of the starting policy and of the final checkpoint, with the same tasks and "
                        "samples per task (rlbus eval's keys)")
    p.set_defaults(handler=_handler)


def _handler(args: argparse.Namespace) -> int:
    import anyio

    from rlbus.ops.tensorboard import require_writer, tensorboard_dir
    from rlbus.topology.examples import example_path
    from rlbus.topology.file.load import load

    path = Path(args.topology)
    if not path.exists() and "/" not in args.topology:
        path = example_path(args.topology)
    topology = load(path)
    state = (args.state_dir or topology.state_path).resolve()
    args.tensorboard = tensorboard_dir(args.tensorboard, topology.logging.tensorboard, state)
    if args.tensorboard is not None:
        require_writer()                            # a missing extra stops the run before anything starts
    lock = hold_state_dir(state)
    try:
        if args.fresh:
            for child in state.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                elif child.name != LOCK_FILE:
                    child.unlink()
        rl = any(i.kind == "trainer" for i in topology.instances())
        base = _ensure_pretrained(topology, state, cache=args.pretrained_cache) if rl else None
        return int(anyio.run(_up, topology, state, args, rl, base, backend="asyncio"))
    finally:
        lock.close()


def hold_state_dir(state: Path, *, holder: str = "rlbus up") -> IO[str]:
    """Create `state` and take its lock for as long as the returned file stays open: two `rlbus up` on
    one state directory would run two servers on one JetStream store and corrupt it. `holder` names the
    command in the lock file (a stopped run opened read-only by `rlbus record` holds it too).

    :raises RlbusError: another process holds it (its pid and command are named).
    """
    from rlbus.messages.errors import RlbusError

    state.mkdir(parents=True, exist_ok=True)
    lock = open(state / LOCK_FILE, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        owner, _, command = (lock.read().strip() or "unknown").partition(" ")
        lock.close()
        raise RlbusError(f"state directory {state} is in use by another `{command or 'rlbus up'}` (pid {owner}); "
                         f"stop it first, or give this run another --state-dir") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n" if holder == "rlbus up" else f"{os.getpid()} {holder}\n")
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


def pretrained_cache(state: Path) -> Path:
    """The shared cache of pretrained bases for the state directory `state`: `<state>/../pretrained`."""
    return state.resolve().parent / PRETRAINED_CACHE


def _ensure_pretrained(topology: Any, state: Path, *, cache: bool = True) -> dict[str, Any] | None:
    """Make sure `<state>/pretrained/` holds a pretrained policy; returns its summary (pass@1).

    Kept when there; else copied from the shared cache when a base with identical settings was pretrained
    before (by any run), else pretrained into the cache, then copied. `cache=False` pretrains straight into
    the state directory and neither reads nor writes the cache."""
    from rlbus.model.training.phases import phases_done, run_phases
    from rlbus.model.training.pretrain import (
        CHECKPOINT_NAME,
        SUMMARY_NAME,
        PretrainConfig,
        eval_dict,
        pretrain,
        settings_key,
    )
    from rlbus.ops.pretrain import HF_CODE_FRACTION, PretrainPrinter, phases_of
    from rlbus.topology.backends.launch import policy_dir
    from rlbus.topology.file.schema import DEMOS_DATA

    policy = topology.policy
    out = policy_dir(topology, state)
    hf = policy.kind == "hf"
    made = ("config.json" if hf else CHECKPOINT_NAME, SUMMARY_NAME)
    settings = topology.pretrain
    phases = phases_of(settings)

    def complete(folder: Path) -> bool:         # a run of phases leaves a base after each phase: only the last counts
        return all((folder / name).exists() for name in made) and (not phases or phases_done(folder, phases))

    if policy.path and out.exists():             # the operator's own model: nothing to build
        print(f"rlbus up: policy {policy.kind} from {out}", flush=True)
        return _pass_summary(out / SUMMARY_NAME)
    if complete(out):
        print(f"rlbus up: pretrained policy found in {out}", flush=True)
        log_stage(state, "base", found="state", path=str(out))
        return _pass_summary(out / SUMMARY_NAME)
    demos_at = next((k for k, p in enumerate(phases) if p.kind == "sft" and p.data == DEMOS_DATA), None)
    # pretraining skips, and reports its base on, the evaluator's held-out set
    overrides: dict[str, Any] = {"task_seed": topology.evaluator.seed}
    if settings.eval_n is not None:
        overrides["eval_n"] = settings.eval_n
    recipe = policy.recipe
    if hf:
        assert recipe is not None                   # validate refuses kind 'hf' without a path or a recipe
        overrides["code_fraction"] = HF_CODE_FRACTION
    config = PretrainConfig.preset(recipe.size if recipe is not None else settings.preset, **overrides)
    if settings.max_seq_len is not None and recipe is None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, max_seq_len=settings.max_seq_len))
    steps = settings.steps or config.steps
    what = f"hf {recipe.architecture} {recipe.size}" if recipe is not None else settings.preset
    length = ", ".join(f"{p.name} {p.kind} {p.steps} steps" for p in phases) if phases else f"{steps} steps"
    with contextlib.ExitStack() as held:
        target = out
        if cache:
            key = settings_key(config, steps, settings.seed, settings.threads)
            if recipe is not None:              # the recipe is part of what decides the base
                key = hashlib.sha256(f"{key}:{recipe.architecture}:{recipe.size}".encode()).hexdigest()[:16]
            if phases:                          # so are the phases (their data by path), and the demonstrations
                demos = "" if demos_at is None else f":{demos_key(topology)}"
                key = hashlib.sha256(f"{key}:{phases!r}{demos}".encode()).hexdigest()[:16]
            target = pretrained_cache(state) / key
            held.enter_context(_cache_lock(target))
            if complete(target):
                _install(target, out, _base_files(target))
                print(f"rlbus up: reusing pretrained base {target} (same settings as {_origin(target)}); "
                      f"--no-pretrained-cache pretrains afresh", flush=True)
                log_stage(state, "base", found="cache", path=str(target))
                return _pass_summary(out / SUMMARY_NAME)
        print(f"rlbus up: no pretrained policy yet: pretraining ({what}, {length}, "
              f"{settings.threads} threads) into {target}", flush=True)
        if cache:
            target.mkdir(parents=True, exist_ok=True)
            (target / ORIGIN_FILE).write_text(json.dumps({"run": topology.run, "state_dir": str(state.resolve()),
                                                          "at": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        start = None
        if recipe is not None:
            from rlbus.model.training.pretrain import new_hf_policy
            from rlbus.ops.pretrain import _quiet_transformers

            _quiet_transformers()
            start = new_hf_policy(config, recipe.architecture, recipe.size, settings.seed,
                                  max_seq_len=config.model.max_seq_len, device=policy.device)
        printer = PretrainPrinter(sys.stdout, prefix="  pretrain ")
        if phases:                              # resumes after the last finished phase of an earlier attempt
            def phases_run(these: list[Any]) -> Any:
                began = time.monotonic()
                done = run_phases(config, these, settings.seed, target, settings.threads, printer, policy=start,
                                  device=policy.device)
                log_stage(state, "phases", seconds=round(time.monotonic() - began, 1), phases=[
                    {k: v for k, v in r.items() if k != "losses"} for r in done.phases],
                    eval=eval_dict(done.eval))
                return done

            if demos_at is not None:            # the phases before the demonstrations, then them, then the rest
                phases = _with_demos(topology, state, target, phases, demos_at, phases_run)
            result: Any = phases_run(phases)
        else:
            result = pretrain(config, steps, settings.seed, target, settings.threads, progress=printer,
                              policy=start, device=policy.device)
        if cache:
            _install(target, out, _base_files(target))
    ev = result.eval
    print(f"rlbus up: pretrained in {result.wall_s:.0f}s: held-out pass@1 {ev.pass_at_1:.3f} "
          f"[{ev.ci_low:.3f}, {ev.ci_high:.3f}] on {ev.n} tasks", flush=True)
    return _pass_summary(out / SUMMARY_NAME)


def log_stage(state: Path, stage: str, **fields: Any) -> None:
    """Append one stage's record (`RECIPE_LOG`) to the state directory."""
    with open(state / RECIPE_LOG, "a") as out:
        out.write(json.dumps({"stage": stage, "at": time.strftime("%Y-%m-%d %H:%M:%S"), **fields}) + "\n")


def read_stages(state: Path) -> list[dict[str, Any]]:
    """The records of `RECIPE_LOG`, in order (none when there is no log)."""
    try:
        lines = (state / RECIPE_LOG).read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def demos_settings(topology: Any) -> tuple[str, int, int, int]:
    """(source, n, seed, summary_at) of the topology's `[pretrain.demos]` (its defaults when unset), `summary_at`
    resolved: the table's, else `[generator.agentic] summary_at_tokens`, else where the environment summarises."""
    from rlbus.topology.file.schema import PretrainDemos

    demos = topology.pretrain.demos or PretrainDemos()
    agentic = topology.generator.agentic
    summary_at = demos.summary_at
    if summary_at is None:
        summary_at = getattr(agentic, "summary_at_tokens", 0) or agentic.max_tokens - agentic.min_turn_tokens
    return demos.source, demos.n, demos.seed, summary_at


def demos_key(topology: Any) -> str:
    """What the demonstrations and the sft phase on them depend on: `demos_settings` and the generator's agentic
    budgets and framing (demonstrations are cut and limited as its episodes are)."""
    from rlbus.ops.tasks_demos import demo_budgets

    agentic = topology.generator.agentic
    return repr((demos_settings(topology), demo_budgets(agentic), agentic.tool_list))


def _with_demos(topology: Any, state: Path, target: Path, phases: list[Any], at: int, phases_run: Any) -> list[Any]:
    """`phases` with every 'sft' phase of `data = "demos"` reading the demonstrations file of the state directory;
    the file is written once (kept for a later run with the same settings), after running `phases[:at]` (the
    scripted expert does not depend on the model; the order is the recipe's)."""
    from rlbus.messages.errors import RlbusError
    from rlbus.model.training.phases import marker_name
    from rlbus.ops.tasks_demos import demo_budgets
    from rlbus.topology.file.schema import DEMOS_DATA

    settings = demos_settings(topology)
    agentic = topology.generator.agentic
    digest = hashlib.sha256(demos_key(topology).encode()).hexdigest()[:16]
    path = state / DEMOS_DIR / f"{digest}.jsonl"
    if not path.is_file():
        if at and not all((target / marker_name(k, p)).is_file() for k, p in enumerate(phases[:at])):
            phases_run(phases[:at])
        report = _write_demos(path, *settings, tokenizer=target if topology.policy.kind == "hf" else None,
                              budgets=demo_budgets(agentic))
        log_stage(state, "demos", **report)
        if not report["demos"]:
            raise RlbusError(f"no demonstration of {settings[0]!r} passed its hidden tests "
                             f"({report['attempted']} episodes); the sft phase has nothing to train on")
    else:
        print(f"rlbus up: demonstrations found in {path}", flush=True)
        log_stage(state, "demos", found=str(path))
    return [dataclasses.replace(p, data=str(path), tool_list=agentic.tool_list,
                                observation_tokens=agentic.observation_tokens)
            if p.kind == "sft" and p.data == DEMOS_DATA else p for p in phases]


def _write_demos(path: Path, source: str, n: int, seed: int, summary_at: int, *, tokenizer: Path | None,
                 budgets: Any) -> dict[str, Any]:
    """Run the scripted expert (ops/tasks_demos.py, a sandbox supervisor served here) until `n` demonstrations of
    `source`'s training split pass; write their rows into `path` and return the report (demos, attempted,
    pass_rate, turns_mean, rows, summarized, seconds, path)."""
    import anyio

    from rlbus.model.tasks.sources import is_repo_source
    from rlbus.ops.tasks_demos import ATTEMPTS_PER_DEMO, DEFAULT_POOL, _counter, run_demos, training_tasks

    began = time.monotonic()
    tasks = training_tasks(source, seed, n * ATTEMPTS_PER_DEMO if is_repo_source(source) else 1 << 30)
    print(f"rlbus up: demonstrations: the scripted expert on up to {len(tasks)} tasks of {source!r} until {n} pass "
          f"(summary at {summary_at or 'never'} tokens)", flush=True)
    count = _counter(str(tokenizer) if tokenizer is not None and (tokenizer / "tokenizer.json").is_file() else None)
    run = anyio.run(run_demos, tasks, n, seed, summary_at, count, DEFAULT_POOL, budgets, backend="asyncio")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in run.rows), encoding="utf-8")
    tmp.replace(path)
    report = {**run.report(), "rows": len(run.rows), "summarized": run.summarized,
              "seconds": round(time.monotonic() - began, 1), "path": str(path)}
    print(f"rlbus up: demonstrations: {report['demos']} of {report['attempted']} episodes passed (pass rate "
          f"{report['pass_rate']:.2f}), {report['turns_mean']:.1f} turns each, {report['rows']} rows in {path}, "
          f"{report['seconds']:.0f}s", flush=True)
    return report


@contextlib.contextmanager
def _cache_lock(folder: Path) -> Any:
    """Hold `<folder>.lock` (flock): two `rlbus up` needing the same base pretrain it once, the second waits."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"rlbus up: waiting for another `rlbus up` that is pretraining the same base into {folder}",
                  flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _base_files(folder: Path) -> tuple[str, ...]:
    """The files of a pretrained base (a pretrain.pt and its summary, or a Hugging Face directory), not the cache's
    own bookkeeping."""
    return tuple(sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != ORIGIN_FILE
                        and not p.name.startswith(".")))


def _install(source: Path, out: Path, names: tuple[str, ...]) -> None:
    """Copy a cached base into the run's `pretrained/` (each file written under a temporary name, then renamed)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        tmp = out / f".{name}.tmp"
        shutil.copy2(source / name, tmp)
        tmp.replace(out / name)


def _origin(folder: Path) -> str:
    """'run NAME in STATE_DIR' from a cached base's origin.json ('an earlier run' when unreadable)."""
    try:
        doc = json.loads((folder / ORIGIN_FILE).read_text())
        return f"run {doc['run']!r} in {doc['state_dir']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "an earlier run"


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
    from rlbus.ops.runview import RunView

    started = time.monotonic()
    print(f"rlbus up: run {topology.run!r}, {len(topology.regions)} region(s), "
          f"{len(topology.instances())} actor(s), backend {args.backend or topology.launch.backend}", flush=True)
    view: Any = RunView(base_pass=base, target_steps=args.steps) if rl else _HeartbeatTable(sys.stdout.isatty())
    with contextlib.ExitStack() as closing:
        if args.tensorboard is not None:
            from rlbus.ops.tensorboard import TensorBoardSink

            view.sink = TensorBoardSink(args.tensorboard)
            closing.callback(view.sink.close)
            print(f"rlbus up: TensorBoard event files in {args.tensorboard} (tensorboard --logdir {args.tensorboard})",
                  flush=True)
        text = await _launched(topology, state, args, rl, view, started)
    print(text, flush=True)
    return 0


async def _launched(topology: Any, state: Path, args: argparse.Namespace, rl: bool, view: Any,
                    started: float) -> str:
    """Launch the topology, show `view` until the run is stopped, and return the closing summary."""
    import functools

    import anyio

    from rlbus.ops.logging import configure_logging
    from rlbus.ops.runview import summary, write_png
    from rlbus.topology.backends.launch import Launch

    async with Launch.open(topology, state_dir=state) as launch:
        where = ", ".join(f"{r}={u[0]}" for r, u in launch.endpoints.urls.items())
        print(f"rlbus up: bus ready ({where}); state in {launch.state_dir}", flush=True)
        if (line := links_line(launch.regions, topology)) is not None:
            print(line, flush=True)
        finish = anyio.Event()
        async with anyio.create_task_group() as recording:
            if args.record is not None:
                await recording.start(_record_run, launch.state_dir, args.record, finish)
            async with anyio.create_task_group() as tg:
                tg.start_soon(view.watch, launch.admin)
                await tg.start(lambda task_status: launch.run_actors(
                    backend=args.backend, heartbeat_s=args.heartbeat_s, task_status=task_status,
                    worker_setup=functools.partial(configure_logging, json=True)))
                tg.start_soon(_cancel_on_signal, tg.cancel_scope)
                if rl and args.steps is not None:
                    tg.start_soon(_cancel_when, view.step_reached, tg.cancel_scope)
                clock = RunClock(args.duration)
                tg.start_soon(_follow_clock, clock, view, tg.cancel_scope)
                tg.start_soon(_follow_feed, view, topology)
            finish.set()        # the actors are gone: the recording takes what the streams hold and ends
        print(f"rlbus up: stopping: actors drained, servers stopping ({time.monotonic() - started:.0f}s)", flush=True)
        if rl:
            log_stage(state, "rl", seconds=round(clock.wall, 1), counted_s=round(clock.counted, 1),
                      evaluating_s=round(clock.evaluating, 1), limit_s=args.duration, steps=len(view.steps))
        if rl:
            return await _rl_summary(view, launch, topology, summary, write_png, args, started)
        return str(view.summary(launch))


def links_line(regions: Any, topology: Any) -> str | None:
    """One line on the run's shaped links: which regions sit behind which link, or why they run on loopback
    (this host cannot make network namespaces); None when the topology asks for none."""
    shaped = {r.name: r.link for r in topology.regions if r.link is not None and r.role != "hub"}
    if not shaped or regions is None:
        return None
    if regions.links_skipped is not None:
        return (f"rlbus up: [regions.link] of {', '.join(shaped)} ignored: {regions.links_skipped}; "
                f"running on loopback, unshaped")
    parts = [f"{name}={link.bandwidth or 'unshaped'}/{link.latency}"
             + (f"±{link.jitter}" if link.jitter not in ("0ms", "0s", "0us") else "")
             + (f" loss {link.loss}" if link.loss.rstrip("%").strip("0.") else "")
             + f" ({regions.netns(name)})" for name, link in shaped.items()]
    return f"rlbus up: shaped links to {topology.hub.name}: {', '.join(parts)}"


async def _rl_summary(view: Any, launch: Any, topology: Any, summary: Any, write_png: Any,
                      args: argparse.Namespace | None = None, started: float | None = None) -> str:
    import anyio
    import nats.errors
    import nats.js.errors

    from rlbus.actors.common.ledger import read_all, read_ledger
    from rlbus.messages.errors import RlbusError
    from rlbus.messages.schemas import EvalReport, TrainStep
    from rlbus.ops.final_eval import REPORT_NAME, HeldOut, final_evaluation, write_report
    from rlbus.topology.backends.launch import read_fed_tasks

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
    summary_json = getattr(args, "summary_json", None)
    held = HeldOut.of(topology)
    if (any(i.kind == "evaluator" for i in topology.instances()) or summary_json is not None) and view.steps:
        ev = topology.evaluator
        print(f"rlbus up: evaluating the final checkpoint on the {ev.n_tasks} held-out tasks "
              f"(the evaluator's last report may be older)", flush=True)
        began = time.monotonic()
        try:
            view.final = await final_evaluation(bus, launch.state_dir, seed=ev.seed, n_tasks=ev.n_tasks,
                                                max_tokens=topology.generator.max_tokens,
                                                threads=topology.pretrain.threads, tasks=ev.tasks, held=held)
        except RlbusError as err:
            print(f"rlbus up: final evaluation skipped: {err}", flush=True)
        if view.final is not None:
            report = write_report(view.final, view.evals.get(0), launch.state_dir / REPORT_NAME)
            print(f"rlbus up: final evaluation took {time.monotonic() - began:.0f}s; per family in {report}",
                  flush=True)
            log_stage(launch.state_dir, "final_eval", seconds=round(time.monotonic() - began, 1))
    base = None
    if summary_json is not None:
        began = time.monotonic()
        base = await _base_report(view, topology, launch.state_dir, held)
        log_stage(launch.state_dir, "base_eval", seconds=round(time.monotonic() - began, 1),
                  version_0_report=base is not None and base is view.evals.get(0))
    png = write_png(view, launch.state_dir / "plots" / "progress.png")
    text = summary(view, book, tasks) + f"\n  progress plot: {png}"
    for name, path in closing_plots(view, base, png.parent, run=topology.run).items():
        text += f"\n  {name}: {path}"
    if summary_json is not None:
        doc = summary_doc(view, book, tasks, base, run=topology.run, state_dir=launch.state_dir,
                          seconds=None if started is None else time.monotonic() - started)
        summary_json.parent.mkdir(parents=True, exist_ok=True)
        summary_json.write_text(json.dumps(doc, indent=1) + "\n")
        text += f"\n  summary JSON: {summary_json}"
    return text


def closing_plots(view: Any, base: Any, out_dir: Path, *, run: str) -> dict[str, Path]:
    """The PNGs beside progress.png, by what the summary calls them: `accuracy_cost.png` when a report scored
    agentic episodes (policy tokens), `pass_at_k.png` (ops/recording/plotting.py `pass_at_k_series`: greedy pass@1,
    mean@K and pass@k with their intervals per evaluated version, the closing evaluations apart) when a report
    carries pass@k. `base`: the starting policy's closing evaluation; drawn apart only when it is not the
    evaluator's version-0 report."""
    from rlbus.ops.recording.plotting import PlotData, render_all

    final = getattr(view.final, "report", None)
    evals = list(view.evals.values())
    apart = None if base is None or base is view.evals.get(0) else base
    out: dict[str, Path] = {}
    if any(r.policy_tokens_mean is not None for r in [*evals, *([final] if final else [])]):
        data = PlotData(run=run, evals=[*evals, *([final] if final else [])])
        (out["accuracy against cost"],) = render_all(data, out_dir, names=["accuracy_cost"])
    if any(r.pass_at_k for r in [*evals, *(r for r in (final, apart) if r is not None)]):
        data = PlotData(run=run, evals=evals, base=apart, final=final)
        (out["pass@1 and pass@k per version"],) = render_all(data, out_dir, names=["pass_at_k"])
    return out


async def _base_report(view: Any, topology: Any, state: Path, held: Any) -> Any:
    """The starting policy's held-out evaluation for `--summary-json`: the evaluator's report of version 0 when it
    scored the same tasks with the same samples per task as the closing evaluation, else the starting policy
    scored now as the final checkpoint was (ops/final_eval.py `base_evaluation`); None when it cannot be."""
    from rlbus.messages.errors import RlbusError
    from rlbus.ops.final_eval import base_evaluation
    from rlbus.topology.backends.launch import policy_dir

    v0 = view.evals.get(0)
    final = getattr(view.final, "report", None)
    if v0 is not None and (v0.source, v0.samples, v0.task_seed) == (held.tasks, held.samples, held.seed) and (
            final is None or final.n == v0.n):
        return v0
    print("rlbus up: evaluating the starting policy on the same held-out tasks (for --summary-json)", flush=True)
    try:
        return await base_evaluation(policy_dir(topology, state), held)
    except RlbusError as err:
        print(f"rlbus up: starting policy not evaluated: {err}", flush=True)
        return None


def summary_doc(view: Any, book: Any, tasks: Any, base: Any, *, run: str, state_dir: Path,
                seconds: float | None) -> dict[str, Any]:
    """`--summary-json`'s object: run, steps (optimizer steps taken), final_version, the ledger of rollouts
    (produced, trained, lost, trained_twice: counts; clean), that of the fed tasks, every evaluation the
    evaluator published (by version), `base` / `final`: the held-out evaluation of the starting policy and
    of the final checkpoint (actors/common/eval_report.py `report_keys`; null when not made), and `stages`: the
    state directory's stage records (`RECIPE_LOG`: pretraining phases, demonstrations, RL, evaluations, seconds)."""
    from rlbus.actors.common.eval_report import report_keys

    ledger = None if book is None else {
        "produced": book.produced, "trained": book.trained, "lost": len(book.lost),
        "trained_twice": len(book.trained_twice), "dropped": dict(book.dropped), "pending": len(book.pending),
        "clean": bool(book.clean)}
    fed = None if tasks is None else {"fed": tasks.fed, "rolled_out": tasks.rolled_out,
                                      "dead_lettered": tasks.dead_lettered, "pending": tasks.pending,
                                      "lost": len(tasks.lost), "clean": bool(tasks.clean)}
    final = None
    report = getattr(view.final, "report", None)
    if report is not None:
        final = {**report_keys(report), "step": view.final.step}
    return {"run": run, "state_dir": str(state_dir), "steps": len(view.steps),
            "final_version": view.steps[-1].policy_version if view.steps else None,
            "seconds": None if seconds is None else round(seconds, 1), "ledger": ledger, "tasks": fed,
            "evaluations": [report_keys(view.evals[v]) for v in sorted(view.evals)],
            "base": None if base is None else report_keys(base), "final": final, "stages": read_stages(state_dir)}


async def _record_run(state: Path, output: Path, finish: Any, *, task_status: Any) -> None:
    """`--record FILE`: record the run's hub streams (as `rlbus record --follow` would, as the observer) from
    the start of the actors until `finish`, then everything they hold by then; says where it went."""
    from rlbus.ops.recording.recorder import record
    from rlbus.ops.target import for_state_dir

    output.parent.mkdir(parents=True, exist_ok=True)
    async with await for_state_dir(state).connect(name="rlbus-up-record") as bus:
        print(f"rlbus up: recording the run's streams into {output}", flush=True)
        task_status.started()
        progress = await record(bus, output, follow=True, finish=finish)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(progress.counts.items()))
    print(f"rlbus up: recording written to {output}: {progress.total} messages ({counts})", flush=True)


class RunClock:
    """`--for`'s clock: the run's seconds while no evaluator is evaluating (the seconds between two looks count
    as the first look saw them), so the limit bounds RL, not evaluations."""

    def __init__(self, limit: float | None) -> None:
        self.limit = limit
        self.wall = 0.0
        self.counted = 0.0
        self.evaluating = 0.0
        self._last: tuple[float, bool] | None = None

    def tick(self, now: float, evaluating: bool) -> bool:
        """Note a look at monotonic time `now`, when an evaluator was (or not) evaluating; True once the counted
        seconds reach the limit."""
        if self._last is not None:
            then, busy = self._last
            self.wall += now - then
            if busy:
                self.evaluating += now - then
            else:
                self.counted += now - then
        self._last = (now, evaluating)
        return self.limit is not None and self.counted >= self.limit


def evaluating(beats: Any, now: float, *, fresh_s: float = 30.0) -> bool:
    """Whether an evaluator's latest heartbeat (of the last `fresh_s` seconds, wall clock `now`) says it is busy."""
    return any(b.actor_kind == "evaluator" and b.state == "busy" and now - b.sent_at < fresh_s
               for b in beats.values())


async def _follow_clock(clock: RunClock, view: Any, scope: Any) -> None:
    """Tick `clock` from `view`'s heartbeats until the run is cancelled; cancel `scope` once it is spent."""
    import anyio

    beats = getattr(view, "beats", None)
    if beats is None:
        beats = getattr(view, "latest", {})
    while True:
        if clock.tick(time.monotonic(), evaluating(beats, time.time())):
            print(f"rlbus up: --for {clock.limit:g}s of RL spent ({clock.wall:.0f}s since the actors started, "
                  f"{clock.evaluating:.0f}s of them evaluating): draining", flush=True)
            scope.cancel()
            return
        await anyio.sleep(CLOCK_TICK_S)


def feed_exhausted_line(beats: Any, topology: Any) -> str | None:
    """The line saying that a feeder has fed all the tasks of its finite source (its heartbeat's gauge `exhausted`:
    actors/feeder.py), or None while none has."""
    for beat in beats.values():
        if beat.actor_kind == "feeder" and "exhausted" in beat.gauges:
            feeder = topology.feeder
            source = feeder.tasks_file if feeder.tasks_file is not None else feeder.tasks
            return (f"rlbus up: the feeder fed all {beat.gauges['exhausted']:.0f} tasks of {source}; no more follow: "
                    f"RL idles once they are trained (feeder.epochs, feeder.max_tasks)")
    return None


async def _follow_feed(view: Any, topology: Any) -> None:
    """Print `feed_exhausted_line` once, when a feeder's heartbeat first says so; until the run is cancelled."""
    import anyio

    beats = getattr(view, "beats", None)
    if beats is None:
        beats = getattr(view, "latest", {})
    while True:
        if (line := feed_exhausted_line(beats, topology)) is not None:
            print(line, flush=True)
            return
        await anyio.sleep(CLOCK_TICK_S)


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
        self.sink: Any = None
        """Where heartbeats are also written (ops/tensorboard.py `TensorBoardSink`); None: nowhere."""

    async def watch(self, bus: Any) -> None:
        from contextlib import aclosing

        from rlbus.messages.schemas import Heartbeat

        last = 0.0
        async with aclosing(bus.follow(bus.subjects.all_health(), Heartbeat)) as beats:
            async for hb in beats:
                self.latest[hb.actor_id] = hb
                if self.sink is not None:
                    self.sink.write(hb)
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
