"""The README's "Train your own" as a newcomer runs it: train with --set overrides, then
``xcls eval`` with none (it reads the run's saved config.toml), then train again once finished."""

from __future__ import annotations

from pathlib import Path

from xcls.cli import main


def test_eval_reads_the_runs_config_and_a_finished_run_says_so(glyphs_small, tmp_path, capsys):
    config = tmp_path / "my.toml"
    config.write_text(f"""
[data]
train = "data/mine/train"
test = "data/mine/test"
batch_size = 16
num_workers = 0
[model]
dim = 32
[head]
kind = "partial"
[train]
max_steps = 4
threads = 1
out_dir = "{tmp_path / 'run'}"
""")  # the data paths are the file's, not where the data is: --set gives them
    sets = ["--set", f"data.train={Path(glyphs_small) / 'train'}",
            "--set", f"data.test={Path(glyphs_small) / 'test'}"]
    assert main(["train", str(config), *sets]) == 0
    assert "trained 4 steps, last loss" in capsys.readouterr().out
    assert main(["eval", str(config)]) == 0  # no --set repeated
    assert "step 4, trained rows: top-1" in capsys.readouterr().out
    assert main(["train", str(config), *sets]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out and "already trained 4 steps" in out, out
