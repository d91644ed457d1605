"""The accuracy tables, rendered from ``benchmarks/results/accuracy.csv``.

One CSV row is one training run (``COLUMNS``): percent figures as numbers (97.30), an empty
cell where a figure was not measured, ``budget`` the active classes per step. ``notes`` holds
``; ``-separated entries: an entry ``key=value`` is a setting that differs from the study's
defaults (a config key such as ``optim.head_weight_decay=5e-4``, or a named code variant such as
``decay_clock=off``), any other entry is a remark. Runs with the same setting are one row of a
table: every seed's top-1, the mean and the spread, the commits.

A change to the training code can move a head's figures, so runs are compared only within one
span of training code: between two of the commits in ``TRAINING_CODE_CHANGES`` that changed
the run's head (by git ancestry, ``git merge-base --is-ancestor``). The README shows only runs
of each head's current code: at or after the newest change of that head. A change that made a
measured setting the default credits the runs with that setting, since its span began, to the
change, the setting dropped: they trained as the new default does.
"""

from __future__ import annotations

import csv
import math
import statistics
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from results import DIRTY, machine_of

COLUMNS = ("date", "commit", "device", "classes", "epochs", "head", "budget", "k",
           "random_share", "seed", "top1", "top5", "class_means_top1", "seconds_per_epoch",
           "notes")
HEADS = ("full", "knn", "partial", "knn-ivf", "knn-touched")

KNN_HEADS = tuple(h for h in HEADS if h.startswith("knn"))
README_HEADS = ("full", "knn", "partial")  # the README table's columns


@dataclass(frozen=True)
class TrainingCodeChange:
    """A commit after which training gave other figures."""

    commit: str
    what: str
    heads: tuple[str, ...] = HEADS
    """the heads whose figures it moves"""
    was_setting: str = ""
    """``key=value``: the setting that trained, before ``commit``, as its default does"""


# Add the commit of every change that alters training results (the row update's rounding, the
# selection's draws, a default), newest last: the README then shows only runs of the code as it
# is.
TRAINING_CODE_CHANGES = (
    TrainingCodeChange("92ef1bb", "the shard's row step rounded as w.sub_(g, alpha=lr), not "
                       "w - (lr·g)"),
    TrainingCodeChange("7d33b40", "the uniform negatives drawn by one sort of the draws"),
    TrainingCodeChange("b13327f", "the class rows warm up until each class has been a label "
                       "about three times"),
    TrainingCodeChange("4044fea", "knn's logQ weighting of the drawn classes starts after the "
                       "rows' warm-up", KNN_HEADS, "head.logq_start_step=-1"),
)
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Run:
    """One row of accuracy.csv."""

    date: str
    commit: str
    device: str
    classes: int
    epochs: float | None
    head: str
    budget: int
    k: int | None
    random_share: float | None
    seed: int | None
    top1: float
    top5: float | None
    class_means_top1: float | None
    seconds_per_epoch: float | None
    settings: tuple[str, ...]
    remarks: tuple[str, ...]
    credited_to: str = ""
    """the training-code change whose default the run's setting was (``TrainingCodeChange``)"""

    @property
    def machine(self) -> str:
        """``results.machine_of`` the device: the tables group runs by it, as the CPU's model
        moves a run's seconds, not what it learns."""
        return machine_of(self.device)


def _number(text: str, kind: type = float) -> float | int | None:
    if not text.strip():
        return None
    value = kind(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def _percent(text: str, *, required: bool = False) -> float | None:
    value = _number(text)
    if value is None and required:
        raise ValueError("a top-1 is required")
    if value is not None and not 0 <= value <= 100:
        raise ValueError(f"{text} is not a percentage")
    return value


def load_runs(path: Path) -> list[Run]:
    """The rows of an accuracy CSV; a row that breaks the schema is an error naming its line."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"{path}: the columns must be {','.join(COLUMNS)}")
        runs = []
        for line, row in enumerate(reader, 2):
            try:
                entries = [e.strip() for e in row["notes"].split(";") if e.strip()]
                if row["head"] not in HEADS:
                    raise ValueError(f"head {row['head']!r} is not one of {', '.join(HEADS)}")
                runs.append(Run(
                    row["date"], row["commit"], row["device"], int(row["classes"]),
                    _number(row["epochs"]), row["head"], int(row["budget"]),
                    _number(row["k"], int), _number(row["random_share"]),
                    _number(row["seed"], int), _percent(row["top1"], required=True),
                    _percent(row["top5"]), _percent(row["class_means_top1"]),
                    _number(row["seconds_per_epoch"]),
                    tuple(e for e in entries if "=" in e),
                    tuple(e for e in entries if "=" not in e)))
            except (ValueError, TypeError) as err:
                raise ValueError(f"{path}:{line}: {err}") from err
    return runs


@cache
def _descends(commit: str, ancestor: str) -> bool:
    """Whether ``commit`` is ``ancestor`` or one of its descendants."""
    done = subprocess.run(["git", "-C", str(REPO), "merge-base", "--is-ancestor", ancestor,
                           commit.removesuffix(DIRTY)], capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise ValueError(f"commit {commit} or {ancestor} is not in this repository's history "
                         f"({done.stderr.strip()})")
    return done.returncode == 0


def _marks(head: str) -> list[str]:
    """The commits that changed ``head``'s training, oldest first."""
    return [c.commit for c in TRAINING_CODE_CHANGES if head in c.heads]


def credit_defaults(runs: Iterable[Run]) -> list[Run]:
    """``runs``, each with a setting that a later change made the default dropped and the run
    credited to that change, where the run descends from the change before it (the tables call
    it; it asks git, so it needs the repository's history)."""
    return [_credited(r) for r in runs]


def _credited(run: Run) -> Run:
    for change in TRAINING_CODE_CHANGES:
        if change.was_setting and change.was_setting in run.settings \
                and run.head in change.heads:
            marks = _marks(run.head)
            before = marks[marks.index(change.commit) - 1]
            if _descends(run.commit, before):
                return replace(run, credited_to=change.commit, settings=tuple(
                    s for s in run.settings if s != change.was_setting))
    return run


def _span(run: Run) -> int:
    """How many of the marks of ``run``'s head's training code it descends from or is credited
    to (0: before the first)."""
    marks = _marks(run.head)
    credited = marks.index(run.credited_to) + 1 if run.credited_to else 0
    return max(credited, next((i + 1 for i in reversed(range(len(marks)))
                               if _descends(run.commit, marks[i])), 0))


def code_span(run: Run) -> str:
    """The span of training code ``run`` falls in, e.g. "92ef1bb–7d33b40" or "≥ b13327f"."""
    marks, span = _marks(run.head), _span(run)
    if span == 0:
        return f"< {marks[0]}"
    return f"≥ {marks[-1]}" if span == len(marks) else f"{marks[span - 1]}–{marks[span]}"


def is_current(run: Run) -> bool:
    """Whether ``run`` measured its head's current training code."""
    return _span(run) == len(_marks(run.head))


def newest_spans(runs: Iterable[Run]) -> list[Run]:
    """Per setting, head and machine, only the runs of the newest span of code measured."""
    runs = credit_defaults(runs)

    def setting(r: Run) -> tuple:
        return (r.settings, r.classes, r.epochs, r.head, r.budget, r.k, r.random_share, r.machine)

    newest: dict[tuple, int] = {}
    for r in runs:
        newest[setting(r)] = max(newest.get(setting(r), 0), _span(r))
    return [r for r in runs if _span(r) == newest[setting(r)]]


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _group_key(run: Run) -> tuple:
    return (run.settings, run.classes, run.epochs or 0, HEADS.index(run.head), run.budget,
            run.k or 0, run.random_share or 0, run.machine, _span(run), run.seed is None)


def _cells(runs: list[Run]) -> list[str]:
    """Every seed's top-1, the mean, the spread, the class-means mean and the commits of one
    group of runs (a run without a seed is a mean recorded as such, shown with its remark)."""
    seeds = ", ".join(f"{r.seed}: {r.top1:.2f}" if r.seed is not None
                      else f"{r.top1:.2f} ({'; '.join(r.remarks)})" for r in runs)
    top1 = [r.top1 for r in runs]
    spread = f"{min(top1):.2f}–{max(top1):.2f}" if len(top1) > 1 else ""
    means = [r.class_means_top1 for r in runs if r.class_means_top1 is not None]
    mean = _fmt(statistics.mean(means)) if means else ""
    if means and len(means) < len(runs):
        mean += f" ({len(means)} of {len(runs)})"
    commits = ", ".join(dict.fromkeys(r.commit for r in runs))
    return [seeds, _fmt(statistics.mean(top1)), spread, mean, commits]


def _groups(runs: Iterable[Run]) -> list[list[Run]]:
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault(_group_key(run), []).append(run)
    return [sorted(g, key=lambda r: (r.seed is None, r.seed or 0))
            for _, g in sorted(groups.items(), key=lambda kv: kv[0])]


def _setting(run: Run) -> list[str]:
    epochs = "" if run.epochs is None else f"{run.epochs:g}"
    return [f"{run.classes:,}", epochs, f"{run.budget:,}", run.head,
            "" if run.k is None else str(run.k),
            "" if run.random_share is None else f"{run.random_share:g}"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


SEED_COLUMNS = ["top-1 by seed", "mean", "min–max", "class means, mean", "commits"]


def seeds_table(runs: Iterable[Run], *, settings: bool) -> str:
    """Per setting and head: every seed's top-1, the mean, the spread and the commits. With
    ``settings`` the runs with settings of their own, else those at the study's defaults."""
    chosen = [r for r in credit_defaults(runs) if bool(r.settings) == settings]
    header = ["classes", "epochs", "budget", "head", "k", "random share", "machine", "code",
              *SEED_COLUMNS]
    if settings:
        header.insert(0, "settings")
    rows = []
    for group in _groups(chosen):
        first = group[0]
        row = [*_setting(first), first.machine, code_span(first), *_cells(group)]
        rows.append(["; ".join(first.settings), *row] if settings else row)
    return _table(header, rows)


def demo_table(runs: Iterable[Run]) -> str:
    """The demo's runs (those whose settings name the demo's config), per span of code."""
    return seeds_table([r for r in runs if any(s.startswith("config=") for s in r.settings)],
                       settings=True)


def _summary(runs: list[Run]) -> str:
    """"mean (n seeds, min–max)" of one head's runs in one setting."""
    top1 = [r.top1 for r in runs]
    spread = f", {min(top1):.2f}–{max(top1):.2f}" if len(top1) > 1 else ""
    return f"{statistics.mean(top1):.2f} ({len(top1)} seed{'s' * (len(top1) > 1)}{spread})"


def readme_table(runs: Iterable[Run]) -> str:
    """The runs of the current training code at the study's defaults or the demo's config, a
    row per setting and sampled budget with each head's mean top-1 (full's, the reference, in
    each of its setting's rows); then the settings that await runs on the current code."""
    shown = [r for r in credit_defaults(runs) if r.head in README_HEADS
             and (not r.settings or any(s.startswith("config=") for s in r.settings))]
    current = [r for r in shown if is_current(r)]

    def setting(r: Run) -> tuple:
        return (r.classes, r.epochs or 0, r.settings, r.machine)

    budgets = {(setting(r), r.budget) for r in current if r.head != "full"}
    budgets |= {(setting(r), None) for r in current
                if setting(r) not in {key for key, _ in budgets}}
    rows = []
    for key, budget in sorted(budgets, key=lambda kb: (kb[0], kb[1] or 0)):
        classes, epochs, settings, device = key
        cells = []
        for head in README_HEADS:
            mine = [r for r in current if setting(r) == key and r.head == head
                    and (head == "full" or r.budget == budget)]
            cells.append(_summary(mine) if mine else "—")
        commits = dict.fromkeys(r.commit for r in current if setting(r) == key
                                and (r.head == "full" or r.budget == budget))
        rows.append([f"{classes:,}", f"{epochs:g}", "" if budget is None else f"{budget:,}",
                     "; ".join(settings) or "study defaults", *cells, device,
                     ", ".join(commits)])
    done = {(r.classes, r.epochs or 0, r.settings) for r in current}
    awaiting = dict.fromkeys((r.classes, r.epochs or 0, r.settings)
                             for r in sorted(shown, key=lambda r: (r.classes, r.epochs or 0))
                             if (r.classes, r.epochs or 0, r.settings) not in done)
    lines = []
    if rows:
        lines.append(_table(["classes", "epochs", "budget", "setting", *README_HEADS,
                             "machine", "commits"], rows))
    if awaiting:
        names = "; ".join(f"{c:,} classes × {e:g} epoch{'s' * (e != 1)}"
                          + (f" ({'; '.join(s)})" if s else "") for c, e, s in awaiting)
        codes = "; ".join(f"{', '.join(heads)}: {commit}" for commit, heads in _current_codes())
        lines.append(f"Awaiting runs on the current training code ({codes}): "
                     f"{names}.")
    return "\n\n".join(lines)


def _current_codes() -> list[tuple[str, list[str]]]:
    """Each commit that is some head's current training code, with those heads."""
    heads_of: dict[str, list[str]] = {}
    for head in README_HEADS:
        heads_of.setdefault(_marks(head)[-1], []).append(head)
    return list(heads_of.items())
