"""Cross-field rules of a topology: the checks no single key's type can express.

Owns: `check(topology) -> list[Problem]`, pure (the only input besides the topology is the local
core count, passed in), collecting every problem: hub count, unique names, the trainer side in the
hub, counts that must fit together, references to regions, credentials by reference only, TLS files that
belong together, shaped links only on embedded leaves, and the torch-threads-per-host warning (unless
`launch.oversubscribe`).
Does not: read files or check key types (topology/file/_walk.py).
"""

from __future__ import annotations

import difflib
import os
import re
from collections import defaultdict
from collections.abc import Iterator
from typing import Final

import msgspec

from rlbus.actors.common.config import feeder_tasks_problem, names_task_file
from rlbus.actors.common.curriculum import takes_curriculum
from rlbus.topology.file.problem import Problem, Severity
from rlbus.topology.file.schema import DEMO_KINDS, TORCH_KINDS, ActorSpec, Region, Topology, parse_duration
from rlbus.topology.network.links import parse_percent, parse_time
from rlbus.topology.network.regions import CLUSTER_NODES

BUILTIN_CONTEXT: Final = 512
"""The built-in policy's context when `[pretrain] max_seq_len` is not set (model/training/pretrain.py presets)."""
REPO_FIRST_CONTEXT: Final = 750
"""About the longest first context of a built-in repository task for the byte tokenizer, compact tool list."""
REPO_CONTEXT: Final = 1024
"""Context below which the built-in policy cannot take a useful turn of a repository task."""

_INLINE_CREDENTIALS: Final = re.compile(r"^[a-z]+://[^/@]*@")
_LOCAL_HOSTS: Final = frozenset({"localhost", "127.0.0.1", "::1"})
_HUB_ONLY: Final = ("trainer", "publisher", "checkpointer")
_WHY: Final = {
    "trainer": "the run trains one policy",
    "publisher": "it turns each trainer version into weights for the generators",
    "checkpointer": "the trainer acks rollouts only once a checkpoint covers them",
    "feeder": "it assigns each task to exactly one region",
    "evaluator": "two would evaluate the same versions twice",
}


Found = tuple[Problem, frozenset[str]]
"""A problem and the top-level sections (`regions`, `trainer`, ...) whose values it depends on."""


def check(topology: Topology, *, local_cores: int | None = None) -> list[Problem]:
    """Every cross-field problem of `topology`, errors and warnings, in a stable order.

    `local_cores` is the core count of this machine for the torch-threads warning (default
    `os.cpu_count()`); pass it explicitly to make the result independent of the machine.
    """
    return [problem for problem, _ in check_sections(topology, local_cores=local_cores)]


def check_sections(topology: Topology, *, local_cores: int | None = None) -> list[Found]:
    """`check()` with, for each problem, the top-level sections it depends on.

    `validate()` uses the sections to drop rule problems that rest on a value already reported as bad
    (that value was replaced by its default, so the rule would be judging the default).
    """
    cores = local_cores if local_cores is not None else (os.cpu_count() or 1)
    out: list[Found] = []
    out += _regions(topology)
    out += _actor_names(topology)
    if not _is_bus_demo(topology):          # a bus demo has no trainer side or generators by design
        out += _singletons(topology)
        out += _workers(topology)
    out += _region_weights(topology)
    out += _settings(topology)
    out += _servers(topology)
    out += _tls(topology)
    out += _links(topology)
    out += _threads(topology, cores)
    return out


def _largest_context(topology: Topology) -> int:
    """Cache slots one episode's turn can need (its context and the turn): the policy's context where the topology
    gives it (the built-in policy, or one a recipe builds), else what the generator's settings allow, capped by it
    (a repository task's `[generator.agentic] max_tokens`; a function task's context_budget + max_tokens)."""
    policy, gen = topology.policy, topology.generator
    context = topology.pretrain.context if policy.kind == "builtin" or policy.recipe is not None else None
    repo = topology.feeder.tasks not in ("builtin", "humaneval")
    episode = gen.agentic.max_tokens if repo else (gen.context_budget + gen.max_tokens if gen.context_budget else 0)
    if context is None:
        return episode or gen.max_tokens
    return min(episode, context) if episode else context


def _is_bus_demo(topology: Topology) -> bool:
    kinds = {spec.kind for region in topology.regions for spec in region.actors}
    return bool(kinds) and kinds <= DEMO_KINDS


def _p(key: str, message: str, severity: Severity = "error", *, also: tuple[str, ...] = ()) -> Found:
    section = key.split(".")[0].split("[")[0]
    return Problem(key=key, message=message, severity=severity), frozenset({section, *also})


def _entries(topology: Topology) -> Iterator[tuple[int, Region, int, ActorSpec]]:
    for i, region in enumerate(topology.regions):
        for j, spec in enumerate(region.actors):
            yield i, region, j, spec


def _count(region: Region, *kinds: str) -> int:
    return sum(spec.count for spec in region.actors if spec.kind in kinds)


def _hub_index(topology: Topology) -> int | None:
    return next((i for i, r in enumerate(topology.regions) if r.role == "hub"), None)


def _regions(topology: Topology) -> Iterator[Found]:
    seen: dict[str, int] = {}
    for i, region in enumerate(topology.regions):
        if region.name in seen:
            yield _p(f"regions[{i}].name", f"duplicate region name {region.name!r} (also regions[{seen[region.name]}]"
                     "); expected each region to have its own name")
        seen.setdefault(region.name, i)
    hubs = [i for i, r in enumerate(topology.regions) if r.role == "hub"]
    if not hubs:
        yield _p("regions", 'no hub: expected exactly one region with role = "hub" (the one that runs the '
                 'trainer), found only leaf regions')
    for i in hubs[1:]:
        yield _p(f"regions[{i}].role", f"a second hub; regions[{hubs[0]}] ({topology.regions[hubs[0]].name!r}) is "
                 'already the hub: expected exactly one hub, set role = "leaf" here')
    for i, region in enumerate(topology.regions):
        if region.role == "leaf" and not any(spec.count for spec in region.actors):
            yield _p(f"regions[{i}].actors", f"leaf region {region.name!r} runs no actor; its server would idle",
                     "warning")


def _actor_names(topology: Topology) -> Iterator[Found]:
    for i, region in enumerate(topology.regions):
        seen: dict[str, int] = {}
        for j, spec in enumerate(region.actors):
            if spec.label in seen:
                field = "name" if spec.name is not None else "kind"
                yield _p(f"regions[{i}].actors[{j}].{field}",
                         f"duplicate actor name {spec.label!r} in region {region.name!r} (also "
                         f"regions[{i}].actors[{seen[spec.label]}]); give each entry a distinct `name`, or merge "
                         "them into one entry with a larger count")
            seen.setdefault(spec.label, j)
    owners: dict[str, str] = {}
    for instance in topology.instances():
        other = owners.setdefault(instance.actor_id, instance.region)
        if other != instance.region:
            yield _p("regions", f"actor id {instance.actor_id!r} comes out of both region {other!r} and region "
                     f"{instance.region!r}; rename one of the regions or actor entries")


def _singletons(topology: Topology) -> Iterator[Found]:
    hub = _hub_index(topology)
    hub_key = f"regions[{hub}].actors" if hub is not None else "regions"
    for kind in ("trainer", "publisher", "checkpointer", "feeder", "evaluator"):
        where = [(i, r, j, s) for i, r, j, s in _entries(topology) if s.kind == kind and s.count > 0]
        if not where and kind != "evaluator":
            place = "the hub region" if kind in _HUB_ONLY else "one region"
            yield _p(hub_key, f'no {kind}: expected exactly one [[regions.actors]] kind = "{kind}" with count = 1 '
                     f"in {place} ({_WHY[kind]})")
        for n, (i, region, j, spec) in enumerate(where):
            key = f"regions[{i}].actors[{j}]"
            if n > 0:
                fi, _, fj, _ = where[0]
                yield _p(f"{key}.kind", f"a second {kind} entry (the first is regions[{fi}].actors[{fj}]); expected "
                         f"at most one {kind} per run: {_WHY[kind]}")
            elif spec.count > 1:
                more = ("; to share each step across processes set [trainer] world_size = N instead"
                        if kind == "trainer" else "")
                yield _p(f"{key}.count", f"expected count = 1 for the {kind} ({_WHY[kind]}), found {spec.count}{more}")
            if kind in _HUB_ONLY and hub is not None and region.role != "hub":
                yield _p(f"{key}.kind", f"the {kind} must run in the hub region {topology.regions[hub].name!r}, "
                         f"found it in leaf region {region.name!r}")


def _workers(topology: Topology) -> Iterator[Found]:
    generator_entries = [(i, j) for i, _, j, s in _entries(topology) if s.kind == "generator"]
    if not sum(_count(r, "generator") for r in topology.regions):
        if generator_entries:
            i, j = generator_entries[0]
            yield _p(f"regions[{i}].actors[{j}].count", "0 generators in the whole run: expected count >= 1 in at "
                     "least one region, or no task is ever worked on")
        else:
            yield _p("regions", 'no generator: expected [[regions.actors]] kind = "generator" with count >= 1 in at '
                     "least one region")
    for i, region in enumerate(topology.regions):
        users = [k for k in ("generator", "evaluator") if _count(region, k)]
        if users and not _count(region, "sandbox"):
            yield _p(f"regions[{i}].actors", f"region {region.name!r} has {' and '.join(u + 's' for u in users)} "
                     'but no sandbox: they run code on the sandboxes of their own region; expected a [[regions.actors]] '
                     'kind = "sandbox" with count >= 1 here')
        if _count(region, "sandbox") and not users:
            yield _p(f"regions[{i}].actors", f"region {region.name!r} has sandboxes but no generator or evaluator "
                     "to use them", "warning")


def _region_weights(topology: Topology) -> Iterator[Found]:
    weights = topology.feeder.region_weights
    if not weights:
        return
    names = [r.name for r in topology.regions]
    for name, weight in weights.items():
        key = f"feeder.region_weights.{name}"
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else "regions are: " + ", ".join(names)
            yield _p(key, f"unknown region {name!r}; {hint}", also=("regions",))
        elif weight > 0 and not _count(topology.region(name), "generator"):
            yield _p(key, f"region {name!r} gets tasks (weight {weight}) but has no generator to work on them",
                     also=("regions",))
    if all(w == 0 for w in weights.values()):
        yield _p("feeder.region_weights", "every weight is 0: expected at least one region with a weight > 0")
    for region in topology.regions:
        if _count(region, "generator") and weights.get(region.name, 0) == 0:
            yield _p("feeder.region_weights", f"region {region.name!r} has generators but gets no tasks (weight 0 "
                     "or missing)", "warning", also=("regions",))


def _settings(topology: Topology) -> Iterator[Found]:
    gen, trainer, sandbox = topology.generator, topology.trainer, topology.sandbox
    if trainer.batch_rollouts < gen.group_size:
        yield _p("trainer.batch_rollouts", f"{trainer.batch_rollouts} rollouts cannot hold one whole group of "
                 f"generator.group_size = {gen.group_size}; expected batch_rollouts >= group_size", also=("generator",))
    elif trainer.batch_rollouts % gen.group_size:
        yield _p("trainer.batch_rollouts", f"{trainer.batch_rollouts} is not a multiple of generator.group_size = "
                 f"{gen.group_size}; batches will split groups", "warning", also=("generator",))
    if gen.max_group_size and (gen.max_group_size <= gen.group_size or gen.max_group_size % gen.group_size):
        yield _p("generator.max_group_size", f"{gen.max_group_size} is not a multiple of group_size = "
                 f"{gen.group_size} above it; expected 0 (groups never grow) or 2, 3, ... times group_size")
    agentic = gen.agentic
    if agentic.summary_at_tokens and agentic.summary_at_tokens + agentic.min_turn_tokens > agentic.max_tokens:
        yield _p("generator.agentic.summary_at_tokens", f"{agentic.summary_at_tokens} + min_turn_tokens = "
                 f"{agentic.min_turn_tokens} > max_tokens = {agentic.max_tokens}: no summary could ever be asked for; "
                 f"expected 0 (off) or at most max_tokens - min_turn_tokens")
    if gen.kv_cache_tokens and gen.kv_cache_tokens < (largest := _largest_context(topology)):
        yield _p("generator.kv_cache_tokens", f"{gen.kv_cache_tokens} cache slots cannot hold one episode's largest "
                 f"context ({largest} tokens with these settings): its turns could never run; expected 0 (room for "
                 f"every row sampled at once) or at least {largest}")
    if trainer.staleness_versions == 0:
        yield _p("trainer.staleness_versions", "0 drops every rollout that saw a weight update while it was "
                 "generated; expect most rollouts dropped", "warning")
    penalty = trainer.length_penalty
    if penalty.coef > 0 and penalty.form == "convex" and penalty.budget >= gen.max_tokens:
        yield _p("trainer.length_penalty.budget", f"budget {penalty.budget} >= generator.max_tokens = "
                 f"{gen.max_tokens}: the length penalty can never apply", "warning", also=("generator",))
    if penalty.coef > 0 and penalty.form == "concave":
        if not any(msgspec.structs.asdict(penalty.weights).values()):
            yield _p("trainer.length_penalty.weights", "every weight is 0: the concave length penalty can never "
                     "apply; expected at least one weight > 0", "warning")
        elif penalty.weights.tool_call_tokens > 0:
            yield _p("trainer.length_penalty.weights.tool_call_tokens", "generators do not record tool-call tokens "
                     "yet (Rollout.tool_call_tokens): they count 0", "warning")
    if trainer.mtp_distill > 0 and topology.policy.kind == "hf":
        yield _p("trainer.mtp_distill", "a Hugging Face policy's MTP heads are a file sent to generators once "
                 "(mtp_heads.safetensors), not part of a version, so they cannot follow the policy during RL; "
                 "expected 0", also=("policy",))
    if gen.speculative and topology.policy.kind == "builtin" and not any(p.mtp_heads for p in topology.pretrain.phases):
        yield _p("generator.speculative", "the built-in policy gets MTP heads only from a [[pretrain.phases]] phase "
                 "with mtp_heads, and no phase has any: generators will sample plainly; expected a phase with "
                 "mtp_heads > 0, or false", "warning", also=("pretrain",))
    if trainer.mtp_distill > 0 and trainer.world_size > 1:
        yield _p("trainer.mtp_distill", f"the MTP heads are distilled by a one-rank trainer only, found world_size "
                 f"{trainer.world_size}; expected 0 or trainer.world_size = 1")
    weights = topology.weights
    if weights.keep_versions < weights.full_every:
        yield _p("weights.keep_versions", f"expected keep_versions >= weights.full_every = {weights.full_every}, "
                 f"found {weights.keep_versions}: a generator that starts late could not rebuild the latest version "
                 "(its full snapshot would be deleted)")
    restart = topology.restart
    if restart.backoff_initial_s > restart.backoff_max_s:
        yield _p("restart.backoff_initial_s", f"expected backoff_initial_s <= restart.backoff_max_s = "
                 f"{restart.backoff_max_s}, found {restart.backoff_initial_s}")
    if sandbox.cpu_seconds > sandbox.wall_seconds:
        yield _p("sandbox.cpu_seconds", f"{sandbox.cpu_seconds} CPU seconds can never be used within "
                 f"sandbox.wall_seconds = {sandbox.wall_seconds}", "warning")
    if sandbox.concurrency > sandbox.pool_size:
        yield _p("sandbox.concurrency", f"concurrency {sandbox.concurrency} > sandbox.pool_size = "
                 f"{sandbox.pool_size}: requests beyond the pool only queue", "warning")
    feeder = topology.feeder
    if (problem := feeder_tasks_problem(feeder.tasks)) is not None:
        yield _p("feeder.tasks", problem)
    if feeder.tasks != "builtin" and feeder.tasks_file is not None:
        yield _p("feeder.tasks", f"{feeder.tasks!r} and feeder.tasks_file = {feeder.tasks_file!r} both name the "
                 "training tasks; remove one of them", also=("feeder.tasks_file",))
    context = topology.pretrain.context          # after its long-context phase, if any
    repo = feeder.tasks not in ("builtin", "humaneval")      # the built-in repository tasks or a repository task file
    if repo and topology.policy.kind == "builtin" and context < REPO_CONTEXT:
        yield _p("feeder.tasks", f"the built-in policy's context is {context} tokens and a repository task's first "
                 f"context alone takes up to about {REPO_FIRST_CONTEXT} (with the compact tool list): tasks that "
                 f"leave no room for a turn are dead-lettered; set [pretrain] max_seq_len = 2048, or extend the context "
                 f"to 2048 in a 'long_context' phase (topology/examples/agentic.toml does)",
                 "warning", also=("pretrain.max_seq_len",))
    if repo and feeder.levels:
        yield _p("feeder.levels", f"levels {feeder.levels} select among the function-writing tasks only; the "
                 f"repository tasks take their level in feeder.tasks ('repo:LEVEL')", also=("feeder.tasks",))
    if feeder.tasks == "humaneval" and feeder.levels:
        yield _p("feeder.levels", f"levels {feeder.levels} select among the built-in function-writing family only, "
                 f"not HumanEval's problems; remove them", also=("feeder.tasks",))
    listed = feeder.tasks_file is not None or feeder.tasks == "humaneval" or names_task_file(feeder.tasks)
    if feeder.epochs and not listed:
        yield _p("feeder.epochs", f"epochs {feeder.epochs} repeat a listed source (feeder.tasks_file, a repository task "
                 f"file, 'humaneval'); feeder.tasks {feeder.tasks!r} is endless: remove it", "warning",
                 also=("feeder.tasks",))
    if feeder.levels and feeder.tasks_file is not None:
        yield _p("feeder.levels", f"levels {feeder.levels} select among the built-in tasks only, but feeder.tasks_file "
                 f"= {feeder.tasks_file!r} is set; remove one of them", also=("feeder.tasks_file",))
    if feeder.curriculum is not None:
        if not takes_curriculum(feeder.tasks) or feeder.tasks_file is not None:
            yield _p("feeder.curriculum", f"a curriculum draws the levels of the built-in tasks ('builtin', or 'repo' "
                     f"and its splits 'repo:train', 'repo:heldout'), "
                     f"not of feeder.tasks {feeder.tasks!r}" + (f" or feeder.tasks_file {feeder.tasks_file!r}"
                                                             if feeder.tasks_file is not None else ""),
                     also=("feeder.tasks",))
        if feeder.levels:
            yield _p("feeder.curriculum", f"feeder.levels {feeder.levels} fixes the levels a curriculum would choose "
                     "among; remove one of them", also=("feeder.levels",))
    if names_task_file(feeder.tasks) and feeder.tasks == topology.evaluator.tasks:
        yield _p("evaluator.tasks", f"the held-out set is feeder.tasks {feeder.tasks!r} itself; give the evaluator "
                 f"another source", also=("feeder.tasks",))
    if feeder.tasks_file is not None and feeder.tasks_file == topology.evaluator.tasks:
        yield _p("evaluator.tasks", f"the held-out set is feeder.tasks_file {feeder.tasks_file!r} itself: training "
                 f"skips every held-out prompt, so it would draw nothing; give the evaluator another source",
                 also=("feeder.tasks_file",))
    ahead, group, batch = feeder.max_rollouts_ahead, topology.generator.group_size, topology.trainer.batch_rollouts
    if ahead is not None and ahead < group:
        yield _p("feeder.max_rollouts_ahead", f"{ahead} rollouts is less than one task's group "
                 f"(generator.group_size = {group}): no task would ever be fed; expected at least "
                 f"{max(group, 2 * batch)} (about 2 x trainer.batch_rollouts)", also=("generator.group_size",))
    elif ahead is not None and ahead < batch:
        yield _p("feeder.max_rollouts_ahead", f"{ahead} rollouts is less than one step's batch "
                 f"(trainer.batch_rollouts = {batch}): the trainer would wait on the generators every step; "
                 f"expected about {2 * batch}", "warning", also=("trainer.batch_rollouts",))
    held = max((sum(spec.count for spec in region.actors if spec.kind == "generator") for region in topology.regions),
               default=0) * topology.generator.tasks_held
    if not feeder.lockstep and feeder.backlog_per_region < held:
        yield _p("feeder.backlog_per_region", f"{feeder.backlog_per_region} tasks is fewer than a region's generators "
                 f"hold at once ({held}: generators x (generator.concurrent_tasks + generator.tasks_ahead)): they "
                 f"wait for the feeder's next poll each time their tasks run out; expected at least {held}",
                 "warning", also=("generator.concurrent_tasks", "generator.tasks_ahead"))
    ev = topology.evaluator
    if ev.samples and not (ev.tasks.partition(":")[0] == "repo" or names_task_file(ev.tasks)):
        yield _p("evaluator.samples", f"{ev.samples} sampled episodes per task apply to repository tasks only, and "
                 f"evaluator.tasks is {ev.tasks!r}; set samples = 0 or evaluate repository tasks",
                 also=("evaluator.tasks",))
    if feeder.tasks == "humaneval" and topology.evaluator.tasks == "humaneval":
        yield _p("evaluator.tasks", "the held-out set is HumanEval, which feeder.tasks trains on: training skips "
                 "every held-out prompt, so it would draw nothing; give the evaluator another source",
                 also=("feeder.tasks",))
    launch = topology.launch
    if launch.backend == "local" and launch.ray_address is not None:
        yield _p("launch.ray_address", 'ignored: launch.backend is "local"', "warning")


def _servers(topology: Topology) -> Iterator[Found]:
    regions = topology.regions
    hub = _hub_index(topology)
    reference = regions[hub] if hub is not None else regions[0]
    for i, region in enumerate(regions):
        if region.embedded != reference.embedded:
            yield _p(f"regions[{i}].nats_urls", f"region {region.name!r} {'gives no' if region.embedded else 'gives'} "
                     f"nats_urls but region {reference.name!r} {'does not' if reference.embedded else 'does'}: "
                     "expected either every region to join existing servers or none (rlbus up starts them all)")
        for k, url in enumerate(region.nats_urls):
            if _INLINE_CREDENTIALS.match(url):
                yield _p(f"regions[{i}].nats_urls[{k}]", "credentials inline in the URL; expected them by "
                         "reference only: put them in a .creds file and set credentials_file or credentials_env")
        if region.credentials_file is not None and region.credentials_env is not None:
            yield _p(f"regions[{i}].credentials_env", "both credentials_file and credentials_env are set; expected "
                     "one of them")
        if region.embedded and (region.credentials_file is not None or region.credentials_env is not None):
            field = "credentials_file" if region.credentials_file is not None else "credentials_env"
            yield _p(f"regions[{i}].{field}", "ignored: the region has no nats_urls, so rlbus up starts its server "
                     "and makes its own users", "warning")
        if not region.embedded and topology.durability.replicas > len(region.nats_urls):
            yield _p(f"regions[{i}].nats_urls", f"durability.replicas = {topology.durability.replicas} but only "
                     f"{len(region.nats_urls)} server URL(s) given; the cluster must have at least that many servers",
                     "warning", also=("durability",))
    if parse_duration(topology.durability.redeliver_after) < 1.0:
        yield _p("durability.redeliver_after", f"expected a duration of at least 1s, found "
                 f"{topology.durability.redeliver_after!r}: holders renew their ack wait every few seconds at most")
    replicas = topology.durability.replicas
    if replicas not in (1, CLUSTER_NODES) and any(r.embedded for r in regions):
        yield _p("durability.replicas", f"expected 1 (one server per region) or {CLUSTER_NODES} (each region a "
                 f"{CLUSTER_NODES}-node JetStream cluster) with embedded servers, found {replicas}; other "
                 "counts need nats_urls of servers clustered elsewhere", also=("regions",))
    if replicas > 1:
        for i, region in enumerate(regions):
            if region.embedded and region.link is not None:
                yield _p("durability.replicas", f"replicas = {replicas} (clustered regions) and regions[{i}].link "
                         f"(region {region.name!r} in a network namespace) together are not supported; set "
                         "replicas = 1 or drop the [regions.link] tables", also=(f"regions[{i}].link",))
                break
    if topology.launch.backend == "ray":
        seen: dict[str, str] = {}
        for i, region in enumerate(regions):
            other = seen.setdefault(region.resource, region.name)
            if other != region.name:
                yield _p(f"regions[{i}].ray_resource", f"Ray resource {region.resource!r} is also region {other!r}'s: "
                         "their actors cannot be told apart in placement", "warning", also=("launch",))


def _tls(topology: Topology) -> Iterator[Found]:
    tls = topology.tls
    if not tls.enabled:
        for name in ("ca_file", "cert_file", "key_file"):
            if getattr(tls, name) is not None:
                yield _p(f"tls.{name}", "ignored: tls.enabled is false (set enabled = true to use TLS)",
                         "warning")
        return
    if (tls.cert_file is None) != (tls.key_file is None):
        have, lack = ("cert_file", "key_file") if tls.key_file is None else ("key_file", "cert_file")
        yield _p(f"tls.{lack}", f"tls.{have} is set but tls.{lack} is not: a server certificate goes with its private "
                 "key; set both, or neither to have certificates generated")
        return
    embedded = all(r.embedded for r in topology.regions)
    if embedded and tls.cert_file is not None and tls.ca_file is None:
        yield _p("tls.ca_file", "tls.cert_file is set but tls.ca_file is not: leaf links and actors verify the "
                 "servers' certificate against the CA that signed it; set ca_file to that CA's PEM file",
                 also=("regions",))
    if embedded and tls.ca_file is not None and tls.cert_file is None:
        yield _p("tls.ca_file", "tls.ca_file is set without cert_file and key_file: the embedded servers need a "
                 "certificate signed by that CA; set cert_file and key_file too, or drop ca_file to have a CA and "
                 "certificate generated under the state directory", also=("regions",))
    if not embedded:
        for name in ("cert_file", "key_file"):
            if getattr(tls, name) is not None:
                yield _p(f"tls.{name}", "ignored: the regions join existing servers (nats_urls), which present "
                         "their own certificates; only ca_file is used", "warning", also=("regions",))


def _links(topology: Topology) -> Iterator[Found]:
    for i, region in enumerate(topology.regions):
        link = region.link
        if link is None:
            continue
        key = f"regions[{i}].link"
        if region.role == "hub":
            yield _p(key, f"region {region.name!r} is the hub: a link joins a leaf region to the hub; move "
                     "[regions.link] to a leaf")
        if not region.embedded:
            yield _p(key, f"region {region.name!r} joins existing servers (nats_urls): a shaped link needs the "
                     "server that rlbus up starts itself; drop nats_urls or [regions.link]")
        try:
            parse_percent(link.loss)
        except ValueError as err:
            yield _p(f"{key}.loss", f"{err}: a link that drops every packet is a cut, not a shape")
        if parse_time(link.jitter) > parse_time(link.latency):
            yield _p(f"{key}.jitter", f"jitter {link.jitter} exceeds latency {link.latency}: expected at most "
                     "the latency (a delay cannot go below zero)")
        if topology.tls.enabled:
            yield _p(key, "shaped links and TLS together are not supported (the embedded certificate names "
                     "loopback only); drop [tls] or the [regions.link] tables", also=("tls",))
        if topology.launch.backend == "ray":
            yield _p(key, "on the ray backend the region's actors run outside its namespace and reach its server "
                     "unshaped; only the leaf link is shaped (the local backend runs them inside)", "warning",
                     also=("launch",))


def _threads(topology: Topology, local_cores: int) -> Iterator[Found]:
    if topology.launch.oversubscribe:       # the operator said the actors are meant to share the cores
        return
    hosts: dict[str, list[int]] = defaultdict(list)
    for i, region in enumerate(topology.regions):
        host = region.host if region.host is not None and region.host not in _LOCAL_HOSTS else "localhost"
        hosts[host].append(i)
    for host, indices in hosts.items():
        given = [topology.regions[i].cores for i in indices if topology.regions[i].cores is not None]
        cores = given[0] if given else (local_cores if host == "localhost" else None)
        if cores is None:
            continue
        asks = [(topology.regions[i].name, spec) for i in indices for spec in topology.regions[i].actors
                if spec.kind in TORCH_KINDS and spec.count]
        threads = sum(spec.count * spec.torch_threads for _, spec in asks)
        if threads > cores:
            first = indices[0]
            key = f"regions[{first}].host" if topology.regions[first].host is not None else f"regions[{first}].actors"
            detail = ", ".join(f"{name}/{spec.label} {spec.count}x{spec.torch_threads}" for name, spec in asks)
            yield _p(key, f"host {host!r} has {cores} cores but its torch actors ask for {threads} threads "
                     f"({detail}); lower torch_threads or counts, or set launch.oversubscribe = true if they are meant to "
                     f"share the cores (they will slow each other down)", "warning", also=("launch",))
