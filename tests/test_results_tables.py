"""The pages rendered from ``benchmarks/results/`` are current, and a changed record makes them
stale: RESULTS.md, the README's tables and docs/accuracy.md's tables are generated, never typed.

In-process and offline; the accuracy tables ask git which commits descend from which, so the
checks need the repository's history (a shallow clone skips them).
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import accuracy_tables  # noqa: E402
import render_results  # noqa: E402
import results  # noqa: E402

GENERATED = [Path("benchmarks/RESULTS.md"), Path("README.md"), Path("docs/accuracy.md")]


def _history() -> bool:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                          capture_output=True, text=True)
    return done.returncode == 0 and done.stdout.strip() == "false"


needs_history = pytest.mark.skipif(not _history(), reason="needs the git history")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the generated pages and the results files they come from."""
    for page in GENERATED:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    shutil.copytree(ROOT / render_results.RESULTS, tmp_path / render_results.RESULTS)
    return tmp_path


@needs_history
def test_the_generated_pages_are_current() -> None:
    assert render_results.stale(ROOT) == [], \
        "run: python benchmarks/render_results.py (and commit the pages it rewrites)"


@needs_history
def test_a_changed_benchmark_record_makes_results_and_readme_stale(tree: Path, capsys) -> None:
    path = tree / render_results.RESULTS / "bench_heads.jsonl"
    lines = path.read_text().splitlines()
    changed = []
    for line in lines:
        record = json.loads(line)
        if record["figures"].get("speed-up vs full") == "447.2x":
            record["figures"]["speed-up vs full"] = "450.0x"
        changed.append(json.dumps(record, ensure_ascii=False))
    assert changed != lines
    path.write_text("\n".join(changed) + "\n")

    assert render_results.stale(tree) == [Path("benchmarks/RESULTS.md"), Path("README.md")]
    assert render_results.main(["--check"], root=tree) == 1
    err = capsys.readouterr().err
    assert "benchmarks/RESULTS.md" in err and "README.md" in err
    assert render_results.main([], root=tree) == 0
    assert render_results.main(["--check"], root=tree) == 0
    assert "450.0x" in (tree / "README.md").read_text()


@needs_history
def test_a_changed_accuracy_row_makes_accuracy_md_stale(tree: Path) -> None:
    path = tree / render_results.RESULTS / "accuracy.csv"
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    first = next(r for r in rows if not r["notes"] and r["head"] == "full")
    first["top1"] = f"{float(first['top1']) - 1:.2f}"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, accuracy_tables.COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    assert Path("docs/accuracy.md") in render_results.stale(tree)


def test_an_unknown_block_is_refused() -> None:
    text = "<!-- results:nothing-like-it -->\n<!-- /results -->\n"
    with pytest.raises(ValueError, match="nothing-like-it"):
        render_results.fill_blocks(text, "README.md", {"heads": lambda: ""})


def test_the_accuracy_file_keeps_its_schema() -> None:
    with (ROOT / render_results.RESULTS / "accuracy.csv").open(newline="") as f:
        assert tuple(next(csv.reader(f))) == accuracy_tables.COLUMNS
    runs = accuracy_tables.load_runs(ROOT / render_results.RESULTS / "accuracy.csv")
    assert runs and all(0 < r.top1 <= 100 for r in runs)


@pytest.mark.parametrize("row, message", [
    ("2026-11-25,abc1234,2-core CPU VM,100,2,softmax,10,,,0,90.00,,,,", "head 'softmax'"),
    ("2026-11-25,abc1234,2-core CPU VM,100,2,full,100,,,0,nan,,,,", "'nan' is not a finite"),
    ("2026-11-25,abc1234,2-core CPU VM,100,2,full,100,,,0,,,,,", "a top-1 is required"),
    ("2026-11-25,abc1234,2-core CPU VM,100,2,full,100,,,0,9894.00,,,,", "9894.00 is not a perc"),
    ("2026-11-25,abc1234,2-core CPU VM,100,2,full,100,,,0,90.00,-3,,,", "-3 is not a percentage"),
    ("2026-11-25,abc1234,2-core CPU VM,100,2,full,100,,,0,90.00,,inf,,", "'inf' is not a finite"),
    ("2026-11-25,abc1234,2-core CPU VM,100,2,full,100,,,0,90.00,,,nan,", "'nan' is not a finite"),
])
def test_a_row_off_the_schema_is_an_error_naming_its_line(tmp_path: Path, row: str,
                                                           message: str) -> None:
    path = tmp_path / "accuracy.csv"
    path.write_text(",".join(accuracy_tables.COLUMNS) + "\n" + row + "\n")
    with pytest.raises(ValueError, match=rf"accuracy.csv:2: {message}"):
        accuracy_tables.load_runs(path)


@needs_history
def test_runs_of_one_setting_on_cpus_of_other_models_are_one_row(tmp_path: Path) -> None:
    """The tables group by the machine, not the CPU's model: the two CPU runs of a setting are
    one row of two seeds (mean 97.00), the GPU run at that setting a row of its own."""
    path = tmp_path / "accuracy.csv"
    rows = [f"2026-11-25,b13327f,\"{device}\",10000,2,knn,1000,16,0.5,{seed},{top1},,,,"
            for device, seed, top1 in [("2-core CPU VM", 0, "96.50"),
                                       ("2-core CPU VM (AMD EPYC, AVX-512)", 1, "97.50"),
                                       ("NVIDIA H100 80GB HBM3 (16 CPU cores)", 0, "98.00")]]
    path.write_text(",".join(accuracy_tables.COLUMNS) + "\n" + "\n".join(rows) + "\n")
    table = accuracy_tables.seeds_table(accuracy_tables.load_runs(path), settings=False)
    lines = table.splitlines()[2:]
    assert len(lines) == 2
    assert "| 2-core CPU VM |" in lines[0] and "| 0: 96.50, 1: 97.50 | 97.00 |" in lines[0]
    assert "| NVIDIA H100 80GB HBM3 |" in lines[1] and "| 0: 98.00 | 98.00 |" in lines[1]


@needs_history
def test_runs_of_a_setting_that_became_the_default_count_as_the_defaults(tmp_path: Path) -> None:
    """4044fea made head.logq_start_step=-1 knn's default: a knn run with it at a89309a (after
    b13327f) is a run of the current code at the defaults; the same setting on partial, which
    the change does not touch, and a knn run without it stay where they were."""
    path = tmp_path / "accuracy.csv"
    rows = [f"2026-11-28,{commit},2-core CPU VM,40000,4,{head},4000,{k},{share},0,{top1},,,,"
            f"{notes}"
            for commit, head, k, share, top1, notes in [
                ("a89309a", "knn", 16, 0.5, "98.00", "head.logq_start_step=-1"),
                ("a89309a", "partial", "", "", "96.00", "head.logq_start_step=-1"),
                ("f3630c9", "partial", "", "", "97.00", ""),
                ("f3630c9", "knn", 16, 0.5, "95.00", "")]]
    path.write_text(",".join(accuracy_tables.COLUMNS) + "\n" + "\n".join(rows) + "\n")
    runs = accuracy_tables.credit_defaults(accuracy_tables.load_runs(path))
    assert [(r.head, r.settings, accuracy_tables.code_span(r),
             accuracy_tables.is_current(r)) for r in runs] == [
        ("knn", (), "≥ 4044fea", True),
        ("partial", ("head.logq_start_step=-1",), "≥ b13327f", True),
        ("partial", (), "≥ b13327f", True),
        ("knn", (), "b13327f–4044fea", False)]
    readme = accuracy_tables.readme_table(runs).splitlines()
    assert readme[2].startswith("| 40,000 | 4 | 4,000 | study defaults | — | 98.00 (1 seed) | "
                                "97.00 (1 seed) |"), readme


def test_a_run_of_changed_code_is_recorded_as_dirty(tmp_path: Path, monkeypatch) -> None:
    """A tracked file that differs from the commit marks the commit "-dirty"; a changed record
    under benchmarks/results does not (a run appends there while it runs)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True,
                              text=True, check=True).stdout.strip()

    (tmp_path / "benchmarks/results").mkdir(parents=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "benchmarks/results/r.csv").write_text("n\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    head = git("rev-parse", "--short=7", "HEAD")
    monkeypatch.setattr(results, "ROOT", tmp_path)
    monkeypatch.delenv(results.COMMIT_ENV, raising=False)
    assert results.current_commit() == head
    (tmp_path / "benchmarks/results/r.csv").write_text("n\n1\n")
    assert results.current_commit() == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert results.current_commit() == head + "-dirty"


def test_record_appends_to_the_results_dir_it_is_given(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(results.RESULTS_DIR_ENV, str(tmp_path))
    path = results.record("bench_x", [{"N": 1000, "ms": 1.5}, {"N": 2000, "ms": 2.5}],
                          table="step", device="test device")
    results.record("bench_x", [{"N": 4000, "ms": 3.5}], table="step", device="test device")
    assert path == tmp_path / "bench_x.jsonl"
    records = results.load(path)
    assert [r.figures for r in records] == [{"N": 1000, "ms": 1.5}, {"N": 2000, "ms": 2.5},
                                            {"N": 4000, "ms": 3.5}]
    assert len({r.run for r in records}) == 1  # one process, one run
    first = records[0]
    assert first.device == "test device" and first.table == "step"
    assert first.command.startswith("python ") and first.commit and first.date[:4].isdigit()


def test_a_later_run_replaces_the_shown_rows_of_its_machine_and_command() -> None:
    def rec(date: str, device: str, ms: float) -> results.Record:
        return results.Record(date, "abc1234", device, "python benchmarks/b.py", "", {"ms": ms})

    old, new, other = rec("2026-01-01", "cpu", 1.0), rec("2026-01-02", "cpu", 2.0), \
        rec("2026-01-01", "gpu", 3.0)
    assert render_results.current([old, other, new]) == [other, new]


def test_printed_tables_parse_into_figures() -> None:
    rows = results.markdown_rows(["| N | head | ms/step | speed-up |", "|---:|---|---:|---:|",
                                  "| 1,000,000 | knn | 36.6 | 447.2x |", "| 5 | full | — | - |"])
    assert rows == [{"N": 1_000_000, "head": "knn", "ms/step": 36.6, "speed-up": "447.2x"},
                    {"N": 5, "head": "full", "ms/step": None, "speed-up": None}]
    assert results.table_row("   n |  dtype", "  25,000 | float16") == {"n": 25_000,
                                                                       "dtype": "float16"}


def test_a_tree_without_git_takes_the_commit_it_is_told(tmp_path: Path, monkeypatch) -> None:
    """A copy of the tree without its .git (sent to a GPU host) records the commit named in
    XCLS_RESULTS_COMMIT, and "unknown" when none is named."""
    monkeypatch.setattr(results, "ROOT", tmp_path)
    monkeypatch.delenv(results.COMMIT_ENV, raising=False)
    assert results.current_commit() == "unknown"
    monkeypatch.setenv(results.COMMIT_ENV, "abc1234")
    assert results.current_commit() == "abc1234"


@needs_history
def test_a_named_commit_wins_over_the_git_history_beside_the_tree(monkeypatch) -> None:
    """On a GPU host the copied tree may sit beside a stale .git: the commit named in
    XCLS_RESULTS_COMMIT is the one recorded."""
    monkeypatch.setenv(results.COMMIT_ENV, "abc1234")
    assert results.current_commit() == "abc1234"


@needs_history
def test_a_recorded_demo_run_becomes_the_readmes_demo_time(tree: Path, monkeypatch) -> None:
    """The README's demo time is the newest scripts/demo.sh run of each machine, as recorded
    (benchmarks/demo.py), never a typed figure."""
    monkeypatch.setenv(results.RESULTS_DIR_ENV, str(tree / render_results.RESULTS))
    device = "2-core CPU VM (AMD EPYC, AVX-512)"
    results.record("demo", [{"classes": 2000, "dataset s": 270.4, "steps": 900,
                             "total s": 931, "top-1 %": 97.3, "class means top-1 %": 97.97,
                             "load (1 min)": "11.9-12.1"}],
                   command="bash scripts/demo.sh", device=device)
    assert Path("README.md") in render_results.stale(tree)
    render_results.main([], root=tree)
    readme = (tree / "README.md").read_text()
    assert (f"* **931 s** on a {device} at a load average of 11.9-12.1 (start-end): the "
            "dataset 270.4 s of it; top-1 97.30 %, by class means 97.97 %") in readme
    assert readme.count(f"s** on a {device} ") == 1  # the machine's older runs are not shown
    assert "**445 s** on a 2-core CPU VM (AMD EPYC, no AVX-512)" in readme  # another machine's


@needs_history
def test_a_recorded_step_run_becomes_the_readmes_step_ratios(tree: Path, monkeypatch) -> None:
    """The README's whole-step ratios are bench_step's recorded ÷ backbone, per machine and N."""
    monkeypatch.setenv(results.RESULTS_DIR_ENV, str(tree / render_results.RESULTS))
    row = {"N": 10_000_000, "rows": "float32 x 512", "rows pulled/step": 3072, "ms/step": 1.0,
           "above backbone, % of step": "—", "steps": 9}
    results.record("bench_step", [
        {**row, "head": "backbone", "where the rows live": None, "images/s": 2000.0,
         "÷ backbone": 1.0},
        {**row, "head": "knn", "where the rows live": "AMS, embedded (2 shards)",
         "images/s": 1900.0, "÷ backbone": 1.053},
        {**row, "head": "partial", "where the rows live": "collective, 1 rank",
         "images/s": 1000.0, "÷ backbone": 2.0},
    ], command="python benchmarks/bench_step.py --device cuda", device="Some GPU",
        table="whole step")
    assert Path("README.md") in render_results.stale(tree)
    render_results.main([], root=tree)
    readme = (tree / "README.md").read_text()
    assert "| Some GPU | 10,000,000 | 2,000.0 | 1.05 | — | — | — | 2.00 |" in readme
