"""Export directories as ``Classifier.load`` and ``xcls predict`` read them: an intact one
classifies as a float64 brute force does; a damaged or foreign one is refused with one line
naming the file, and reading it changes none of its files."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from workers import predict
from workers.backbones import build_backbone
from workers.data.class_names import NumberedClasses
from workers.predict import Classifier, write_export
from xcls.cli import main

CLASSES, DIM, SIZE = 10, 16, 32


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, torch.nn.Module, torch.Tensor]:
    """An export, and what it was written from: the backbone and the class rows (row i is
    class i's), handed over in blocks of shuffled class ids as training streams them."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("export") / "model"
    backbone = build_backbone("resnet_small", DIM, 1, SIZE)
    rows = torch.randn(CLASSES, DIM)
    order = torch.randperm(CLASSES, generator=torch.Generator().manual_seed(5))
    blocks = [(ids, rows[ids]) for ids in torch.split(order, 4)]  # 4 + 4 + 2 classes
    write_export(out, backbone, blocks,
                 backbone_name="resnet_small", num_classes=CLASSES, dim=DIM, image_size=SIZE,
                 channels=1, class_names=[f"class{i}" for i in range(CLASSES)], step=1,
                 config_toml="")
    return out, backbone, rows


@pytest.fixture(scope="module")
def export(written) -> Path:
    return written[0]


def test_an_intact_export_classifies_as_the_float64_brute_force(written):
    """Top-3 classes by cosine, worked out in float64 from what the export was written from:
    a float64 copy of the backbone (eval mode) on the images scaled to [-1, 1] as
    images / 127.5 - 1, against the rows handed to write_export, by class id."""
    export, backbone, rows = written
    noise = torch.randint(0, 256, (5, SIZE, SIZE), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(1))
    # an untrained backbone maps noise to nearly one direction: flat, graded and checkered
    # images land elsewhere, and with them other classes
    x = torch.arange(SIZE).expand(SIZE, SIZE)
    shapes = torch.stack([torch.full((SIZE, SIZE), 10), torch.full((SIZE, SIZE), 245),
                          x * 255 // (SIZE - 1), (x // 4 + x.t() // 4) % 2 * 255])
    images = torch.cat([noise, shapes.to(torch.uint8)])
    net = copy.deepcopy(backbone).double().eval()
    with torch.no_grad():
        # resnet_small's layers one after the other (its forward keeps the embedding layer in
        # float32 on purpose): stem, stages, global mean pool, fc, batch norm
        pooled = net.stages(net.stem(images[:, None].double() / 127.5 - 1)).mean(dim=(2, 3))
        features = net.bn(net.fc(pooled))
    cosines = (features / features.norm(dim=1, keepdim=True)) @ (
        rows.double() / rows.double().norm(dim=1, keepdim=True)).t()
    ref_scores, ref_ids = cosines.topk(3, dim=1)
    # no near-tie among the top 4 that float32 could order either way
    assert (-cosines.topk(4, dim=1).values.diff(dim=1)).min() > 1e-4

    clf = Classifier.load(export, device="cpu")
    ids, scores = clf.predict(images, topk=3)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(scores.double(), ref_scores, atol=1e-5, rtol=0)
    assert clf.names(ids[:1, :1]) == [[f"class{int(ref_ids[0, 0])}"]]


def test_the_batch_size_is_the_backbones_forward_pass(export, tmp_path):
    """xcls predict --batch-size was cut to 512 images per pass whatever it said."""
    clf = Classifier.load(export, device="cpu")
    passes: list[int] = []
    clf.backbone.register_forward_hook(lambda module, args, out: passes.append(len(out)))
    images = torch.randint(0, 256, (5, SIZE, SIZE), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(2))
    ids, _ = clf.predict(images, topk=2, batch_size=2)
    assert passes == [2, 2, 1]
    assert torch.equal(ids, clf.predict(images, topk=2)[0])  # the same classes in one pass
    assert passes[3:] == [5]
    files = []
    for i, image in enumerate(images.numpy()):
        files.append(tmp_path / f"{i}.png")
        Image.fromarray(image).save(files[-1])
    # the command's own classifier: every backbone's forward pass, seen by torch's global hook
    passes.clear()
    kind = type(clf.backbone)
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: passes.append(len(out)) if type(module) is kind else None)
    try:
        assert main(["predict", str(export), *map(str, files), "--batch-size", "700",
                     "--device", "cpu"]) == 0
        assert main(["predict", str(export), *map(str, files), "--batch-size", "3",
                     "--device", "cpu"]) == 0
    finally:
        hook.remove()
    assert passes == [5, 3, 2]


def test_numbered_classes_are_stored_as_null_and_named_by_their_ids(tmp_path):
    """A .rec import's classes are named by number: the export stores no list of them."""
    out = write_export(tmp_path / "model", build_backbone("resnet_small", DIM, 1, SIZE),
                       [(torch.arange(CLASSES), torch.randn(CLASSES, DIM))],
                       backbone_name="resnet_small", num_classes=CLASSES, dim=DIM,
                       image_size=SIZE, channels=1, class_names=NumberedClasses(CLASSES),
                       step=1, config_toml="")
    assert json.loads((out / "classes.json").read_text()) is None
    clf = Classifier.load(out, device="cpu")
    assert clf.names(torch.tensor([[7, 0], [9, 3]])) == [["7", "0"], ["9", "3"]]


def _meta(**fields) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        meta = json.loads((d / "export.json").read_text())
        meta.update(fields)
        (d / "export.json").write_text(json.dumps({k: v for k, v in meta.items()
                                                   if v is not None}))
    return damage


def _truncate(name: str, size: int) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes((d / name).read_bytes()[:size])


def _rows(array: np.ndarray) -> Callable[[Path], None]:
    return lambda d: np.save(d / "rows.npy", array)


def _classes(text: str | bytes) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        data = text.encode() if isinstance(text, str) else text
        (d / "classes.json").write_bytes(data)
    return damage


DAMAGE = {
    "export.json a list": (lambda d: (d / "export.json").write_text("[1, 2]"),
                           "export.json: not an xcls export"),
    "export.json nested too deep": (lambda d: (d / "export.json").write_text("[" * 100_000),
                                    "not an xcls export"),
    "backbone missing": (_meta(backbone=None), "backbone must be a string"),
    "dim a string": (_meta(dim="16"), "dim must be a positive integer, got '16'"),
    "num_classes a float": (_meta(num_classes=10.0), "num_classes must be a positive integer"),
    "image_size 0": (_meta(image_size=0), "image_size must be a positive integer"),
    "5 channels": (_meta(channels=5), "channels must be 1 or 3"),
    "dim of another backbone": (lambda d: (_meta(dim=32)(d),
                                           _rows(np.zeros((CLASSES, 32), np.float32))(d)),
                                "not the weights of a resnet_small of dim 32"),
    "dim of other rows": (_meta(dim=4096), r"rows.npy: <f4 \(10, 16\), the export holds rows "
                                           r"of shape \(10, 4096\)"),
    "dim wider than any table": (_meta(dim=10**9), "dim must be at most 65536, got 1000000000"),
    "weights truncated": (_truncate("backbone.safetensors", 100),
                          "backbone.safetensors: not the weights"),
    "weights garbage": (lambda d: (d / "backbone.safetensors").write_bytes(b"\xff" * 999),
                        "backbone.safetensors: not the weights"),
    "rows truncated": (_truncate("rows.npy", 300), "rows.npy: not a row array"),
    "rows of Python objects": (lambda d: np.save(d / "rows.npy", np.array([{}] * CLASSES),
                                                 allow_pickle=True),
                               "rows.npy: not a row array"),
    "rows int64": (_rows(np.zeros((CLASSES, DIM), np.int64)), "rows.npy: <i8"),
    "rows float64": (_rows(np.zeros((CLASSES, DIM), np.float64)), "rows.npy: <f8"),
    "rows big-endian": (_rows(np.zeros((CLASSES, DIM), ">f4")), "rows.npy: >f4"),
    "rows of another shape": (_rows(np.zeros((CLASSES, DIM, 1), np.float32)),
                              r"rows.npy: <f4 \(10, 16, 1\)"),
    "class names short": (_classes('["a"]'), "must be a list of 10 class names"),
    "class names numbers": (_classes(json.dumps(list(range(CLASSES)))),
                            "must be a list of 10 class names"),
    "class names an object": (_classes('{"0": "a"}'), "must be a list of 10 class names"),
    "class names a string": (_classes('"numbered"'), "must be a list of 10 class names"),
    "class names not UTF-8": (_classes(b'["\xff"]'), "classes.json: 'utf-8' codec"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_export_is_refused_naming_the_file(export, tmp_path, case):
    damage, message = DAMAGE[case]
    model = tmp_path / "model"
    shutil.copytree(export, model)
    damage(model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    with pytest.raises(ValueError, match=message):
        Classifier.load(model, device="cpu")
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_a_non_finite_row_is_refused_at_prediction(export, tmp_path, monkeypatch):
    """A NaN row would score NaN, which topk ranks first: every image would get its class."""
    model = tmp_path / "model"
    shutil.copytree(export, model)
    rows = np.load(model / "rows.npy")
    rows[7, 3] = np.nan
    np.save(model / "rows.npy", rows)
    clf = Classifier.load(model, device="cpu")
    with pytest.raises(ValueError, match="class row 7 holds a non-finite value"):
        monkeypatch.setattr(predict, "PREDICT_BLOCK_ROWS", 4)  # row 7 in the second block
        clf.predict(torch.zeros(1, SIZE, SIZE, dtype=torch.uint8))


def test_a_device_this_host_lacks_is_refused(export):
    with pytest.raises(ValueError, match="cuda:99: (no CUDA device is available|this host has)"):
        Classifier.load(export, device="cuda:99")


@pytest.mark.parametrize("damage", ["backbone missing", "weights truncated", "nan row",
                                    "device cuda:99"])
def test_cli_predict_on_a_damaged_export_is_one_line(export, tmp_path, capsys, damage):
    model = tmp_path / "model"
    shutil.copytree(export, model)
    device = "cpu"
    if damage == "nan row":
        _rows(np.full((CLASSES, DIM), np.nan, np.float32))(model)
    elif damage == "device cuda:99":
        device = "cuda:99"
    else:
        DAMAGE[damage][0](model)
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((SIZE, SIZE), np.uint8)).save(image)
    assert main(["predict", str(model), str(image), "--device", device]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {model}") and captured.err.count("\n") == 1, \
        captured.err


def _write(out: Path, rows_blocks, num_classes: int = CLASSES) -> Path:
    return write_export(out, build_backbone("resnet_small", DIM, 1, SIZE), rows_blocks,
                        backbone_name="resnet_small", num_classes=num_classes, dim=DIM,
                        image_size=SIZE, channels=1,
                        class_names=[f"class{i}" for i in range(num_classes)], step=2,
                        config_toml="")


def test_an_export_replaces_an_older_one_whole(export, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(export, model)
    (model / "backbone.onnx").write_bytes(b"from the older export")
    rows = torch.randn(CLASSES + 2, DIM, dtype=torch.float64)
    _write(model, [(torch.arange(CLASSES + 2), rows)], num_classes=CLASSES + 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging left
    assert not (model / "backbone.onnx").exists()
    assert json.loads((model / "export.json").read_text())["step"] == 2
    assert torch.equal(torch.from_numpy(np.load(model / "rows.npy")), rows.float())


def test_a_failed_export_leaves_the_older_one_and_nothing_else(export, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(export, model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}

    def blocks_then_a_full_disk():
        yield torch.arange(4), torch.randn(4, DIM)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        _write(model, blocks_then_a_full_disk())
    with pytest.raises(ValueError, match="the row blocks covered 4 rows, expected 10"):
        _write(model, [(torch.arange(4), torch.randn(4, DIM))])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_a_directory_that_is_not_an_export_is_not_replaced(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not an xcls export"):
        _write(tmp_path, [(torch.arange(CLASSES), torch.randn(CLASSES, DIM))])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    (tmp_path / "a file").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not an xcls export"):
        _write(tmp_path / "a file", [(torch.arange(CLASSES), torch.randn(CLASSES, DIM))])
    assert (tmp_path / "a file").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    _write(empty, [(torch.arange(CLASSES), torch.randn(CLASSES, DIM))])
    assert Classifier.load(empty, device="cpu").rows.shape == (CLASSES, DIM)


def test_export_files_are_readable_as_the_umask_says(tmp_path):
    """Every file of an export takes the process's umask (0644 under 022), as any file a
    command writes: a model directory is shared (safetensors wrote its file 0600)."""
    import os

    before = os.umask(0o022)
    try:
        out = write_export(tmp_path / "model", build_backbone("resnet_small", DIM, 1, SIZE),
                           [(torch.arange(CLASSES), torch.randn(CLASSES, DIM))],
                           backbone_name="resnet_small", num_classes=CLASSES, dim=DIM,
                           image_size=SIZE, channels=1,
                           class_names=[f"class{i}" for i in range(CLASSES)], step=1,
                           config_toml="")
    finally:
        os.umask(before)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert modes == dict.fromkeys(modes, "0o644") and "backbone.safetensors" in modes, modes
    assert oct(out.stat().st_mode & 0o777) == "0o755"
