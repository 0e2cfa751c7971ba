"""The pretraining corpus: built-in task documents mixed with real Python source, decontaminated.

- Owns: the task documents (`task_documents`), the code documents (`code_documents`: the standard library's
  `.py` files and any directory given), the long documents of a long-context phase (`repositories`,
  `split_repositories`, `long_documents`: whole repositories, their files concatenated), the decontamination rule
  (`Decontaminator`), the mix (`mixed_documents`) and `tokenizer_texts` (what a new BPE tokenizer learns from).
- Guarantee: no document contains a held-out task's prompt or canonical solution.
- Does not: own tokenizers, batching or the training loop (model/training/pretrain.py).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import re
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Final

from rlbus.model.env.episodes import add_attempt, episode_tokens, start_episode
from rlbus.model.policies.interface import ChatTokenizer
from rlbus.model.tasks.builtin import Task, train_tasks
from rlbus.model.tasks.changes import held_out_sources
from rlbus.model.tasks.grading import GradeResult, grade_many

Document = tuple[list[int], list[float]]
"""(ids, loss weight per id)."""

SKIP_DIRS: Final = frozenset({"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3",
                              "turtledemo", "ensurepip", "pydoc_data", "__pycache__", "node_modules"})
"""Folders never read: test suites, installed third-party packages, the IDLE and 2to3 sources, generated data."""
MAX_FILE_BYTES: Final = 256 * 1024
"""Source files larger than this are skipped (generated tables, not code a policy should imitate)."""
MIN_DOC_TOKENS: Final = 16
"""Shorter slices (a file's last few lines) are not worth a batch row."""


class CorpusError(ValueError):
    """A corpus that cannot be read: a `--corpus` folder that is none, or no source file left to train on."""


def normalise(text: str) -> str:
    """Every run of whitespace as one space, no leading or trailing space."""
    return " ".join(text.split())


class Decontaminator:
    """Refuses text holding a held-out task's prompt or canonical solution body, or the code of a held-out
    function of the built-in repository tasks (after `normalise`).

    Text is normalised by collapsing every run of whitespace to one space; a source file whose normalised
    text contains the normalised prompt or the normalised canonical solution body of any held-out task, or of
    any `repo_held_out` code (default: every `heldout` function of the task library, model/tasks/changes.py
    `held_out_sources`), is dropped whole (so no split can cut a copy in two and let both halves through). Every
    code document is a slice of a file that passed, so no document contains a held-out prompt or solution.
    """

    def __init__(self, held_out: Iterable[Task], repo_held_out: Iterable[str] | None = None) -> None:
        needles = {normalise(part) for task in held_out for part in (task.prompt, task.solution)}
        needles |= {normalise(code) for code in (held_out_sources() if repo_held_out is None else repo_held_out)}
        self.needles: tuple[str, ...] = tuple(sorted(n for n in needles if n))

    def clean(self, text: str) -> bool:
        """True when `text` contains none of the held-out prompts or solution bodies."""
        flat = normalise(text)
        return not any(needle in flat for needle in self.needles)


# ---- task documents ------------------------------------------------------------------------------------

def corrupt(solution: str, rng: random.Random) -> str:
    """A plausible wrong attempt: change one integer literal, flip one operator, or drop one step line."""
    lines = solution.split("\n")
    steps = [i for i, line in enumerate(lines) if line.startswith("    ") and "return" not in line]
    literals = list(re.finditer(r"(?<![\w'])\d+", solution))
    kind = rng.choice(["literal", "operator", "drop"])
    if kind == "literal" and literals:
        m = rng.choice(literals)
        value = int(m.group()) + rng.choice([-2, -1, 1, 2])
        return solution[: m.start()] + str(max(0, value)) + solution[m.end():]
    swaps = {" + ": " - ", " - ": " + ", " * ": " + ", " > ": " < ", " < ": " > ", "[::-1]": "", ".upper()": ""}
    present = [k for k in swaps if k in solution]
    if kind == "operator" and present:
        old = rng.choice(present)
        return solution.replace(old, swaps[old], 1)
    if len(steps) > 1 and not any(line.strip().startswith(("if", "else")) for line in lines):
        del lines[rng.choice(steps)]
        return "\n".join(lines)
    return solution.replace("return ", "return -", 1) if "return x" in solution else solution + "\n"


def task_documents(seed: int, tokenizer: ChatTokenizer, *, eval_seed: int, retry_fraction: float,
                   prompt_loss_weight: float) -> Iterator[Document]:
    """Endless task documents: weights 1 on a correct solution, `prompt_loss_weight` on prompt and feedback,
    0 on a wrong first attempt. Training tasks never share a prompt with `eval_tasks(eval_seed)`."""
    rng = random.Random(f"rlbus-pretrain:{seed}")
    tasks = train_tasks(seed, eval_seed=eval_seed)
    while True:
        chunk = list(itertools.islice(tasks, 256))
        retry = [rng.random() < retry_fraction for _ in chunk]
        wrong = {i: corrupt(t.solution, rng) for i, t in enumerate(chunk) if retry[i]}
        graded = dict(zip(wrong, grade_many([(chunk[i], code) for i, code in wrong.items()]), strict=True))
        for i, task in enumerate(chunk):
            first = graded.get(i)
            yield task_document(task, tokenizer, prompt_loss_weight,
                                (wrong[i], first) if first is not None and not first.passed else None)


def task_document(task: Task, tokenizer: ChatTokenizer, prompt_weight: float,
                  wrong: tuple[str, GradeResult] | None) -> Document:
    """One episode in the tokenizer's chat framing: the prompt, optionally a wrong attempt and its feedback, then
    the canonical solution closed by the tokenizer's `stop_id`; only that last attempt is a target."""
    episode = start_episode(task, tokenizer)
    if wrong is not None:
        episode = add_attempt(episode, [*tokenizer.encode(wrong[0]), tokenizer.stop_id], wrong[1], tokenizer)
    correct = GradeResult("passed", len(task.tests), len(task.tests), "")
    episode = add_attempt(episode, [*tokenizer.encode(task.solution), tokenizer.stop_id], correct, tokenizer)
    flat = episode_tokens(episode, tokenizer)
    last = len(episode.turns) - 1
    weights = [1.0 if m and t == last else (0.0 if m else prompt_weight)
               for m, t in zip(flat.loss_mask, flat.turn, strict=True)]
    return flat.ids, weights


# ---- source files ----------------------------------------------------------------------------------------

def stdlib_root() -> Path:
    """The folder of the running Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(dirs: Sequence[Path], *, stdlib: bool) -> list[Path]:
    """Every `.py` file under `dirs` (and the standard library when `stdlib`), sorted, skipping `SKIP_DIRS`,
    hidden folders and files over `MAX_FILE_BYTES`. Lists names only; nothing is read.

    :raises CorpusError: a folder of `dirs` that does not exist.
    """
    roots = [stdlib_root()] if stdlib else []
    for d in dirs:
        if not d.is_dir():
            raise CorpusError(f"corpus folder {d} does not exist or is not a folder; pass a folder of .py files")
        roots.append(d)
    found: set[Path] = set()
    for root in roots:
        for folder, subdirs, files in os.walk(root):
            subdirs[:] = sorted(s for s in subdirs if s not in SKIP_DIRS and not s.startswith((".", "config-")))
            for name in files:
                path = Path(folder) / name
                if name.endswith(".py") and path.is_file() and path.stat().st_size <= MAX_FILE_BYTES:
                    found.add(path)
    return sorted(found)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def split_source(text: str, tokenizer: ChatTokenizer, max_tokens: int) -> list[list[int]]:
    """`text` as documents of at most `max_tokens` ids each, the last one `eos_id`.

    Lines are grouped greedily (by each line's own token count) and each group is encoded as one text; a group
    that encodes longer (or one line longer than the budget) is cut. Groups under `MIN_DOC_TOKENS` or of blank
    text are dropped.
    """
    budget = max_tokens - 1
    if budget < 1:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    groups: list[str] = []
    lines: list[str] = []
    used = 0
    for line in text.splitlines(keepends=True):
        n = len(tokenizer.encode(line))
        if lines and used + n > budget:
            groups.append("".join(lines))
            lines, used = [], 0
        lines.append(line)
        used += n
    if lines:
        groups.append("".join(lines))
    docs = []
    for group in groups:
        if not group.strip():
            continue
        ids = tokenizer.encode(group)[:budget]
        if len(ids) >= MIN_DOC_TOKENS:
            docs.append([*ids, tokenizer.eos_id])
    return docs


def code_documents(files: Sequence[Path], tokenizer: ChatTokenizer, max_tokens: int, rng: random.Random,
                   decontaminator: Decontaminator) -> Iterator[Document]:
    """Endless plain documents from `files`, weight 1 on every id: the files in an `rng` order (reshuffled each
    pass), each read only when reached, dropped whole unless `decontaminator.clean`, split by `split_source`
    at line boundaries into documents of at most the model's context, each ending with the tokenizer's `eos_id`.

    :raises CorpusError: a whole pass over `files` gives no document.
    """
    order = list(files)
    while True:
        rng.shuffle(order)
        produced = 0
        for path in order:
            text = _read(path)
            if text is None or not decontaminator.clean(text):
                continue
            for ids in split_source(text, tokenizer, max_tokens):
                produced += 1
                yield ids, [1.0] * len(ids)
        if not produced:
            raise CorpusError(f"none of {len(order)} source files gives a document (unreadable, empty, or holding "
                              "a held-out task); pass --corpus folders of .py files or set the code fraction to 0")


def mixed_documents(tasks: Iterator[Document], code: Iterator[Document] | None, code_fraction: float,
                    rng: random.Random) -> Iterator[Document]:
    """Each document is code with probability `code_fraction`, else a task document. With no code (or a fraction
    of 0) the task documents pass through untouched and `rng` is never drawn."""
    if code is None or code_fraction <= 0.0:
        yield from tasks
        return
    while True:
        yield next(code) if rng.random() < code_fraction else next(tasks)


def tokenizer_texts(files: Sequence[Path], tasks: Iterable[Task], decontaminator: Decontaminator,
                    rng: random.Random, *, max_chars: int) -> list[str]:
    """Texts a new BPE tokenizer learns from: the given training tasks' prompts and solutions, then source files
    in an `rng` order (decontaminated like the documents) until about `max_chars` characters in all."""
    texts = [task.prompt + task.solution for task in tasks]
    total = sum(map(len, texts))
    order = list(files)
    rng.shuffle(order)
    for path in order:
        if total >= max_chars:
            break
        text = _read(path)
        if text is None or not decontaminator.clean(text):
            continue
        texts.append(text)
        total += len(text)
    return texts


# ---- repositories (long documents) -----------------------------------------------------------------------

Repository = tuple[str, list[Path]]
"""A repository's name (`root/entry`) and its `.py` files, sorted."""
HELD_OUT_EVERY: Final = 8
"""About one repository in this many (by the digest of its name) is held out of long-context training."""


def repositories(roots: Sequence[Path]) -> list[Repository]:
    """Each entry of each root that holds Python source: a folder (every `.py` file below it, as
    `source_files`) or a lone `.py` file; named `<root>/<entry>`, in sorted order.

    :raises CorpusError: a root that is not a folder.
    """
    out: list[Repository] = []
    for root in roots:
        if not root.is_dir():
            raise CorpusError(f"repository folder {root} does not exist or is not a folder; pass a folder whose "
                              "subfolders hold .py files")
        for entry in sorted(root.iterdir()):
            if entry.name in SKIP_DIRS or entry.name.startswith((".", "config-")):
                continue
            if entry.is_dir():
                files = source_files([entry], stdlib=False)
            elif entry.suffix == ".py" and entry.is_file() and entry.stat().st_size <= MAX_FILE_BYTES:
                files = [entry]
            else:
                continue
            if files:
                out.append((f"{root.name}/{entry.name}", files))
    return out


def split_repositories(repos: Sequence[Repository]) -> tuple[list[Repository], list[Repository]]:
    """(training, held-out) repositories: held out are those whose name's sha256 falls in one of
    `HELD_OUT_EVERY` buckets, or the first one where that picks none or all of them.

    :raises CorpusError: fewer than two repositories.
    """
    if len(repos) < 2:
        raise CorpusError(f"{len(repos)} repositories; a long-context phase needs at least 2 (one is held out to "
                          "measure the long-context loss): pass a folder with several subfolders of .py files")
    held = [r for r in repos if hashlib.sha256(r[0].encode()).digest()[0] % HELD_OUT_EVERY == 0]
    if not held or len(held) == len(repos):
        held = [repos[0]]
    names = {name for name, _ in held}
    return [r for r in repos if r[0] not in names], held


def repository_ids(repo: Repository, tokenizer: ChatTokenizer, decontaminator: Decontaminator) -> list[int]:
    """A repository as one text, each clean file after a `# file: <path>` line, encoded, ending with `eos_id`
    (empty when no file is readable and clean)."""
    name, files = repo
    parts = []
    for path in files:
        text = _read(path)
        if text is not None and text.strip() and decontaminator.clean(text):
            parts.append(f"# file: {name}/{path.name}\n{text}\n")
    return [*tokenizer.encode("".join(parts)), tokenizer.eos_id] if parts else []


def windows(ids: Sequence[int], length: int) -> list[list[int]]:
    """`ids` cut into consecutive windows of `length` (the last one shorter, dropped under `MIN_DOC_TOKENS`)."""
    return [list(ids[i:i + length]) for i in range(0, len(ids), length) if len(ids[i:i + length]) >= MIN_DOC_TOKENS]


def long_documents(repos: Sequence[Repository], tokenizer: ChatTokenizer, length: int, rng: random.Random,
                   decontaminator: Decontaminator) -> Iterator[Document]:
    """Endless documents of up to `length` ids, weight 1 on every id: the repositories in an `rng` order
    (reshuffled each pass), each read when reached (`repository_ids`) and cut into windows of `length`.

    :raises CorpusError: a whole pass gives no document.
    """
    order = list(repos)
    while True:
        rng.shuffle(order)
        produced = 0
        for repo in order:
            for ids in windows(repository_ids(repo, tokenizer, decontaminator), length):
                produced += 1
                yield ids, [1.0] * len(ids)
        if not produced:
            raise CorpusError(f"none of {len(order)} repositories gives a document (unreadable, empty, or holding "
                              "a held-out task)")
