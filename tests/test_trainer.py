"""Real training runs on real glyph data (small), resume, export/predict, hostile inputs."""

from __future__ import annotations

import csv
import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnxruntime
import pytest
import torch
from PIL import Image

from tests.conftest import record_push_rates
from workers.checkpoint import CheckpointError
from workers.data.importers import import_pairs_bin
from workers.data.lmdb_dataset import LmdbImageDataset
from workers.predict import Classifier
from xcls.cli import main
from xcls.config import ConfigError, load_config
from xcls.run import build_run

ROOT = Path(__file__).resolve().parent.parent


def overrides(data: Path, out: Path, **extra) -> list[str]:
    base = {
        "data.train": str(data / "train"), "data.test": str(data / "test"),
        "data.batch_size": 64, "data.num_workers": 0, "model.dim": 64,
        "head.kind": "knn", "head.k": 8, "head.budget": 48, "graph.k": 16,
        "graph.rebuild_every": 40, "optim.lr": 0.1, "optim.warmup_steps": 10,
        "train.out_dir": str(out), "train.log_every": 10, "train.threads": 2,
        "train.epochs": 100,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def glyph_pairs(data: Path, out: Path) -> Path:
    """A verification pair set from glyphs: a character's training and test designs are the
    same identity, two characters' test designs different ones (as faces of one person)."""
    train, test = LmdbImageDataset(data / "train"), LmdbImageDataset(data / "test")
    first_train = {}
    for i, label in enumerate(train.labels().tolist()):
        first_train.setdefault(label, i)
    by_class = {}
    for i, label in enumerate(test.labels().tolist()):
        by_class.setdefault(label, i)
    classes = sorted(by_class)
    images, flags = [], []
    for n, c in enumerate(classes):
        if n % 2:  # same
            images += [train.read_record(first_train[c])[1], test.read_record(by_class[c])[1]]
        else:  # different: the next class's test design
            other = classes[(n + 1) % len(classes)]
            images += [test.read_record(by_class[c])[1], test.read_record(by_class[other])[1]]
        flags.append(bool(n % 2))
    (out / "pairs.bin").write_bytes(pickle.dumps((images, flags)))
    meta = train.metadata
    import_pairs_bin(out / "pairs.bin", out / "pairs", size=meta.height, channels=meta.channels)
    return out / "pairs"


def test_short_run_learns_and_exports(glyphs_small, tmp_path):
    pairs = glyph_pairs(glyphs_small, tmp_path)
    cfg = load_config(None, overrides(glyphs_small, tmp_path / "run", **{
        "train.max_steps": 120, "data.verification": f"['{pairs}']"}))
    run = build_run(cfg)
    result = run.trainer.train()
    # face-style verification on pairs of unseen designs, logged with each evaluation
    assert result.eval["verify_pairs"] > 0.65, result.eval
    assert 0 <= result.eval["verify_pairs_std"] < 0.5
    with open(tmp_path / "run" / "eval.csv") as f:
        assert "verify_pairs" in next(csv.DictReader(f))
    losses = [row["loss"] for row in result.history]
    assert losses[-1] < 0.7 * losses[0], losses
    chance = 1 / 120
    assert result.eval["top1"] > 8 * chance, result.eval  # unseen designs, 120 classes
    assert result.eval["top5"] > result.eval["top1"]
    with open(tmp_path / "run" / "train.csv") as f:
        assert len(list(csv.DictReader(f))) == len(result.history)
    # each rebuild records how much of the previous graph it replaced (none before the first)
    with open(tmp_path / "run" / "graph.csv") as f:
        graph_rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in graph_rows] == [0, 40, 80]
    assert graph_rows[0]["turnover"] == ""
    assert all(0 < float(r["turnover"]) <= 1 for r in graph_rows[1:]), graph_rows
    # every push carried its step's weight-decay clock, so the AMS clock is the total decay
    # the dense optimizer would have applied: sum over steps of -log(1 - row_lr * wd). The rows'
    # rate by hand: optim.head_lr unset, so the backbone's steady momentum step
    # lr / (1 - momentum) (the rows take none); linear over the 10 warm-up steps (the automatic
    # row warm-up, 3 * 120 / 64 steps, is shorter), then half a cosine to 0 at step 120.
    peak = cfg.optim.lr / (1 - cfg.optim.momentum)

    def row_lr(t: int) -> float:
        if t < 10:
            return peak * (t + 1) / 10
        return peak * 0.5 * (1 + math.cos(math.pi * (t - 10) / 110))

    assert (cfg.optim.head_lr, cfg.optim.head_momentum, cfg.optim.warmup_steps) == (0, 0, 10)
    total_decay = sum(-math.log1p(-row_lr(t) * cfg.optim.head_weight_decay) for t in range(120))
    clock = max(s["tables"]["fc"]["decay_clock"] for s in run.client.stats())
    assert clock == pytest.approx(total_decay, rel=1e-12)

    # export -> Classifier gives the same predictions as the trainer's evaluation; export reads
    # the finished run even when the config says to train afresh (train.resume = false)
    out = subprocess.run([sys.executable, "-m", "xcls", "export", "--out", str(tmp_path / "exp"),
                          "--set", "train.resume=false", str(tmp_path / "run" / "config.toml")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    clf = Classifier.load(tmp_path / "exp")
    test = LmdbImageDataset(glyphs_small / "test")
    images = torch.stack([test[i][1] for i in range(len(test))])
    labels = torch.tensor(test.labels())
    ids, scores = clf.predict(images, topk=5)
    assert ids.shape == (len(test), 5) and bool((scores[:, :-1] >= scores[:, 1:]).all())
    top1 = float((ids[:, 0] == labels).float().mean())
    assert abs(top1 - result.eval["top1"]) < 1e-6
    assert clf.names(ids[:1, :1])[0][0].startswith("U+")
    with pytest.raises(ValueError, match="images must be"):
        clf.predict(torch.zeros(2, 1, 32, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        clf.predict(torch.zeros(2, 1, 24, 24))

    # xcls predict: image files in, the Classifier's top-k out, one JSON line per image
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"img{i}.png")
        Image.fromarray(images[i, 0].numpy()).save(paths[-1])
    out = subprocess.run([sys.executable, "-m", "xcls", "predict", str(tmp_path / "exp"),
                          *map(str, paths), "--topk", "3"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["image"] for line in lines] == [str(p) for p in paths]
    assert [line["ids"] for line in lines] == ids[:3, :3].tolist()
    assert [line["classes"] for line in lines] == clf.names(ids[:3, :3])
    out = subprocess.run([sys.executable, "-m", "xcls", "predict", str(tmp_path / "exp"),
                          str(tmp_path / "missing.png")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and "missing.png: not a readable image" in out.stderr

    # --rows-dtype float16: unit rows in half the bytes, the same top-1 on nearly every image;
    # --onnx: the backbone for ONNX runtimes, giving the features the Classifier computes (the
    # command run in this process: the export above ran it as a process)
    assert main(["-q", "export", "--rows-dtype", "float16", "--onnx", "--out",
                 str(tmp_path / "exp16"), str(tmp_path / "run" / "config.toml")]) == 0
    session = onnxruntime.InferenceSession(str(tmp_path / "exp16" / "backbone.onnx"))
    onnx_features = session.run(["features"], {"images": images[:7].numpy()})[0]
    # against the backbone on the CPU, as ONNX runs here: on a GPU, convolutions in TF32
    # differ from it by ~1e-3
    on_cpu = Classifier.load(tmp_path / "exp16", device="cpu")
    torch.testing.assert_close(torch.from_numpy(onnx_features), on_cpu.embed(images[:7]),
                               atol=1e-4, rtol=1e-4)
    half = Classifier.load(tmp_path / "exp16")
    assert half.rows.dtype == torch.float16
    unit = torch.nn.functional.normalize(clf.rows.double(), dim=1)
    torch.testing.assert_close(half.rows.double(), unit, atol=2e-3, rtol=0)
    ids16, _ = half.predict(images, topk=1)
    assert float((ids16[:, 0] == ids[:, 0]).float().mean()) >= 0.98

    # --rows class-means: each row is the class's mean direction over the training images,
    # here recomputed sample by sample in float64 with the exported backbone
    assert main(["-q", "export", "--rows", "class-means", "--out", str(tmp_path / "exp-means"),
                 str(tmp_path / "run" / "config.toml")]) == 0
    means = Classifier.load(tmp_path / "exp-means")
    train = LmdbImageDataset(glyphs_small / "train")
    features = clf.embed(torch.stack([train[i][1] for i in range(len(train))])).double()
    expected = torch.zeros(120, features.shape[1], dtype=torch.float64)
    for f, y in zip(features, train.labels().tolist(), strict=True):
        expected[y] += f / f.norm()
    expected /= expected.norm(dim=1, keepdim=True)
    # on a GPU the run embeds under AMP (fp16), the Classifier in fp32: ~3e-4 apart, and an
    # image on a boundary may change sides
    amp = torch.cuda.is_available()
    torch.testing.assert_close(means.rows.double(), expected, atol=1e-3 if amp else 1e-4, rtol=0)
    assert '"rows": "class-means"' in (tmp_path / "exp-means" / "export.json").read_text()
    by_means = run.trainer.evaluator.evaluate(rows="class-means")
    ids, _ = means.predict(images, topk=1)
    assert abs(by_means["top1"] - float((ids[:, 0] == labels).float().mean())) \
        <= (1 / len(labels) if amp else 0) + 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")
@pytest.mark.parametrize("placement", ["ams", "collective"])
def test_cuda_run_with_amp_learns_and_resumes(glyphs_small, tmp_path, placement):
    """The GPU path: backbone under autocast with a gradient scaler, head in float32 on the
    GPU, rows in the host AMS, or in collective placement in a working copy in GPU memory that
    graph builds and evaluations read back from the host shard; a resumed run restores the
    scaler and carries on."""
    settings = {"train.device": "cuda", "train.amp": True, "train.max_steps": 120,
                "train.checkpoint_every": 60, "head.placement": placement}
    cfg = load_config(None, overrides(glyphs_small, tmp_path / "run", **settings))
    run = build_run(cfg)
    assert run.trainer.device.type == "cuda" and run.trainer._scaler is not None
    result = run.trainer.train()
    losses = [row["loss"] for row in result.history]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < 0.7 * losses[0], losses
    assert result.eval["top1"] > 8 / 120, result.eval
    scale = run.trainer._scaler.get_scale()
    run.client.close()

    cfg = load_config(None, overrides(glyphs_small, tmp_path / "run",
                                      **{**settings, "train.max_steps": 130}))
    resumed = build_run(cfg).trainer
    assert resumed.try_resume() and resumed.step == 120
    assert resumed._scaler.get_scale() == scale


@pytest.mark.parametrize("head_momentum", [0.0, 0.5])
def test_class_rows_take_sgd_with_the_configured_row_momentum(glyphs_small, tmp_path,
                                                               head_momentum):
    cfg = load_config(None, overrides(glyphs_small, tmp_path / "run", **{
        "optim.head_momentum": head_momentum, "optim.head_weight_decay": 0.01,
        "optim.weight_decay": 0.002}))
    run = build_run(cfg)
    # the rows take optim.head_weight_decay, the backbone optim.weight_decay
    assert run.trainer.optimizer.param_groups[0]["weight_decay"] == 0.002
    ids = torch.tensor([0, 7])
    w = run.client.pull("fc", ids).double().requires_grad_(True)
    reference = torch.optim.SGD([w], lr=0.3, momentum=head_momentum, weight_decay=0.01)
    for seed in (1, 2, 3):
        grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(seed))
        run.client.push("fc", ids, grad, lr=0.3)
        w.grad = grad.double()
        reference.step()
    torch.testing.assert_close(run.client.pull("fc", ids).double(), w.detach(), rtol=0,
                               atol=1e-6)


def test_a_growing_batch_scales_the_learning_rates_of_its_epochs(glyphs_small, tmp_path):
    n = len(LmdbImageDataset(glyphs_small / "train"))
    for scaling, factor in ((True, 2.0), (False, 1.0)):
        cfg = load_config(None, overrides(glyphs_small, tmp_path / f"run-{scaling}", **{
            "train.batch_schedule": "[32, 64]", "train.batch_lr_scaling": scaling,
            "train.epochs": 3, "optim.warmup_steps": 0, "optim.head_warmup_steps": 0,
            "optim.schedule": "constant", "optim.head_lr": 0.2, "train.log_every": 1,
            "data.test": ""}))
        run = build_run(cfg)
        first, then = n // 32, 2 * (n // 64)
        assert run.trainer.total_steps == first + then
        pushed = record_push_rates(run.client)
        run.trainer.train()
        # the rows' rate each step pushed with, and the backbone's each step logged
        assert pushed == [0.2] * first + [0.2 * factor] * then
        with open(tmp_path / f"run-{scaling}" / "train.csv", newline="") as f:
            logged = [float(row["lr"]) for row in csv.DictReader(f)]
        assert logged == [0.1] * first + [0.1 * factor] * then


def final_state(out: Path, step: int):
    """Backbone weights of the checkpoint and the class rows of its AMS snapshot."""
    from ams.shard.restore import read_piece
    from ams.shard.snapshot import step_dir

    shared = torch.load(out / "checkpoints" / f"step-{step:012d}" / "worker.pt",
                        weights_only=True)
    pieces = sorted(step_dir(out / "ams", step).iterdir())
    rows = [read_piece(p)[1]["fc"] for p in pieces]
    return shared["backbone"], rows


def test_resume_after_kill_or_sigterm_is_bit_identical(glyphs_small, tmp_path):
    args = overrides(glyphs_small, tmp_path, **{"train.max_steps": 36,
                                                "train.checkpoint_every": 12,
                                                "graph.rebuild_every": 10,
                                                "head.kind": "knn", "data.test": ""})
    cmd = [sys.executable, "-m", "xcls", "-q", "train", "/dev/null"]
    straight = tmp_path / "straight"
    subprocess.run([*cmd, *sum((["--set", a] for a in args), []), "--set",
                    f"train.out_dir={straight}"], check=True, timeout=600, capture_output=True)

    # one run, interrupted twice: SIGKILL after the step-12 checkpoint (it resumes from 12),
    # then SIGTERM once it is past 12 again (it checkpoints the step it is at, exits 143)
    run = [*cmd, *sum((["--set", a] for a in args), []), "--set",
           f"train.out_dir={tmp_path / 'interrupted'}"]
    checkpoints = tmp_path / "interrupted" / "checkpoints"
    proc = subprocess.Popen(run, stderr=subprocess.DEVNULL)
    marker = checkpoints / f"step-{12:012d}" / "worker.pt"
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists() and not (checkpoints / f"step-{36:012d}").exists()
    shutil.rmtree(checkpoints / f"step-{24:012d}", ignore_errors=True)

    proc = subprocess.Popen(run, stderr=subprocess.PIPE, text=True)
    marker = checkpoints / f"step-{24:012d}" / "worker.pt"
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    code, err = proc.wait(timeout=120), proc.stderr.read()
    assert code == 143, err
    step = int(re.search(r"stopped by SIGTERM after step (\d+)", err).group(1))
    assert 24 <= step < 36 and (checkpoints / f"step-{step:012d}").is_dir()
    subprocess.run(run, check=True, timeout=600, capture_output=True)

    a_backbone, a_rows = final_state(straight, 36)
    b_backbone, b_rows = final_state(tmp_path / "interrupted", 36)
    assert a_backbone.keys() == b_backbone.keys()
    for key in a_backbone:
        assert torch.equal(a_backbone[key], b_backbone[key]), key
    for a, b in zip(a_rows, b_rows, strict=True):
        assert torch.equal(a["rows"], b["rows"]) and torch.equal(a["state"], b["state"])
        assert torch.equal(a["graph_neighbors"], b["graph_neighbors"])
    # both stops fall inside a log window (every 10 steps): every line the interrupted run
    # logged, the replayed ones included, is the uninterrupted run's
    a_losses = dict(logged_losses(straight))
    b_losses = logged_losses(tmp_path / "interrupted")
    assert list(a_losses) == ["10", "20", "30", "36"] and {s for s, _ in b_losses} == set(a_losses)
    assert [(s, loss, a_losses[s]) for s, loss in b_losses if loss != a_losses[s]] == []


def logged_losses(out: Path) -> list[tuple[str, str]]:
    """(step, loss) of each line in the run's train.csv, replays after a resume included."""
    with open(out / "train.csv", newline="") as f:
        return [(row["step"], row["loss"]) for row in csv.DictReader(f)]


def test_hostile_inputs_give_clear_errors(glyphs_small, tmp_path, capsys):
    def argv(*sets: str) -> list[str]:
        args = overrides(glyphs_small, tmp_path / "run", **{"train.max_steps": 2})
        args += list(sets)
        return ["train", "/dev/null", *sum((["--set", a] for a in args), [])]

    # refused while the run is assembled: the command in this process
    for change, needle in ((f"data.train={tmp_path / 'nowhere'}", "nowhere"),
                           ("model.backbone=iresnet50", "112"),
                           ("model.backbone=vgg", "resnet_small")):
        assert main(argv(change)) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err

    # a corrupt record: training stops with an error naming the sample
    broken = tmp_path / "broken"
    shutil.copytree(glyphs_small / "train", broken)
    import lmdb

    env = lmdb.open(str(broken), max_dbs=4, subdir=True)
    db = env.open_db(b"samples")
    n = len(LmdbImageDataset(glyphs_small / "train"))
    with env.begin(write=True, db=db) as txn:
        for sample in range(0, n, 3):  # one in three: every batch meets one
            key = sample.to_bytes(8, "big")
            value = bytearray(txn.get(key))
            value[-3] ^= 0xFF
            txn.put(key, bytes(value))
    env.close()
    # refused while it trains: the command as a process, the same one line whether the
    # training process or a DataLoader worker process read the record
    for workers in (0, 2):
        out = subprocess.run([sys.executable, "-m", "xcls", *argv(
            f"data.train={broken}", "data.test=", f"data.num_workers={workers}")],
            capture_output=True, text=True, timeout=300)
        errors = [line for line in out.stderr.splitlines() if not line.startswith("ts=")]
        assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
        assert re.fullmatch(f"error: {broken}: sample \\d+: image bytes fail their CRC32 check "
                            r"\(corrupt record\)", errors[0]), errors


def test_graph_settings_this_host_or_data_cannot_run_are_refused_before_anything_is_written(
        glyphs_small, tmp_path, capsys):
    """graph.device and graph.k were used only at the first graph build, after the run's
    directory, snapshot and config.toml were written: a traceback from the graph search."""
    refusals = [("graph.device=banana", "graph.device: 'banana': not a device (cpu, cuda or "
                                        "cuda:N)"),
                ("graph.k=121", "graph.k=121 exceeds the 120 classes of data.train: lower "
                                "graph.k to at most 120")]
    if not torch.cuda.is_available():
        refusals.append(("graph.device=cuda", "graph.device: cuda: no CUDA device is available"))
    for change, line in refusals:
        args = overrides(glyphs_small, tmp_path / "run", **{"train.max_steps": 2})
        assert main(["train", "/dev/null", *sum((["--set", a] for a in [*args, change]), [])]) == 2
        assert capsys.readouterr().err == f"error: {line}\n"
        assert not (tmp_path / "run").exists()


def test_resume_under_another_batch_or_head_drops_the_prefetched_batches(glyphs_small, tmp_path,
                                                                         caplog):
    """A checkpoint's prefetched batches were loaded and selected under its batch size and
    head: resumed with other ones (data.batch_size, train.batch_schedule, head.*), the run
    loads and selects from the saved data position afresh, as with another worker count,
    rather than stepping on batches that no longer fit (data.batch_size: a ValueError
    traceback) or classes of the other head."""
    base = overrides(glyphs_small, tmp_path / "run", **{
        "train.max_steps": 2, "train.checkpoint_every": 2, "data.test": "",
        "train.log_every": 1})
    build_run(load_config(None, base)).trainer.train()
    for change, name in (("data.batch_size=32", "batch"), ("head.kind=full", "head"),
                         ("train.seed=0", "same")):
        out = tmp_path / name
        shutil.copytree(tmp_path / "run", out)
        caplog.clear()
        cfg = load_config(None, [*base, change, f"train.out_dir={out}", "train.max_steps=4"])
        result = build_run(cfg).trainer.train()
        dropped = "prefetched_batches_dropped" in caplog.text
        assert result.steps == 4 and dropped == (name != "same"), caplog.text
        rows = csv.DictReader((out / "train.csv").read_text().splitlines())
        active = [int(row["active"]) for row in rows]
        if name == "head":  # every step after the resume took the full head's 120 classes
            assert active[2:] == [120, 120], active


def test_an_out_dir_that_cannot_be_made_is_a_config_error(glyphs_small, tmp_path):
    (tmp_path / "a file").write_text("mine")
    for out in (tmp_path / "a file", tmp_path / "a file" / "run"):
        with pytest.raises(ConfigError, match=f"train.out_dir: cannot make {out} "):
            build_run(load_config(None, overrides(glyphs_small, out)))
    assert (tmp_path / "a file").read_text() == "mine"


def test_resume_into_a_changed_model_is_refused_naming_the_checkpoint(glyphs_small, tmp_path):
    """A config whose backbone or optimizer no longer fits the checkpoint in train.out_dir
    (resume, eval, export all read it): one CheckpointError naming it, not torch's
    multi-line traceback."""
    base = overrides(glyphs_small, tmp_path / "run", **{
        "train.max_steps": 2, "train.checkpoint_every": 2, "data.test": ""})
    build_run(load_config(None, base)).trainer.train()
    checkpoint = f"{tmp_path / 'run' / 'checkpoints'}/step-0+2: "
    for change, needle in (("model.dim=32", "its backbone does not fit this run's"),
                           ("optim.name=lars", "its optimizer state does not fit")):
        run = build_run(load_config(None, [*base, change]))
        with pytest.raises(CheckpointError, match=checkpoint + needle) as caught:
            run.trainer.try_resume()
        assert "\n" not in str(caught.value)
        run.client.close()


def test_touched_refresh_run_builds_once_then_refreshes(glyphs_small, tmp_path):
    cfg = load_config(None, overrides(glyphs_small, tmp_path / "run", **{
        "train.max_steps": 120, "graph.rebuild_every": 20, "graph.method": "ivf",
        "graph.refresh": "touched", "graph.full_every": 0, "data.test": ""}))
    result = build_run(cfg).trainer.train()
    losses = [row["loss"] for row in result.history]
    assert losses[-1] < 0.7 * losses[0], losses  # the knn head learns on refreshed lists
    with open(tmp_path / "run" / "graph.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 20, 40, 60, 80, 100]
    # one IVF build, with its measured recall, then only the touched classes' exact lists
    assert [(r["method"], r["refresh"]) for r in rows] == \
        [("ivf", "full")] + [("exact", "touched")] * 5
    assert 0.9 <= float(rows[0]["recall"]) <= 1 and int(rows[0]["classes"]) == 120
    assert all(r["recall"] == "" and 0 < int(r["classes"]) <= 120 for r in rows[1:]), rows
    assert all(0 < float(r["turnover"]) <= 1 for r in rows[1:]), rows


def test_a_resume_under_other_row_settings_is_refused_and_eval_keeps_the_runs_config(
        glyphs_small, tmp_path, capsys):
    """A snapshot brings its table's spec: resumed under another optim.head_momentum the rows
    trained on with the snapshot's momentum while the row update (and a GPU slice's working
    copy) took the config's. And eval's --set overrides were written into the run's
    config.toml, which every later eval and export reads as the run's own."""
    out = tmp_path / "run"
    args = overrides(glyphs_small, out, **{"train.max_steps": 2, "data.test": "",
                                           "graph.rebuild_every": 0})
    argv = ["train", "/dev/null", *sum((["--set", a] for a in args), [])]
    assert main(argv) == 0
    saved = (out / "config.toml").read_text()
    capsys.readouterr()

    assert main([*argv, "--set", "optim.head_momentum=0.5", "--set", "train.max_steps=4"]) == 2
    err = capsys.readouterr().err
    assert "momentum 0.0 (this run: 0.5)" in err and "Traceback" not in err, err
    assert (out / "config.toml").read_text() == saved  # the run's config is still its own

    done = subprocess.run([sys.executable, "-m", "xcls", "export", "--out", str(tmp_path / "e"),
                           "--set", "optim.head_lr=9.5", str(out / "config.toml")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (out / "config.toml").read_text() == saved
    assert "head_lr = 9.5" in (tmp_path / "e" / "config.toml").read_text()  # the export's own


def test_a_fresh_run_over_another_runs_checkpoints_is_refused(glyphs_small, tmp_path, capsys):
    """train.resume = false in a train.out_dir with checkpoints trained from step 0 beside
    them: pruning kept the old run's newer steps and dropped the new run's, and a restart or
    xcls eval took the old run's model for the new run's."""
    out = tmp_path / "run"
    args = overrides(glyphs_small, out, **{"train.max_steps": 3, "data.test": "",
                                           "graph.rebuild_every": 0})
    argv = ["train", "/dev/null", *sum((["--set", a] for a in args), [])]
    assert main(argv) == 0
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    capsys.readouterr()
    assert main([*argv, "--set", "train.resume=false", "--set", "train.seed=7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: train.resume = false, but train.out_dir") and \
        "newest step 3" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


def test_a_checkpoint_publishes_none_of_what_an_interrupted_attempt_staged(glyphs_small,
                                                                          tmp_path):
    """An attempt with two ranks that wrote its rank files and died before publishing left
    them in the step's staging directory; a later attempt with one rank published them with
    its own, and a resume with two ranks would replay rank 1's batches of the other attempt."""
    out = tmp_path / "run"
    staging = out / "checkpoints" / f"step-{2:012d}.staging"
    staging.mkdir(parents=True)
    torch.save({"prepared": [], "selector_rng": None, "world": 2}, staging / "rank-00001.pt")
    args = overrides(glyphs_small, out, **{"train.max_steps": 2, "data.test": "",
                                           "graph.rebuild_every": 0})
    assert main(["train", "/dev/null", *sum((["--set", a] for a in args), [])]) == 0
    published = out / "checkpoints" / f"step-{2:012d}"
    assert sorted(p.name for p in published.iterdir()) == ["rank-00000.pt", "worker.pt"]
