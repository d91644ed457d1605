"""LMDB image dataset: round trip, lazy open in DataLoader workers, clear errors on bad data."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import lmdb
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from workers.data import lmdb_dataset
from workers.data.class_names import NumberedClasses
from workers.data.errors import DatasetError
from workers.data.lmdb_dataset import (
    META_DB,
    META_KEY,
    SAMPLES_DB,
    LmdbImageDataset,
    LmdbImageWriter,
    close_dataset,
    encode_png,
    read_metadata,
    verify_dataset,
)


@pytest.fixture(autouse=True)
def small_write_batches(monkeypatch):
    """Seven records a transaction: a dataset of these tests takes several commits."""
    monkeypatch.setattr(lmdb_dataset, "WRITE_BATCH_RECORDS", 7)


def _write(path, images, labels, channels=1, num_classes=5, **kw):
    h, w = images.shape[1:3]
    with LmdbImageWriter(path, height=h, width=w, channels=channels,
                         class_names=[f"c{i}" for i in range(num_classes)], split="train",
                         **kw) as writer:
        for image, label in zip(images, labels, strict=True):
            writer.add(image, int(label))
    return writer.close_metadata


@pytest.fixture
def gray(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(40, 12, 10), dtype=np.uint8)
    labels = rng.integers(0, 5, size=40)
    path = tmp_path / "ds"
    _write(path, images, labels)
    return path, images, labels


def _poke(path, sample_id, fn):
    close_dataset(path)
    env = lmdb.open(str(path), max_dbs=2)
    db = env.open_db(SAMPLES_DB)
    with env.begin(write=True, db=db) as txn:
        key = sample_id.to_bytes(8, "big")
        txn.put(key, fn(txn.get(key)))
    env.close()


def test_round_trip_gray(gray):
    path, images, labels = gray
    ds = LmdbImageDataset(path)
    assert len(ds) == 40 and ds.metadata.height == 12 and ds.metadata.width == 10
    for i in range(40):
        sid, image, label = ds[i]
        assert sid.dtype == torch.int64 and int(sid) == i
        assert image.dtype == torch.uint8 and image.shape == (1, 12, 10)
        assert np.array_equal(image[0].numpy(), images[i])
        assert label.dtype == torch.int64 and int(label) == labels[i]
    assert np.array_equal(ds.labels(), labels)
    assert verify_dataset(path)["samples"] == 40


def test_round_trip_rgb(tmp_path):
    images = np.random.default_rng(1).integers(0, 256, size=(6, 8, 9, 3), dtype=np.uint8)
    _write(tmp_path / "rgb", images, [0, 1, 2, 0, 1, 2], channels=3, num_classes=3)
    ds = LmdbImageDataset(tmp_path / "rgb")
    _, image, _ = ds[4]
    assert image.shape == (3, 8, 9)
    assert np.array_equal(image.permute(1, 2, 0).numpy(), images[4])


def test_dataloader_two_workers(gray):
    path, images, labels = gray
    ds = LmdbImageDataset(path)
    ds[0]  # open the env in the parent: workers must reopen their own after fork
    loader = DataLoader(ds, batch_size=8, num_workers=2, shuffle=True)
    seen = {}
    for sids, batch, labs in loader:
        assert batch.shape[1:] == (1, 12, 10)
        for sid, img, lab in zip(sids.tolist(), batch, labs.tolist(), strict=True):
            seen[sid] = lab
            assert np.array_equal(img[0].numpy(), images[sid])
    assert seen == {i: int(labels[i]) for i in range(40)}


def test_flipped_byte_names_sample(gray):
    path, _, _ = gray
    _poke(path, 3, lambda v: v[:-5] + bytes([v[-5] ^ 0xFF]) + v[-4:])
    with pytest.raises(DatasetError, match="sample 3.*CRC32"):
        LmdbImageDataset(path)[3]


@pytest.mark.parametrize("height,width", [(0, 8), (8, -1), (5000, 8)])
def test_writer_refuses_an_image_side_out_of_range(tmp_path, height, width):
    with pytest.raises(DatasetError, match=r"must be in \[1, 4096\] pixels"):
        LmdbImageWriter(tmp_path / "w", height=height, width=width, channels=1,
                        class_names=["a"], split="train")
    assert list(tmp_path.iterdir()) == []


def test_truncated_record(gray):
    path, _, _ = gray
    _poke(path, 5, lambda v: v[:-10])
    with pytest.raises(DatasetError, match="sample 5: record truncated"):
        LmdbImageDataset(path)[5]
    _poke(path, 6, lambda v: v[:4])
    with pytest.raises(DatasetError, match="sample 6: record truncated"):
        LmdbImageDataset(path)[6]
    with pytest.raises(DatasetError, match="sample 5"):
        verify_dataset(path)


def test_wrong_image_size_rejected_by_writer_and_reader(tmp_path, gray):
    path, _, _ = gray
    writer = LmdbImageWriter(tmp_path / "w", height=12, width=10, channels=1,
                             class_names=["a"], split="train")
    with pytest.raises(DatasetError, match="sample 0: image is"):
        writer.add(np.zeros((11, 10), np.uint8), 0)
    writer.abort()
    assert not (tmp_path / "w").exists()
    # A record whose PNG is the wrong size, with a valid header and CRC.
    import struct
    import zlib

    from workers.data.lmdb_dataset import FORMAT_VERSION, RECORD_HEADER, RECORD_MAGIC
    png = encode_png(np.zeros((5, 5), np.uint8))
    _poke(path, 2, lambda v: RECORD_HEADER.pack(RECORD_MAGIC, FORMAT_VERSION, 0, len(png),
                                                zlib.crc32(png)) + png)
    assert struct.calcsize("<4sHqII") == RECORD_HEADER.size
    with pytest.raises(DatasetError, match=r"sample 2: image is \(5, 5\)"):
        LmdbImageDataset(path)[2]


@pytest.mark.parametrize("height,width,match", [
    # past PIL's decompression-bomb guard: refused when the header is read
    (60_000, 60_000, r"sample 2: image does not decode \(Image size \(3600000000 pixels\)"),
    # below the guard but not the dataset's size: refused before a pixel is decompressed
    # (the declared pixel data does not decode, so a reader that decoded would say so)
    (12_000, 12_000, r"sample 2: image is \(12000, 12000\) \(H, W\), dataset says"),
])
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL's, on open
def test_a_record_declaring_a_huge_image_is_refused_from_its_header(gray, height, width,
                                                                     match):
    import zlib

    from tests.conftest import png_declaring
    from workers.data.lmdb_dataset import FORMAT_VERSION, RECORD_HEADER, RECORD_MAGIC
    path, _, _ = gray
    png = png_declaring(height, width)
    _poke(path, 2, lambda v: RECORD_HEADER.pack(RECORD_MAGIC, FORMAT_VERSION, 0, len(png),
                                                zlib.crc32(png)) + png)
    with pytest.raises(DatasetError, match=match):
        LmdbImageDataset(path)[2]


@pytest.mark.parametrize("raw, match", [
    (b"\xff\xfe garbage", "not valid JSON"),
    (b"[1, 2]", "not a JSON object"),
    pytest.param(b"[" * 100_000, "not valid JSON", id="too-deep"),
    (json.dumps({"format": "other"}).encode(), "'format'"),
])
def test_garbage_metadata(gray, raw, match):
    path, _, _ = gray
    close_dataset(path)
    env = lmdb.open(str(path), max_dbs=2)
    with env.begin(write=True, db=env.open_db(META_DB)) as txn:
        txn.put(META_KEY, raw)
    env.close()
    with pytest.raises(DatasetError, match=match):
        read_metadata(path)


def _set_metadata_field(path, name, value) -> None:
    close_dataset(path)
    env = lmdb.open(str(path), max_dbs=2)
    db = env.open_db(META_DB)
    with env.begin(write=True, db=db) as txn:
        meta = json.loads(txn.get(META_KEY))
        meta[name] = value
        txn.put(META_KEY, json.dumps(meta).encode())
    env.close()


def test_bad_metadata_field(gray):
    path, _, _ = gray
    _set_metadata_field(path, "height", "tall")
    with pytest.raises(DatasetError, match="'height'"):
        LmdbImageDataset(path)


@pytest.mark.parametrize("names, expected", [
    (None, NumberedClasses(5)),
    ("numbered", DatasetError),
    (["a", "b"], DatasetError),
    ({"count": 4}, DatasetError),
    ([0, 1, 2, 3, 4], DatasetError),
])
def test_class_names_in_the_metadata(gray, names, expected):
    """A list of num_classes names, or null (classes named by their ids); nothing else."""
    path, _, _ = gray
    _set_metadata_field(path, "class_names", names)
    if expected is DatasetError:
        with pytest.raises(DatasetError, match=r"'class_names' must be a list of 5 class names "
                           r"\(strings\), or null \(numbered\)"):
            read_metadata(path)
    else:
        assert read_metadata(path).class_names == expected


def noise_dataset(path, n=300, side=32):
    """A dataset whose data.mdb spans many pages (noise does not compress); its data.mdb."""
    images = np.random.default_rng(3).integers(0, 256, size=(n, side, side), dtype=np.uint8)
    _write(path, images, np.arange(n) % 5)
    return path / "data.mdb"


def truncate(data, size):
    with open(data, "r+b") as f:
        f.truncate(size)


# where an interrupted copy or download may have stopped, from the file's size
CUTS = {"half": lambda size: size // 2, "one page short": lambda size: size - 4096,
        "the meta pages only": lambda size: 8192, "one meta page": lambda size: 4096,
        "inside the first page": lambda size: 100, "empty": lambda size: 0}


@pytest.mark.parametrize("cut", CUTS)
def test_a_truncated_data_file_is_one_line_not_a_bus_error(tmp_path, cut):
    data = noise_dataset(tmp_path / "ds")
    truncate(data, CUTS[cut](data.stat().st_size))
    out = subprocess.run([sys.executable, "-m", "xcls", "data", "info", str(tmp_path / "ds")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2  # it was killed by SIGBUS (a shell's exit code 135)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {data}: truncated")


OPEN_DATASET = """
import sys
from workers.data.errors import DatasetError
from workers.data.lmdb_dataset import LmdbImageDataset
try:
    LmdbImageDataset(sys.argv[1])
except DatasetError as e:
    print(e)
"""


def test_a_truncated_data_file_raises_dataset_error(tmp_path):
    data = noise_dataset(tmp_path / "ds")
    size = data.stat().st_size
    truncate(data, size // 2)
    # in a process of its own: without the check, opening it kills the process
    out = subprocess.run([sys.executable, "-c", OPEN_DATASET, str(tmp_path / "ds")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(rf"{re.escape(str(data))}: truncated: {size // 2} bytes, its meta page "
                        rf"says {size} \(\d+ pages of \d+\); an interrupted copy or download\? "
                        "copy or build it again", out.stdout.strip())


def test_a_data_file_truncated_under_a_dataloader_fails_its_workers_cleanly(tmp_path):
    data = noise_dataset(tmp_path / "ds")
    ds = LmdbImageDataset(tmp_path / "ds")
    ds[0]  # the parent has the file open (and never reads it again)
    truncate(data, data.stat().st_size // 2)
    # each worker opens the file again after fork: a DatasetError, not "killed by signal: Bus
    # error"
    with pytest.raises(DatasetError, match=f"{data}: truncated"):
        for _ in DataLoader(ds, batch_size=8, num_workers=2):
            pass


def test_missing_dataset(tmp_path):
    with pytest.raises(DatasetError, match="no dataset here"):
        LmdbImageDataset(tmp_path / "nope")


def test_atomic_write_leaves_nothing_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with LmdbImageWriter(tmp_path / "x", height=4, width=4, channels=1,
                             class_names=["a"], split="train") as writer:
            writer.add(np.zeros((4, 4), np.uint8), 0)
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_map_grows_past_initial_size(tmp_path, monkeypatch):
    monkeypatch.setattr(LmdbImageWriter, "INITIAL_MAP_SIZE", 64 << 10)
    images = np.random.default_rng(2).integers(0, 256, size=(30, 64, 64), dtype=np.uint8)
    _write(tmp_path / "big", images, [0] * 30, num_classes=1)
    assert verify_dataset(tmp_path / "big")["samples"] == 30


def test_existing_path_refused_then_overwritten(gray):
    path, images, _ = gray
    with pytest.raises(DatasetError, match="already exists"):
        _write(path, images[:2], [0, 1])
    _write(path, images[:2], [0, 1], overwrite=True)
    assert len(LmdbImageDataset(path)) == 2
