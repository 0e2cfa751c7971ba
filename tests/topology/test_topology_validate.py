"""Validation of topology files: one bad file per defect under tests/topology/bad/, each problem naming
the file and the key path; several defects reported at once; the shipped examples clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbus.messages.errors import TopologyError
from rlbus.topology.examples import example_names, example_path
from rlbus.topology.file.load import load, validate

HERE = Path(__file__).resolve().parent
BAD = HERE / "bad"
CORES = 64  # core count passed to the rules so no torch-threads warning depends on this machine

# file -> (key path of the one error, a fragment of its message)
CASES: dict[str, tuple[str, str]] = {
    "misspelled_section.toml": ("trainr", "did you mean 'trainer'?"),
    "misspelled_region_key.toml": ("regions[0].nat_urls", "did you mean 'nats_urls'?"),
    "misspelled_actor_key.toml": ("regions[0].actors[1].cont", "did you mean 'count'?"),
    "misspelled_setting.toml": ("trainer.staleness_version", "did you mean 'staleness_versions'?"),
    "wrong_type_lr.toml": ("trainer.lr", "expected a number > 0, found the string 'fast'"),
    "inf_lr.toml": ("trainer.lr", "found the float inf (must be finite)"),
    "wrong_type_table.toml": ("generator", "expected a table [generator], found the integer 5"),
    "count_not_integer.toml": ("regions[0].actors[1].count", "expected an integer >= 0, found the float 1.5"),
    "group_size_zero.toml": ("generator.group_size", "expected an integer >= 1, found the integer 0"),
    "bad_role.toml": ("regions[0].role", "expected one of 'hub', 'leaf', found the string 'center'"),
    "bad_actor_kind.toml": ("regions[0].actors[1].kind", "found the string 'generater'; did you mean 'generator'?"),
    "bad_run_name.toml": ("run", "letters, digits, '_' or '-'"),
    "missing_run.toml": ("run", "missing; expected a name"),
    "empty_regions.toml": ("regions", "expected a non-empty array of tables [[regions]], found an array of 0 items"),
    "duplicate_region.toml": ("regions[1].name", "duplicate region name 'hub' (also regions[0])"),
    "no_hub.toml": ("regions", 'no hub: expected exactly one region with role = "hub"'),
    "two_hubs.toml": ("regions[1].role", "a second hub; regions[0] ('hub') is already the hub"),
    "no_trainer.toml": ("regions[0].actors", "no trainer: expected exactly one"),
    "two_trainers.toml": ("regions[0].actors[3].count", "expected count = 1 for the trainer"),
    "trainer_in_leaf.toml": ("regions[1].actors[2].kind", "the trainer must run in the hub region 'hub'"),
    "zero_generators.toml": ("regions[0].actors[1].count", "0 generators in the whole run"),
    "sandbox_pool_zero.toml": ("sandbox.pool_size", "expected an integer >= 1, found the integer 0"),
    "checkpoint_keep_zero.toml": ("checkpoint.keep", "expected an integer >= 1, found the integer 0"),
    "negative_staleness.toml": ("trainer.staleness_versions", "expected an integer >= 0, found the integer -1"),
    "unknown_region_weight.toml": ("feeder.region_weights.eu", "unknown region 'eu'; regions are: hub"),
    "duplicate_actor_name.toml": ("regions[0].actors[2].kind", "duplicate actor name 'generator' in region 'hub'"),
    "generators_without_sandbox.toml": ("regions[1].actors", "region 'eu' has generators but no sandbox"),
    "batch_smaller_than_group.toml": ("trainer.batch_rollouts", "cannot hold one whole group of generator.group_size = 16"),
    "rollouts_ahead_below_group.toml": ("feeder.max_rollouts_ahead", "less than one task's group"),
    "max_group_size_not_multiple.toml": ("generator.max_group_size", "20 is not a multiple of group_size = 8"),
    "summary_at_past_budget.toml": ("generator.agentic.summary_at_tokens",
                                    "2040 + min_turn_tokens = 32 > max_tokens = 2048"),
    "kv_cache_below_context.toml": ("generator.kv_cache_tokens",
                                    "256 cache slots cannot hold one episode's largest context (512 tokens"),
    "weights_keep_too_few.toml": ("weights.keep_versions", "expected keep_versions >= weights.full_every = 5, found 2"),
    "backoff_inverted.toml": ("restart.backoff_initial_s", "expected backoff_initial_s <= restart.backoff_max_s = 5.0"),
    "bad_sync_interval.toml": ("durability.sync_interval", "found the string 'sometimes'"),
    "bad_retention_age.toml": ("retention.rollouts_max_age", "a duration: a positive whole number"),
    "replicas_zero.toml": ("durability.replicas", "expected an integer >= 1, found the integer 0"),
    "redeliver_too_soon.toml": ("durability.redeliver_after", "expected a duration of at least 1s, found '500ms'"),
    "replicas_embedded.toml": ("durability.replicas", "expected 1 (one server per region) or 3 (each region a 3-node"),
    "bad_backend.toml": ("launch.backend", "expected one of 'local', 'ray', found the string 'k8s'"),
    "inline_password.toml": ("regions[0].nats_urls[0]", "credentials inline in the URL"),
    "both_credentials.toml": ("regions[0].credentials_env", "both credentials_file and credentials_env are set"),
    "mixed_nats_urls.toml": ("regions[1].nats_urls", "region 'eu' gives nats_urls but region 'hub' does not"),
    "levels_with_tasks_file.toml": ("feeder.levels", "select among the built-in tasks only"),
    "evaluator_tasks_missing.toml": ("evaluator.tasks", "'no-such-held-out.jsonl' is neither 'builtin', 'humaneval', "
                                     "'repo', 'repo:LEVEL' nor a tasks file here: no such file"),
    "level_out_of_range.toml": ("feeder.levels[1]", "expected an integer >= 1 and <= 3, found the integer 4"),
    "not_toml.toml": ("", "not valid TOML: Illegal character '\\n' (at line 4, column 12)"),
    "binary.toml": ("", "not a TOML file: not UTF-8 text (byte 0x80 at offset 128)"),
}


def test_every_bad_file_has_a_case() -> None:
    """Each file under bad/ is checked below, and there are at least 20 distinct defects."""
    assert sorted(p.name for p in BAD.glob("*.toml")) == sorted(CASES)
    assert len(CASES) >= 20


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_file_reports_its_one_error_with_file_and_key(name: str) -> None:
    """A file with one defect gives exactly one error, whose text names the file, the key path and the expectation."""
    path = BAD / name
    key, fragment = CASES[name]
    topology, problems = validate(path, local_cores=CORES)
    errors = [p for p in problems if p.severity == "error"]
    assert topology is None
    assert [(p.key, p.file) for p in errors] == [(key, str(path))]
    assert fragment in errors[0].message
    text = str(errors[0])
    assert text.startswith(f"{path}: {key}: " if key else f"{path}: ")


@pytest.mark.parametrize("name", ["two_hubs.toml", "misspelled_actor_key.toml", "not_toml.toml"])
def test_load_raises_topology_error_naming_file_and_key(name: str) -> None:
    """load() raises TopologyError whose text carries the file and every problem's key path."""
    path = BAD / name
    key, fragment = CASES[name]
    with pytest.raises(TopologyError) as caught:
        load(path, local_cores=CORES)
    text = str(caught.value)
    assert str(path) in text and fragment in text
    assert f": {key}: " in text or not key


def test_several_defects_are_reported_at_once() -> None:
    """Key-level and cross-field defects in one file all come back from a single validate()."""
    path = HERE / "several_defects.toml"
    _, problems = validate(path, local_cores=CORES)
    assert all(p.file == str(path) and p.severity == "error" for p in problems)
    assert sorted(p.key for p in problems) == sorted([
        "trainer.lr", "trainer.staleness_version", "sandbox.pool_size", "durability.sync_interval",
        "regions[0].actors", "weights.keep_versions", "restart.backoff_initial_s",
    ])


def test_rules_on_a_section_with_a_bad_value_wait() -> None:
    """A bad value replaced by its default does not make a rule report nonsense about that default."""
    text = (BAD / "no_trainer.toml").read_text() + '\n[generator]\ngroup_size = "many"\n\n[trainer]\nbatch_rollouts = 3\n'
    from rlbus.topology.file.load import validate_text

    _, problems = validate_text(text, local_cores=CORES)
    # group_size is bad, so the batch-vs-group rule is held back; the unrelated "no trainer" still shows
    assert [p.key for p in problems] == ["generator.group_size", "regions[0].actors"]


def test_evaluator_tasks_may_name_a_source_or_a_file_but_not_the_feeders_file(tmp_path: Path) -> None:
    """`[evaluator] tasks` takes "humaneval" and an existing file; the feeder's own tasks file, or HumanEval when
    the feeder trains on it, as the held-out set is an error (training would skip every task of it)."""
    base = (BAD / "evaluator_tasks_missing.toml").read_text().split("[evaluator]")[0]
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("")
    for tasks in ("humaneval", str(held_out)):
        path = tmp_path / "ok.toml"
        path.write_text(base + f"[evaluator]\ntasks = {json.dumps(tasks)}\n")
        topology, problems = validate(path, local_cores=CORES)
        assert topology is not None and topology.evaluator.tasks == tasks
        assert not [p for p in problems if p.severity == "error"]
    path = tmp_path / "same.toml"
    path.write_text(base + f"[feeder]\ntasks_file = {json.dumps(str(held_out))}\n"
                           f"[evaluator]\ntasks = {json.dumps(str(held_out))}\n")
    topology, problems = validate(path, local_cores=CORES)
    assert topology is None
    assert [(p.key, p.severity) for p in problems] == [("evaluator.tasks", "error")]
    assert "is feeder.tasks_file" in problems[0].message
    path.write_text(base + '[feeder]\ntasks = "humaneval"\n[evaluator]\ntasks = "humaneval"\n')
    topology, problems = validate(path, local_cores=CORES)
    assert topology is None and [(p.key, p.severity) for p in problems] == [("evaluator.tasks", "error")]
    assert "HumanEval, which feeder.tasks trains on" in problems[0].message
    path.write_text(base + '[feeder]\ntasks = "humaneval"\n')              # trained on; held out: the built-in set
    topology, problems = validate(path, local_cores=CORES)
    assert topology is not None and not [p for p in problems if p.severity == "error"]


def test_feeder_epochs_repeat_a_listed_source_and_warn_on_an_endless_one(tmp_path: Path) -> None:
    """`[feeder] epochs` validates beside HumanEval; beside the endless built-in family it is a warning on its key;
    a negative count is an error."""
    base = (BAD / "evaluator_tasks_missing.toml").read_text().split("[evaluator]")[0]
    path = tmp_path / "epochs.toml"
    for feeder, expected in (('tasks = "humaneval"\nepochs = 2', []), ("epochs = 2", [("feeder.epochs", "warning")]),
                             ("epochs = -1", [("feeder.epochs", "error")])):
        path.write_text(base + f"[feeder]\n{feeder}\n")
        _, problems = validate(path, local_cores=CORES)
        assert [(p.key, p.severity) for p in problems if p.key == "feeder.epochs"] == expected, (feeder, problems)


def test_evaluator_samples_apply_to_repository_tasks_only(tmp_path: Path) -> None:
    """`[evaluator] tasks = "repo"` (any seed, a level, the held-out split) validates with samples beside a feeder of
    built-in repository tasks (training skips the held-out prompts); samples on function-writing tasks are an
    error on the evaluator's key."""
    base = (BAD / "evaluator_tasks_missing.toml").read_text().split("[evaluator]")[0]
    path = tmp_path / "repo.toml"
    for feeder, evaluator, key in (('seed = 0\ntasks = "repo"', 'seed = 1\ntasks = "repo"\nsamples = 2', None),
                                   ('seed = 0\ntasks = "repo"', 'seed = 0\ntasks = "repo:heldout"', None),
                                   ('seed = 3\ntasks = "repo"', 'seed = 3\ntasks = "repo:2"\nsamples = 1', None),
                                   ('tasks = "builtin"', 'tasks = "builtin"\nsamples = 2', "evaluator.samples")):
        path.write_text(base + f"[feeder]\n{feeder}\n[evaluator]\n{evaluator}\n")
        _, problems = validate(path, local_cores=CORES)
        errors = [p.key for p in problems if p.severity == "error"]
        assert errors == ([key] if key else []), (feeder, evaluator, problems)


def test_unreadable_files(tmp_path: Path) -> None:
    """A missing file, a directory and an unreadable file are problems, not exceptions."""
    missing = tmp_path / "nope.toml"
    locked = tmp_path / "locked.toml"
    locked.write_text('run = "x"\n')
    locked.chmod(0)
    cases = {missing: "cannot read: no such file", tmp_path: "cannot read: is a directory"}
    try:
        locked.read_bytes()
    except PermissionError:
        cases[locked] = "cannot read: permission denied"   # not when running as root
    for path, message in cases.items():
        topology, problems = validate(path)
        assert topology is None
        assert [(p.file, p.key, p.message[: len(message)]) for p in problems] == [(str(path), "", message)]


@pytest.mark.parametrize("name", ["single", "three_regions", "ray", "tiny"])
def test_examples_validate_clean(name: str) -> None:
    """Every shipped example loads with no problem at all (given enough cores)."""
    topology, problems = validate(example_path(name), local_cores=CORES)
    assert problems == []
    assert topology is not None and topology.run == {"three_regions": "three"}.get(name, name)


def test_example_names_and_lookup() -> None:
    """example_path finds each shipped example by name, with or without .toml; an unknown name is a TopologyError."""
    assert example_names() == ["agentic", "demo", "hf", "ranks", "ray", "single", "three_regions", "tiny"]
    assert example_path("single.toml") == example_path("single")
    assert example_path("single").read_text().startswith("# One region")
    with pytest.raises(TopologyError, match="examples are: agentic, demo, hf, ranks, ray, single, three_regions, tiny"):
        example_path("five_regions")


def test_three_regions_layout() -> None:
    """The 3-region example: trainer side and feeder/evaluator in the hub, generator + sandbox in every region."""
    topology = load(example_path("three_regions"), local_cores=CORES)
    assert [(r.name, r.role) for r in topology.regions] == [("hub", "hub"), ("eu", "leaf"), ("us", "leaf")]
    assert topology.hub.name == "hub"
    assert [i.kind for i in topology.instances("hub")] == [
        "feeder", "generator", "sandbox", "trainer", "publisher", "checkpointer", "evaluator"]
    for leaf in ("eu", "us"):
        assert [i.actor_id for i in topology.instances(leaf)] == [f"{leaf}-generator-0", f"{leaf}-sandbox-0"]
    assert len(topology.instances()) == 11
    assert all(r.embedded for r in topology.regions)


def test_three_regions_runs_the_default_learning_settings() -> None:
    """`rlbus up three_regions` is the default learning run spread over three regions: its feeder levels,
    generator, trainer, evaluator and pretraining settings are single.toml's, value for value."""
    three, single = load(example_path("three_regions"), local_cores=CORES), load(example_path("single"), local_cores=CORES)
    assert three.feeder.levels == single.feeder.levels == [1, 2]
    assert (three.generator, three.trainer, three.evaluator, three.pretrain) == (
        single.generator, single.trainer, single.evaluator, single.pretrain)
    assert three.trainer.lr == 1e-4 and three.pretrain.steps == 300


def test_ray_example_places_by_region_resource() -> None:
    """The Ray example selects the ray backend and gives each region its `region:<name>` resource."""
    topology = load(example_path("ray"), local_cores=CORES)
    assert topology.launch.backend == "ray" and topology.launch.ray_address is None
    assert [r.resource for r in topology.regions] == ["region:hub", "region:edge"]
    assert topology.restart.max_restarts == 3


def test_threads_warning_when_a_host_is_oversubscribed(tmp_path: Path) -> None:
    """Five torch actors (two generators) at one thread each on a 2-core host: a warning naming the key that
    silences it, and the topology still loads; none with enough cores."""
    path = tmp_path / "single.toml"
    path.write_text(example_path("single").read_text().replace("oversubscribe = true", ""))
    topology, problems = validate(path, local_cores=2)
    assert topology is not None and not topology.launch.oversubscribe
    assert [(p.severity, p.key) for p in problems] == [("warning", "regions[0].actors")]
    assert "host 'localhost' has 2 cores but its torch actors ask for 5 threads" in problems[0].message
    assert "launch.oversubscribe = true" in problems[0].message
    assert str(problems[0]).startswith(f"{path}: regions[0].actors: warning: ")
    _, fits = validate(path, local_cores=5)
    assert fits == []


@pytest.mark.parametrize("name", ["single", "tiny", "three_regions", "ray"])
def test_intended_oversubscription_is_not_warned_about(name: str, tmp_path: Path) -> None:
    """The shipped examples that run every actor on one small machine say so (`launch.oversubscribe`), so
    their own validation on 2 cores is clean; the same file without the key warns."""
    _, problems = validate(example_path(name), local_cores=2)
    assert problems == []
    copy = tmp_path / f"{name}.toml"
    copy.write_text(example_path(name).read_text().replace("oversubscribe = true", "oversubscribe = false"))
    _, problems = validate(copy, local_cores=2)
    assert [p.severity for p in problems] == ["warning"] and "torch actors ask for" in problems[0].message


def test_a_feeder_backlog_below_what_the_generators_hold_is_warned_about(tmp_path: Path) -> None:
    """single.toml's generators (2 x (8 + 8) tasks) with a backlog of 16 tasks: a warning naming the backlog and
    what the generators hold; lockstep (which feeds one batch at a time on purpose) is not warned about."""
    text = example_path("single").read_text().replace("[feeder]\n", "[feeder]\nbacklog_per_region = 16\n", 1)
    path = tmp_path / "short.toml"
    path.write_text(text)
    _, problems = validate(path, local_cores=CORES)
    assert [(p.severity, p.key) for p in problems] == [("warning", "feeder.backlog_per_region")]
    assert "16 tasks is fewer than a region's generators hold at once (32" in problems[0].message
    path.write_text(text.replace("backlog_per_region = 16\n", "backlog_per_region = 16\nlockstep = true\n"))
    _, problems = validate(path, local_cores=CORES)
    assert "feeder.backlog_per_region" not in [p.key for p in problems]


def test_speculation_on_the_builtin_policy_without_a_phase_with_heads_is_warned_about(tmp_path: Path) -> None:
    """tiny.toml with `[generator] speculative = true`: a warning on the key (its pretraining has no phase with
    `mtp_heads`, so generators would sample plainly); none once a phase distils heads."""
    text = example_path("tiny").read_text().replace("[generator]\n", "[generator]\nspeculative = true\n", 1)
    path = tmp_path / "spec.toml"
    path.write_text(text)
    _, problems = validate(path, local_cores=CORES)
    assert [(p.severity, p.key) for p in problems] == [("warning", "generator.speculative")]
    assert "sample plainly" in problems[0].message
    phase = '\n  [[pretrain.phases]]\n  name = "main"\n  steps = 30\n  mtp_heads = 2\n'
    path.write_text(text.replace("steps = 30\n", "", 1).replace("eval_n = 8\n", "eval_n = 8\n" + phase, 1))
    _, problems = validate(path, local_cores=CORES)
    assert problems == []
