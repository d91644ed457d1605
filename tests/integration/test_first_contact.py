"""The README's "Train your own" as a newcomer runs it: the block's commands exactly as written,
in order, in a directory laid out as a fresh clone (``configs/`` beside it), with a tiny
folder of class images where the README says ``path/to/classes`` and two of its images for
``a.jpg b.jpg``; then what a newcomer reads in their output. ``xcls eval`` with none of the
training's ``--set`` (it reads the run's saved config.toml), and ``xcls train`` started again
on a finished run."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from xcls.cli import main

ROOT = Path(__file__).resolve().parents[2]
# The README's placeholders, and what the test puts there.
CLASSES_PLACEHOLDER = "path/to/classes"
IMAGES_PLACEHOLDER = "a.jpg b.jpg"
# A folder of classes just large enough for the demo config's batch of 128 after the held-out
# test split: 6 classes x 25 images.
NUM_CLASSES, PER_CLASS = 6, 25


def readme_block(title: str) -> list[str]:
    """The commands of the first bash block under the README heading ``title``, a command
    continued over lines (``\\``) joined into one."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n## {title}\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def write_classes(root: Path) -> list[Path]:
    """ROOT/<class>/<image>.jpg: class c is a shape of its own on noise (64x64 and 80x60
    images, as photos come in several sizes). Returns every image written."""
    rng = np.random.default_rng(0)
    written = []
    for c in range(NUM_CLASSES):
        folder = root / f"class-{c}"
        folder.mkdir(parents=True)
        for i in range(PER_CLASS):
            w, h = (64, 64) if i % 2 else (80, 60)
            pixels = rng.integers(0, 80, (h, w, 3), dtype=np.uint8)
            pixels[h // 4: h // 4 + 8 * (c + 1) // 2, w // 6: w // 6 + 30 - 4 * c] = 240
            path = folder / f"{i:03d}.jpg"
            Image.fromarray(pixels).save(path)
            written.append(path)
    return written


def test_the_readmes_train_your_own_block_runs_as_written(tmp_path):
    commands = readme_block("Train your own")
    assert any(CLASSES_PLACEHOLDER in c for c in commands), commands
    assert any(IMAGES_PLACEHOLDER in c for c in commands), commands
    images = write_classes(tmp_path / "classes")
    # a fresh clone: the commands run at its top, where configs/ is
    work = tmp_path / "clone"
    work.mkdir()
    (work / "configs").symlink_to(ROOT / "configs")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    outputs = []
    for command in commands:
        line = command.replace(CLASSES_PLACEHOLDER, str(tmp_path / "classes")).replace(
            IMAGES_PLACEHOLDER, f"{images[0]} {images[-1]}")
        done = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        outputs.append(done)

    def output_of(start: str) -> subprocess.CompletedProcess:
        return next(o for c, o in zip(commands, outputs, strict=True) if c.startswith(start))

    # the training's last line gives the loss its log gave last (train.csv's last row)
    trained = output_of("xcls train").stdout
    run_dir = next((work / "runs").iterdir())
    with open(run_dir / "train.csv") as f:
        last = list(csv.DictReader(f))[-1]
    assert re.search(rf"^trained {last['step']} steps, loss {float(last['loss']):.4f} ",
                     trained, re.M), (trained, last)
    assert "test top-1" in trained
    # evaluation says what it evaluates, not that it resumed training
    evaluated = output_of("xcls eval")
    assert f"evaluating step={last['step']}" in evaluated.stderr, evaluated.stderr
    assert "resumed" not in evaluated.stderr
    assert f"step {last['step']}, trained rows: top-1" in evaluated.stdout
    # the export is readable by others, as the umask says
    umask = os.umask(0)
    os.umask(umask)
    model = work / "model"
    assert {p.name: p.stat().st_mode & 0o777 for p in model.iterdir()} == {
        p.name: 0o666 & ~umask for p in model.iterdir()}
    assert json.loads((model / "export.json").read_text())["rows"] == "class-means"
    predicted = [json.loads(line) for line in output_of("xcls predict").stdout.splitlines()]
    assert [p["image"] for p in predicted] == [str(images[0]), str(images[-1])]
    assert all(len(p["classes"]) == 5 for p in predicted)


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
    assert "trained 4 steps, loss" in capsys.readouterr().out
    assert main(["eval", str(config)]) == 0  # no --set repeated
    assert "step 4, trained rows: top-1" in capsys.readouterr().out
    assert main(["train", str(config), *sets]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out and "already trained 4 steps" in out, out
