"""Render the pages people read from the results files in ``benchmarks/results/``.

    python benchmarks/render_results.py            # rewrite the generated pages and blocks
    python benchmarks/render_results.py --check    # exit 1 naming every stale file

Generated: the whole of ``benchmarks/RESULTS.md`` (one section per benchmark: its commands, the
machines, the current tables), and the blocks between ``<!-- results:NAME -->`` and
``<!-- /results -->`` in ``README.md`` and ``docs/accuracy.md``. "Current" is, for each
machine and command, the latest run recorded; older runs stay in the files and in git. Edit
the results files (or rerun a benchmark), never the generated text.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accuracy_tables as acc  # noqa: E402
from results import Figure, Record, load  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("benchmarks/results")
MARKER = re.compile(r"(<!-- results:([\w-]+) -->\n)(.*?)(<!-- /results -->)", re.DOTALL)

MACHINES = (
    "**2-core CPU VM**: x86_64, 2 vCPUs of an AMD EPYC (with or without AVX-512, as named), no "
    "GPU, Python 3.11, torch 2.13.0+cpu with 2 threads in the benchmark process, grpcio 1.85.1, "
    "redis-server 7.0.15, faiss-cpu 1.15.1; absolute times move with the load on the shared "
    "cores, ratios within one table much less.",
    "**NVIDIA H100 80GB HBM3**: one H100 with 16 CPU cores, Python 3.12, torch 2.11.0+cu130.",
)


@dataclass(frozen=True)
class Section:
    """One benchmark's section of RESULTS.md: the results file and what its figures are."""

    title: str
    name: str
    legend: str


SECTIONS = (
    Section("Heads (bench_heads.py)", "bench_heads",
            "Batch 256, d = 128, fp32 rows, ArcFace s = 64, medians of the measured steps; "
            "*head alone*: ms per step of the head on an embedded AMS (2 shards); *whole step*: "
            "`resnet_small` on 32×32 images, no prefetch overlap; the 1M table gets a stand-in "
            "graph of the exact graph's shape."),
    Section("Collective vs AMS placement (bench_collective.py)", "bench_collective",
            "A whole `resnet_small` step on 2 gloo ranks × 64 images, ms (medians, the slower "
            "rank's): rows sliced over the ranks against 2 `xcls serve shard` processes."),
    Section("Whole step (bench_step.py)", "bench_step",
            "Images/s of whole training steps as the trainer runs them (prefetch thread, "
            "push behind the step), contenders in turns of a few steps on the same batches: "
            "the backbone alone (the ceiling), knn and partial with the rows in the embedded "
            "AMS or in shard processes, and in collective placement; CPU: `resnet_small` at "
            "32×32, d = 128, batch 256; medians of the timed steps."),
    Section("Row pushes of data-parallel ranks (bench_row_push.py)", "bench_row_push",
            "W gloo ranks on one host, each with its own batch of 256 labels and knn rows "
            "(budget batch × 12) of a 1M-row table on 4 shard processes, d = 128: rows per rank "
            "and step it owns, sends, receives and pushes, against the rows one rank would "
            "push if it gathered every rank's gradients; the push's time on the slowest rank."),
    Section("Capacity: 1M to 100M classes (bench_capacity.py)", "bench_capacity",
            "d = 128, float16 rows, no momentum, 4 shard processes on loopback: seconds to "
            "create, each shard's resident memory after the create and with a k = 12 graph, "
            "bytes per class, and `xcls plan`'s estimate against the measured."),
    Section("Slot layout (slot_layout_sim.py)", "slot_layout_sim",
            "The product's slot maps under 1,500 knn steps of uniform labels, 400,000 classes "
            "on 4 shards, k = 12, batch 256, 16 rows a page; graph-order slots are compacted "
            "into the graph's order once."),
    Section("AMS pull/push (bench_ams.py)", "bench_ams",
            "d = 128, a 500k-row table, random unique ids; *throughput*: M rows/s per backend, "
            "ratios the medians of per-repeat ratios; *1-row pull*: ms; *CPU per xcls call*: ms "
            "in the client and the shards; *10k rows*: M rows/s per shard for pushes."),
    Section("Table files (bench_table_files.py)", "bench_table_files",
            "An mmap table of float32 rows with momentum, closed (a clean stop) and opened "
            "again with `ams.connect(local_shards=1, storage=\"mmap\")`: seconds of each, of "
            "which the checksums of its files (`ams.shard.table_sums`), which is what they add "
            "(timed apart, in the same cache state: on a busy host the two timings differ by "
            "more than the rest, and the share passes 100 %); *page cache*: as the close left "
            "it, or the files dropped from it first (a reboot)."),
    Section("Graph build (bench_graph.py)", "bench_graph",
            "Exact KNN graph, k = 32 with the row itself, d = 128, clustered rows; recall@k "
            "against a float64 brute force; *ivf*: `graph.method = \"ivf\"`."),
    Section("Top-k selection (bench_topk.py)", "bench_topk",
            "`workers.comm.topk` against `torch.topk` on Gaussian magnitudes, medians of 5 calls "
            "(10 on CUDA)."),
    Section("Gradient exchange (bench_comm.py)", "bench_comm",
            "`resnet_small` under DDP on gloo, batch 64 a rank; bytes a rank hands to "
            "collectives; step ms, medians of 10 steps."),
    Section("Gear bridge cache (bench_bridge.py)", "bench_bridge",
            "Features/s of `put` and `get` (all hits) per backend, fp16 entries, best of 5, "
            "beside a small backbone's forward."),
    Section("Gear study (gear_study.py)", "gear_study",
            "Gear mode on against off, 500 glyph classes at 24 px, full head, measured with the "
            "class rows at momentum 0.9 and lr 0.1 (older defaults)."),
    Section("Chaos (chaos.py)", "chaos",
            "A job trained without faults and again while shards are killed or paused (and "
            "Redis stopped in the gear job); the final model against the fault-free one."),
    Section("Test suite (scripts/test.sh)", "test_suite",
            "The whole suite from a fresh clone, two pytest workers, as CI runs it."),
)


def cell(value: Figure) -> str:
    """A figure as a table cell."""
    if value is None:
        return "—"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value).replace("|", "\\|")


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a markdown table."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def current(records: list[Record]) -> list[Record]:
    """Per machine and command, the rows of the latest run recorded (the last appended)."""
    latest = {(r.device, r.command): r.run for r in records}
    return [r for r in records if latest[(r.device, r.command)] == r.run]


def runs_lines(records: list[Record]) -> tuple[list[str], dict[tuple, int]]:
    """The runs behind ``records``: their command, machine, date and commit. A single run is
    one line; several are a numbered list, and the figures' rows carry the run's number."""
    numbers = {run: i for i, run in enumerate(dict.fromkeys(r.run for r in records), 1)}
    lines = [f"{i}. `{command}` · {device} · {date[:10]} · {commit}"
             for (date, commit, device, command), i in numbers.items()]
    if len(numbers) == 1:
        return ["Run: " + lines[0].split(" ", 1)[1]], {}
    return lines, numbers


def figures_tables(records: list[Record], numbers: dict[tuple, int]) -> list[str]:
    """One table per table name; with several runs each row starts with its run's number."""
    lines: list[str] = []
    tables = list(dict.fromkeys(r.table for r in records))
    for table in tables:
        rows = [r for r in records if r.table == table]
        columns = list(dict.fromkeys(k for r in rows for k in r.figures))
        # a heading ends its line's block, so the table follows it without a blank line
        lines += ["", f"#### {table}"] if table and len(tables) > 1 else [""]
        run = (lambda r: [str(numbers[r.run])]) if numbers else (lambda r: [])
        lines += markdown_table(
            ["run"] * bool(numbers) + columns,
            [[*run(r), *(cell(r.figures.get(c)) for c in columns)] for r in rows])
    return lines


def section(root: Path, s: Section) -> list[str]:
    """One benchmark's section of RESULTS.md: legend, runs, current tables."""
    records = current(load(root / RESULTS / f"{s.name}.jsonl"))
    runs, numbers = runs_lines(records)
    # the runs' lines follow the legend: a line break, or a list that may interrupt it
    return [f"## {s.title}", "", s.legend, *runs, *figures_tables(records, numbers), ""]


def demo_section(root: Path) -> list[str]:
    """The demo's section: its runs' times from demo.jsonl, its top-1 from accuracy.csv."""
    records = current(load(root / RESULTS / "demo.jsonl"))
    runs, numbers = runs_lines(records)
    return ["## Demo (scripts/demo.sh)", "",
            "`bash scripts/demo.sh` from a fresh clone: the 2,000-class glyph set, then "
            "`configs/glyphs-2k-knn.toml` (knn head, budget 512, 2 in-process shards); top-1 on "
            "typeface designs never seen in training, from `accuracy.csv`.",
            *runs, *figures_tables(records, numbers), "",
            acc.demo_table(acc.newest_spans(acc.load_runs(root / RESULTS / "accuracy.csv"))),
            ""]


def accuracy_section(root: Path) -> list[str]:
    """The accuracy study's section: the runs of the current training code."""
    return ["## Accuracy study (accuracy_study.py)", "",
            "Full, knn and partial heads on the glyph sets, top-1 % on unseen typeface designs, "
            "from `accuracy.csv`: here the runs of the current training code; every run, by "
            "span of training code, with the setup and findings, in "
            "[docs/accuracy.md](../docs/accuracy.md).",
            "Run: `python benchmarks/accuracy_study.py --data data/glyphs-40k --epochs 2 "
            "--sample-rate 0.1 --k 16 --rebuild-every 300 --heads knn,partial,full --seed 0 "
            "--class-means --out runs/acc-40k-e2-seed0` (`--data`, `--epochs`, `--seed`, `--out` "
            "vary) · 2-core CPU VM unless the table names another machine", "",
            acc.readme_table(acc.load_runs(root / RESULTS / "accuracy.csv")), ""]


def results_page(root: Path) -> str:
    """The whole of RESULTS.md."""
    lines = ["# Benchmark results", "",
             "Generated by `python benchmarks/render_results.py` from `benchmarks/results/` "
             "(edit those, not this page). Each section: what the figures are, the runs behind "
             "them (date, commit of the code measured, machine, command), the current tables. "
             f"Older runs are in the results files and in git. {' '.join(MACHINES)}", "",
             *demo_section(root), *accuracy_section(root)]
    for s in SECTIONS:
        lines += section(root, s)
    return "\n".join(lines).rstrip("\n") + "\n"


def _knn_speedup(records: list[Record], table: str, where: Callable[[dict], bool]) -> str:
    """The speed-up over the full head of the knn head at B·k rows in ``table``'s matching row."""
    hits = [r.figures["speed-up vs full"] for r in records
            if r.table == table and r.figures["head"] == "knn"
            and "(B*k)" in r.figures["settings"] and where(r.figures)]
    return cell(hits[-1]) if hits else "—"


def _heads_speedups(root: Path) -> str:
    """The README's speed table: per machine, at its largest N, the knn head at B·k rows
    against the full head, alone and in a whole step."""
    records = current(load(root / RESULTS / "bench_heads.jsonl"))
    rows = []
    for device in dict.fromkeys(r.device for r in records):
        mine = [r for r in records if r.device == device]
        n = max(r.figures["N"] for r in mine if r.table == "head alone")
        rows.append([device, cell(n),
                     _knn_speedup(mine, "head alone", lambda f, n=n: f["N"] == n),
                     _knn_speedup(mine, "whole step", lambda f: f["AMS"].startswith("embedded")),
                     _knn_speedup(mine, "whole step", lambda f: f["AMS"].startswith("gRPC")),
                     ", ".join(dict.fromkeys(r.commit for r in mine))])
    return "\n".join(markdown_table(
        ["machine", "classes", "knn head vs full head", "whole step, embedded AMS",
         "whole step, gRPC shards", "commit"], rows))


def _step_ratios(root: Path) -> str:
    """The README's whole-step table: per machine and N, a whole training step with each head
    over the backbone alone (bench_step: the rows' traffic behind the step)."""
    records = current(load(root / RESULTS / "bench_step.jsonl"))
    columns = (("knn", "AMS, embedded"), ("knn", "AMS, 2 shard"), ("knn", "collective"),
               ("partial", "AMS, embedded"), ("partial", "collective"))
    devices = list(dict.fromkeys(r.device for r in records))
    rows = []
    for device, n in sorted({(r.device, r.figures["N"]) for r in records},
                            key=lambda key: (devices.index(key[0]), key[1])):
        mine = [r.figures for r in records if r.device == device and r.figures["N"] == n]

        def ratio(head: str, where: str, mine: list[dict] = mine) -> str:
            hits = [f["÷ backbone"] for f in mine if f["head"] == head
                    and str(f["where the rows live"]).startswith(where)]
            return f"{hits[-1]:.2f}" if hits else "—"

        backbone = next((f["images/s"] for f in mine if f["head"] == "backbone"), None)
        commits = ", ".join(dict.fromkeys(r.commit for r in records
                                          if r.device == device and r.figures["N"] == n))
        rows.append([device, cell(n), cell(backbone), *(ratio(h, w) for h, w in columns),
                     commits])
    return "\n".join(markdown_table(
        ["machine", "classes", "backbone alone, images/s", "knn, embedded AMS",
         "knn, shard processes", "knn, collective", "partial 10 %, embedded AMS",
         "partial 10 %, collective", "commit"], rows))


def _demo_times(root: Path) -> str:
    """The README's demo times: per machine, the newest run of scripts/demo.sh recorded, with
    what its time depends on (the load, whether the dataset was built) and its top-1."""
    newest: dict[str, Record] = {}
    for r in load(root / RESULTS / "demo.jsonl"):
        if r.command.endswith("bash scripts/demo.sh"):
            newest[r.device] = r
    lines = []
    for device, r in newest.items():
        f = r.figures
        line = f"**{cell(f['total s'])} s** on a {device}"
        if f.get("load (1 min)") is not None:
            line += f" at a load average of {f['load (1 min)']} (start-end)"
        line += f": the dataset {cell(f['dataset s'])} s of it" \
            if f.get("dataset s") is not None else ": the dataset built before"
        if f.get("top-1 %") is not None:
            line += f"; top-1 {f['top-1 %']:.2f} %"
            if f.get("class means top-1 %") is not None:
                line += f", by class means {f['class means top-1 %']:.2f} %"
        lines.append(f"* {line} ({r.date[:10]}, {r.commit})")
    return "\n".join(lines)


def blocks(root: Path) -> dict[str, Callable[[], str]]:
    """The generated blocks, by the name their markers carry."""
    def runs() -> list[acc.Run]:
        return acc.load_runs(root / RESULTS / "accuracy.csv")

    return {
        "accuracy-current": lambda: acc.readme_table(runs()),
        "heads": lambda: _heads_speedups(root),
        "step": lambda: _step_ratios(root),
        "accuracy": lambda: acc.seeds_table(runs(), settings=False),
        "accuracy-settings": lambda: acc.seeds_table(runs(), settings=True),
        "error-ranks": lambda: _error_ranks(root),
        "demo-time": lambda: _demo_times(root),
    }


def _error_ranks(root: Path) -> str:
    """docs/accuracy.md's table of where the errors lie, with each row's commit."""
    records = current(load(root / RESULTS / "error_ranks.jsonl"))
    columns = list(dict.fromkeys(k for r in records for k in r.figures))
    return "\n".join(markdown_table([*columns, "commit"],
                                    [[*(cell(r.figures.get(c)) for c in columns), r.commit]
                                     for r in records]))


def fill_blocks(text: str, source: str, generators: dict[str, Callable[[], str]]) -> str:
    """``text`` with every marked block regenerated; an unknown block name is an error."""
    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in generators:
            raise ValueError(f"{source}: no generated block is called {name!r} "
                             f"(known: {', '.join(generators)})")
        return f"{match.group(1)}{generators[name]()}\n{match.group(4)}"

    return MARKER.sub(replace, text)


PAGES_WITH_BLOCKS = (Path("README.md"), Path("docs/accuracy.md"))


def render(root: Path) -> dict[Path, str]:
    """Every generated file under ``root`` as it should read."""
    pages = {Path("benchmarks/RESULTS.md"): results_page(root)}
    generators = blocks(root)
    for page in PAGES_WITH_BLOCKS:
        pages[page] = fill_blocks((root / page).read_text(), str(page), generators)
    return pages


def stale(root: Path) -> list[Path]:
    """The generated files under ``root`` that differ from what the results files give."""
    return [page for page, text in render(root).items()
            if not (root / page).exists() or (root / page).read_text() != text]


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    """The command line; ``root`` is the tree whose pages are rendered (the tests' copy)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming every generated file that is stale")
    args = parser.parse_args(argv)
    if args.check:
        outdated = stale(root)
        for page in outdated:
            print(f"stale: {page} (run python benchmarks/render_results.py)", file=sys.stderr)
        return 1 if outdated else 0
    for page, text in render(root).items():
        (root / page).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
