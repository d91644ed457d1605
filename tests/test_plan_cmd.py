"""``xcls plan``: bad input is one line on stderr and exit code 2, a host too small for its
shards likewise, and the printed figures match arithmetic done here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ams.cluster import plan
from ams.cluster.plan import load_rates
from xcls.cli import main
from xcls.plan_cmd import fmt_bytes, parse_count, parse_size

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30


def xcls_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xcls", "plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def assert_one_line_error(stderr: str, expected: str) -> None:
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert expected in stderr


def test_bad_input_from_the_command_line():
    """As a process: one line on stderr, nothing on stdout, exit code 2 (the other refusals
    run the command in this process, below)."""
    done = xcls_plan("--classes", "lots")
    assert done.returncode == 2
    assert done.stdout == ""
    assert_one_line_error(done.stderr, "--classes 'lots': expected a whole number")


@pytest.mark.parametrize("args, expected", [
    (["--classes", "1000", "--host-mem", "lots"], "--host-mem 'lots': expected a size"),
    (["--classes", "1000", "--host-mem", "-3GiB"], "--host-mem: expected one argument"),
    (["--classes", "1e30"], "--classes 1e30: must be in [1, "),
    (["--classes", "1000", "--set", "ams.nope=1"], "unknown key ams.nope"),
    (["--classes", "0"], "--classes 0: must be in [1, "),
    (["--classes", "-5"], "--classes '-5': expected a whole number >= 1"),
    (["--classes", "2.5"], "--classes '2.5': expected a whole number"),
    (["--classes", "1000", "--host-mem=-3GiB"], "--host-mem '-3GiB': expected a size"),
    (["--classes", "1000", "--host-mem", "0GiB"], "--host-mem '0GiB': must be more than 0"),
    (["--classes", "1000", "--host-mem", "24"], "--host-mem '24': expected a size with a unit"),
    (["--classes", "1000", "--host-mem", "1e3GiB"], "--host-mem '1e3GiB': expected a size"),
    (["--classes", "1000", "--host-mem", "9" * 30 + "TiB"], "at most 2**70"),
    (["--classes", "1000", "--workers", "9" * 30], "--workers " + "9" * 30 + ": must be in"),
    (["--classes", "1000", "--shards", "0"], "--shards 0: must be in [1, 16,777,216]"),
    (["--classes", "10", "--shards", "20"], "shards=20 exceeds num_classes=10"),
    (["--classes", "1000", "--shards", "4", "--hosts", "5"], "hosts=5 exceeds shards=4"),
    (["--classes", "1000", "--set", "model.dim=0"], "model.dim: must be > 0"),
    ([], "no class count: give --classes N"),
    (["--set", "data.train=/nonexistent/xcls-data"], "data.train: "),
    (["--classes", "1000", "--set", "ams.scheduler=host:1234"], "give --shards S"),
    (["--classes", "1000", "--set", "graph.method=ivf", "--set", "graph.nlist=5000"],
     "nlist=5000 must be in [0, "),
])
def test_bad_input_in_process(args, expected, capsys):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["plan", *args]))
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert_one_line_error(err, expected)


def test_unknown_key_in_the_config_file(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text("[model]\ndim = 128\nwidth = 3\n")
    assert main(["plan", str(config), "--classes", "1000"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert_one_line_error(err, "unknown key model.width")


def test_a_host_too_small_for_its_shards():
    done = xcls_plan("--classes", "100000000", "--shards", "4", "--hosts", "4",
                     "--host-mem", "8GiB", "--set", "ams.dtype=float16", "--set",
                     "head.budget=100000", "--set", "model.dim=128", "--set", "graph.k=32")
    assert done.returncode == 2
    rates = load_rates()
    owned = 25_000_000
    # rows float16 x 128, clocks 8 B, touched 1 B, graph 32 int32 ids; one worker's pulls
    # and rank 0's push
    resident = owned * (128 * 2 + 8 + 1 + 32 * 4) + rates.baseline \
        + 2 * rates.buffers_per_stream
    assert_one_line_error(
        done.stderr, f"plan: 100000000 classes on 4 shards need {fmt_bytes(resident)} "
        "resident per host, more than --host-mem 8.00 GiB; use --shards/--hosts or "
        'ams.storage = "mmap"')
    assert "does NOT fit" in done.stdout


def test_printed_figures_by_hand(capsys):
    assert main(["plan", "--classes", "100000000", "--shards", "4", "--hosts", "2",
                 "--workers", "3", "--host-mem", "64GiB", "--set", "ams.dtype=float16",
                 "--set", "head.budget=100000", "--set", "model.dim=128", "--set",
                 "graph.k=32", "--set", "data.batch_size=256"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    # table rows: a 26-wide label after 2 spaces, then two 13-wide columns
    cells = {line[2:28].strip(): (line[28:41].strip(), line[41:54].strip())
             for line in out.splitlines() if line.startswith("  ")}
    # 25,000,000 rows x 128 x 2 B = 5.96 GiB a shard, 2 shards a host
    assert cells["rows"] == ("5.96 GiB", "11.9 GiB")
    assert cells["graph"] == ("2.98 GiB", "5.96 GiB")  # 32 x 4 B a row
    assert cells["optimizer state"] == ("0 B", "0 B")
    assert cells["decay clocks"] == ("191 MiB", "381 MiB")  # 8 B a row
    # 100,000 rows x (256 + 8) B pulled; each of the 3 workers pushes a third of the union of
    # 3 x 100,000 rows x (512 + 8) B and first sends two thirds of its own to the others
    assert cells["pull, each worker"] == ("100,000", "25.2 MiB")
    assert cells["push, each worker"] == ("100,000", "49.6 MiB")
    assert cells["exchange, each worker"] == ("66,667", "33.1 MiB")
    assert "exact, 2.56e18 FLOP" in out  # ring: 2 x 1e16 x 128
    assert "fits" in out.splitlines()[-1]


def gpu_line(out: str) -> str:
    [line] = [line for line in out.splitlines() if line.startswith("  GPU ")]
    return line


@pytest.mark.parametrize("method, rate", [("exact", "gpu_exact"), ("ivf", "gpu_ivf")])
def test_each_gpu_rate_says_measured_or_nominal_as_the_rates_file_does(method, rate, tmp_path,
                                                                      monkeypatch, capsys):
    args = ["plan", "--classes", "1000000", "--set", "model.dim=128", "--set", "graph.k=32",
            "--set", f"graph.method={method}"]
    shipped = json.loads((ROOT / "ams" / "cluster" / plan.RATES_FILE).read_text())
    device = shipped[rate]["device"]
    assert main(args) == 0
    line = gpu_line(capsys.readouterr().out)
    if shipped[rate]["measured"]:  # as shipped: the exact rate measured, the IVF one nominal
        assert line.endswith(f"measured on {device}") and "nominal" not in line, line
    else:
        assert line.endswith(f"nominal assumption for {device}") and "measured" not in line, line
    # the flag flipped in a rates file of one's own flips the word
    shipped[rate]["measured"] = not shipped[rate]["measured"]
    mine = tmp_path / "rates.json"
    mine.write_text(json.dumps(shipped))
    monkeypatch.setattr(plan, "RATES_FILE", str(mine))
    assert main(args) == 0
    flipped = gpu_line(capsys.readouterr().out)
    word = "measured on" if shipped[rate]["measured"] else "nominal assumption for"
    assert flipped.endswith(f"{word} {device}"), flipped


def test_help_shows_examples():
    done = xcls_plan("--help")
    assert done.returncode == 0
    for text in ("--host-mem", "--classes", "examples:", "docs/scale.md"):
        assert text in done.stdout
    # which rate is measured is the rates file's to say (each plan line says it), not the help's
    assert "nominal assumption" in " ".join(done.stdout.split())


@pytest.mark.parametrize("text, expected", [
    ("24GiB", 24 * GIB), ("24 gib", 24 * GIB), ("512MiB", 512 << 20), ("1.5TiB", 3 << 39),
    ("64GB", 64 * 10**9), ("100B", 100)])
def test_parse_size(text, expected):
    assert parse_size(text, "--host-mem") == expected


@pytest.mark.parametrize("text, expected", [
    ("100000000", 10**8), ("100_000_000", 10**8), ("100,000,000", 10**8), ("1e8", 10**8),
    ("2.5e3", 2500)])
def test_parse_count(text, expected):
    assert parse_count(text, "--classes", 2**62) == expected


def test_fmt_bytes():
    assert [fmt_bytes(b) for b in (0, 1023, 1024, 25 * 2**20 + 2**19, 6.4e9, 2**40)] == \
        ["0 B", "1023 B", "1.00 KiB", "25.5 MiB", "5.96 GiB", "1.00 TiB"]
