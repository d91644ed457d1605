"""Folder and insightface RecordIO importers, including hostile inputs."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image

from workers.data.errors import DatasetError
from workers.data.importers import RECORDIO_MAGIC, import_folder, import_recordio
from workers.data.lmdb_dataset import LmdbImageDataset


def _png(value, size=(10, 8), mode="RGB"):
    buf = io.BytesIO()
    Image.new(mode, size, value).save(buf, format="PNG")
    return buf.getvalue()


def _record(payload: bytes) -> bytes:
    pad = (-len(payload)) % 4
    return struct.pack("<II", RECORDIO_MAGIC, len(payload)) + payload + b"\0" * pad


def _write_rec(tmp_path, images_labels, header=True, multi_label=False):
    """insightface layout: record 0 is a header whose label (id, id2) is the image range."""
    rec, idx = bytearray(), []
    entries = []
    n = len(images_labels)
    if header:
        entries.append((0, struct.pack("<IfQQ", 0, float(n + 1), n + 1, n + 1)))
    for i, (image, label) in enumerate(images_labels, start=1):
        if multi_label:
            head = struct.pack("<IfQQ", 2, 0.0, i, 0) + struct.pack("<ff", label, 7.0)
        else:
            head = struct.pack("<IfQQ", 0, float(label), i, 0)
        entries.append((i, head + image))
    for key, payload in entries:
        idx.append(f"{key}\t{len(rec)}")
        rec += _record(payload)
    (tmp_path / "train.rec").write_bytes(bytes(rec))
    (tmp_path / "train.idx").write_text("\n".join(idx) + "\n")
    return tmp_path / "train.rec"


@pytest.mark.parametrize("multi_label", [False, True])
def test_rec_round_trip(tmp_path, multi_label):
    items = [(_png((i * 20, 0, 0)), i % 3) for i in range(7)]
    rec = _write_rec(tmp_path, items, multi_label=multi_label)
    meta = import_recordio(rec, tmp_path / "ds", size=8, channels=3)
    assert meta.num_samples == 7 and meta.num_classes == 3
    ds = LmdbImageDataset(tmp_path / "ds")
    _, image, label = ds[4]
    assert image.shape == (3, 8, 8) and int(label) == 4 % 3
    assert int(image[0, 0, 0]) == 80


def test_rec_bad_magic(tmp_path):
    rec = _write_rec(tmp_path, [(_png(1), 0)])
    data = bytearray(rec.read_bytes())
    data[0] ^= 0xFF
    rec.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="bad RecordIO magic"):
        import_recordio(rec, tmp_path / "ds", size=8, channels=3)


def test_rec_truncated(tmp_path):
    rec = _write_rec(tmp_path, [(_png(1), 0), (_png(2), 1)])
    rec.write_bytes(rec.read_bytes()[:-30])
    with pytest.raises(DatasetError, match="truncated"):
        import_recordio(rec, tmp_path / "ds", size=8, channels=3)
    assert not (tmp_path / "ds").exists()


def test_rec_idx_past_eof(tmp_path):
    rec = _write_rec(tmp_path, [(_png(1), 0)])
    (tmp_path / "train.idx").write_text("0\t0\n1\t999999\n")
    with pytest.raises(DatasetError, match="past the end"):
        import_recordio(rec, tmp_path / "ds", size=8, channels=3)


def test_rec_bad_idx_line(tmp_path):
    rec = _write_rec(tmp_path, [(_png(1), 0)])
    (tmp_path / "train.idx").write_text("zero zero\n")
    with pytest.raises(DatasetError, match="train.idx:1"):
        import_recordio(rec, tmp_path / "ds", size=8, channels=3)


def test_rec_non_image_bytes(tmp_path):
    rec = _write_rec(tmp_path, [(b"definitely not an image", 0)])
    with pytest.raises(DatasetError, match="record 1: not a readable image"):
        import_recordio(rec, tmp_path / "ds", size=8, channels=3)


def test_rec_missing_files(tmp_path):
    with pytest.raises(DatasetError, match="file not found"):
        import_recordio(tmp_path / "train.rec", tmp_path / "ds", size=8, channels=3)


def test_folder_round_trip_gray(tmp_path):
    root = tmp_path / "src"
    for c, value in (("cat", 10), ("dog", 200)):
        (root / c).mkdir(parents=True)
        for k in range(3):
            Image.new("L", (12, 9), value + k).save(root / c / f"{k}.png")
    (root / "dog" / "notes.txt").write_text("ignored")
    meta = import_folder(root, tmp_path / "ds", size=6, channels=1)
    assert meta.class_names == ["cat", "dog"] and meta.num_samples == 6
    ds = LmdbImageDataset(tmp_path / "ds")
    _, image, label = ds[4]
    assert image.shape == (1, 6, 6) and int(label) == 1
    assert np.all(image.numpy() == 201)


def test_folder_empty(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    with pytest.raises(DatasetError, match="no images found"):
        import_folder(tmp_path / "src", tmp_path / "ds", size=6, channels=1)


def test_folder_non_image(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.jpg").write_bytes(b"nope")
    with pytest.raises(DatasetError, match="x.jpg: not a readable image"):
        import_folder(tmp_path / "src", tmp_path / "ds", size=6, channels=1)
    assert not (tmp_path / "ds").exists()
