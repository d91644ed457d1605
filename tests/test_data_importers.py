"""Folder and insightface RecordIO importers, including hostile inputs."""

from __future__ import annotations

import io
import json
import os
import resource
import struct
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from workers.data.errors import DatasetError
from workers.data.importers import (
    RECORDIO_MAGIC,
    import_folder,
    import_folder_splits,
    import_recordio,
)
from workers.data.lmdb_dataset import LmdbImageDataset, read_metadata


def _png(value, size=(10, 8), mode="RGB"):
    buf = io.BytesIO()
    Image.new(mode, size, value).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg(value, size=(8, 8), mode="RGB"):
    buf = io.BytesIO()
    Image.new(mode, size, value).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _pack(label, image: bytes, index: int) -> bytes:
    """MXNet's recordio.pack: IRHeader <IfQQ (flag, label, id, id2); an array label becomes
    flag = its length, label 0, and its float32 values before the image."""
    if isinstance(label, (int, float)):
        return struct.pack("<IfQQ", 0, float(label), index, 0) + image
    values = np.asarray(label, dtype=np.float32)
    return struct.pack("<IfQQ", values.size, 0.0, index, 0) + values.tobytes() + image


def _write_rec(tmp_path, images_labels, header=True):
    """A .rec/.idx pair byte for byte as MXNet's MXIndexedRecordIO writes it (magic, length
    word, payload, padding to 4 bytes; '.idx' lines 'index<TAB>offset'), in insightface's
    layout: record 0 is a header whose labels are (first identity record, end of identity
    records), the images are 1..n, and one record per identity follows them."""
    n = len(images_labels)
    firsts = [float(np.asarray(label).reshape(-1)[0]) for _, label in images_labels]
    identities = sorted({int(v) for v in firsts if np.isfinite(v)})
    entries = []
    if header:
        entries.append((0, _pack([n + 1, n + 1 + len(identities)], b"", 0)))
    for i, (image, label) in enumerate(images_labels, start=1 if header else 0):
        entries.append((i, _pack(label, image, i)))
    if header:
        for j, identity in enumerate(identities):
            entries.append((n + 1 + j, _pack([1.0 + identity, 2.0 + identity], b"", n + 1 + j)))
    return _write_entries(tmp_path, entries)


def _write_entries(tmp_path, entries):
    """train.rec and train.idx holding ``entries``, (index, payload) pairs, in this order."""
    rec, idx = bytearray(), []
    for key, payload in entries:
        idx.append(f"{key}\t{len(rec)}")
        rec += struct.pack("<II", RECORDIO_MAGIC, len(payload)) + payload
        rec += b"\0" * ((-len(payload)) % 4)
    (tmp_path / "train.rec").write_bytes(bytes(rec))
    (tmp_path / "train.idx").write_text("\n".join(idx) + "\n")
    return tmp_path / "train.rec"


@pytest.mark.parametrize("workers", [1, 2])
def test_rec_in_insightface_layout(tmp_path, workers):
    # Scalar and array labels mixed; JPEGs of the dataset's size, and PNGs of another size.
    items = []
    for i in range(9):
        image = _jpeg((i * 20, 0, 0)) if i % 2 else _png((i * 20, 0, 0))
        items.append((image, float(i % 4) if i % 3 else [float(i % 4), 0.5, 7.0]))
    rec = _write_rec(tmp_path, items)
    meta = import_recordio(rec, tmp_path / "ds", size=8, channels=3, workers=workers)
    assert meta.num_samples == 9 and meta.num_classes == 4  # identity records not imported
    ds = LmdbImageDataset(tmp_path / "ds")
    assert ds.labels().tolist() == [i % 4 for i in range(9)]
    for i, (image, _) in enumerate(items):
        _, stored = ds.read_record(i)
        if i % 2:
            assert stored == image  # the JPEG is kept byte for byte
        else:
            assert stored[:8] == b"\x89PNG\r\n\x1a\n" and stored != image  # resized
        _, pixels, _ = ds[i]
        assert pixels.shape == (3, 8, 8)
        assert abs(int(pixels[0, 4, 4]) - i * 20) <= 3  # JPEG is lossy


def test_rec_without_header_imports_every_record(tmp_path):
    # Record 0 is an image (flag 0), not a header.
    rec = _write_rec(tmp_path, [(_png(1), 0), (_png(2), 1), (_png(3), 1)], header=False)
    meta = import_recordio(rec, tmp_path / "ds", size=8, channels=3)
    assert meta.num_samples == 3 and meta.num_classes == 2


@pytest.mark.parametrize("label", [-1.0, 2.5, float("nan"), [float("inf"), 1.0]])
def test_rec_label_that_is_not_a_class(tmp_path, label):
    rec = _write_rec(tmp_path, [(_png(1), 0.0), (_png(2), label)])
    with pytest.raises(DatasetError, match="record 2 has label .* whole number"):
        import_recordio(rec, tmp_path / "ds", size=8, channels=3)
    assert not (tmp_path / "ds").exists()


def test_rec_header_range_past_the_index(tmp_path):
    rec = _write_rec(tmp_path, [(_png(1), 0), (_png(2), 1)])
    lines = (tmp_path / "train.idx").read_text().splitlines()
    (tmp_path / "train.idx").write_text("\n".join(lines[:2]) + "\n")  # record 2 dropped
    with pytest.raises(DatasetError, match="no record 2"):
        import_recordio(rec, tmp_path / "ds", size=8, channels=3)


# The address space of an import of a lying file: enough for xcls with torch and a small
# import (the first check of each test below), not for a list or a class table the size of
# what the file claims.
MEMORY_LIMIT = 1 << 30


def import_rec_limited(rec, out, *options):
    """``xcls data rec`` in a process of at most ``MEMORY_LIMIT`` bytes, for a minute."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    return subprocess.run([sys.executable, "-m", "xcls", "data", "rec", str(rec), "--out",
                           str(out), "--size", "8", "--processes", "1", *options],
                          capture_output=True, text=True, timeout=60, preexec_fn=limit,
                          env={**os.environ, "TQDM_DISABLE": "1"})  # stderr: the error alone


def one_line_error(done) -> str:
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("end", [2e8, 3e38])
def test_rec_header_claiming_more_images_than_the_index_is_refused_at_once(tmp_path, end):
    assert import_rec_limited(_write_rec(tmp_path, [(_png(1), 0), (_png(2), 1)]),
                              tmp_path / "fine").returncode == 0
    end = int(np.float32(end))  # as the header holds it: float32
    rec = _write_entries(tmp_path, [(0, _pack([float(end), float(end) + 1], b"", 0)),
                                    (1, _pack(0.0, _png(1), 1)), (2, _pack(1.0, _png(2), 2))])
    assert one_line_error(import_rec_limited(rec, tmp_path / "ds")) == (
        f"error: {rec}: header record 0 says images are 1..{end - 1}, but the index has no "
        f"record 3 ({end - 3} missing)")
    assert not (tmp_path / "ds").exists()


def test_rec_class_id_beyond_the_class_count_is_refused(tmp_path):
    rec = _write_rec(tmp_path, [(_png(1), 0.0), (_png(2), 3e9)])
    assert one_line_error(import_rec_limited(rec, tmp_path / "ds")) == (
        f"error: {rec}: record 2 has class 3000000000, not below the class count 2 (by default "
        "the number of images: a larger id means wrong or sparse labels; if they are right, "
        "give the class count, --num-classes)")
    rec = _write_rec(tmp_path, [(_png(1), 0.0), (_png(2), 7.0)])  # sparse ids, a subset
    assert "record 2 has class 7, not below the class count 5" in one_line_error(
        import_rec_limited(rec, tmp_path / "ds", "--num-classes", "5"))
    assert not (tmp_path / "ds").exists()
    assert import_rec_limited(rec, tmp_path / "ds", "--num-classes", "10").returncode == 0
    meta = read_metadata(tmp_path / "ds")
    assert meta.num_classes == 10 and LmdbImageDataset(tmp_path / "ds").labels().tolist() == [0, 7]


def test_rec_class_count_of_a_hundred_million_holds_no_list_of_names(tmp_path):
    # Ids 0 and 7 of a large set: classes are named by their ids, so the count costs no list in
    # memory (the import runs in 1 GiB) and no names in the metadata.
    rec = _write_rec(tmp_path, [(_png(1), 0.0), (_png(2), 7.0)])
    done = import_rec_limited(rec, tmp_path / "ds", "--num-classes", str(10**8))
    assert done.returncode == 0, done.stderr[-2000:]
    meta = read_metadata(tmp_path / "ds")
    assert meta.num_classes == 10**8 and len(meta.class_names) == 10**8
    assert (meta.class_names[7], meta.class_names[-1]) == ("7", "99999999")
    assert len(meta.to_json()) < 1024
    info = subprocess.run([sys.executable, "-m", "xcls", "data", "info", str(tmp_path / "ds")],
                          capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(info.stdout)["class_names"] == [str(i) for i in range(10)] + ["..."]


@pytest.mark.parametrize("count", ["0", "-3", str(2**62), str(10**30)])
def test_rec_class_count_outside_what_a_table_holds_is_refused(tmp_path, count):
    rec = _write_rec(tmp_path, [(_png(1), 0.0), (_png(2), 1.0)])
    assert one_line_error(import_rec_limited(rec, tmp_path / "ds", "--num-classes", count)) == (
        f"error: num_classes must be in [1, 2**62) (what a class table holds), got {count}")
    assert not (tmp_path / "ds").exists()


def test_rec_bad_magic(tmp_path):
    rec = _write_rec(tmp_path, [(_png(1), 0)])
    data = bytearray(rec.read_bytes())
    data[0] ^= 0xFF
    rec.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="bad RecordIO magic"):
        import_recordio(rec, tmp_path / "ds", size=8, channels=3)


def test_rec_truncated(tmp_path):
    rec = _write_rec(tmp_path, [(_png(1), 0), (_png(2), 1)])
    offset = int((tmp_path / "train.idx").read_text().splitlines()[2].split("\t")[1])
    rec.write_bytes(rec.read_bytes()[:offset + 40])  # the file ends inside image record 2
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


def test_folder_image_past_the_decompression_bomb_guard(tmp_path):
    from tests.conftest import png_declaring
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "big.png").write_bytes(png_declaring(60_000, 60_000))
    with pytest.raises(DatasetError, match="big.png: not a readable image .*3600000000 pixels"):
        import_folder(tmp_path / "src", tmp_path / "ds", size=6, channels=1)
    assert not (tmp_path / "ds").exists()


def test_folder_non_image(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.jpg").write_bytes(b"nope")
    with pytest.raises(DatasetError, match="x.jpg: not a readable image"):
        import_folder(tmp_path / "src", tmp_path / "ds", size=6, channels=1)
    assert not (tmp_path / "ds").exists()


def _classes(root, counts: dict[str, int]) -> None:
    """ROOT/<class>/<k>.png, image k of a class having the gray value k (its identity)."""
    for c, n in counts.items():
        (root / c).mkdir(parents=True)
        for k in range(n):
            Image.new("L", (7, 7), k).save(root / c / f"{k}.png")


def _values(path) -> list[tuple[int, int]]:
    ds = LmdbImageDataset(path)
    return sorted((int(ds[i][2]), int(ds[i][1][0, 0, 0])) for i in range(len(ds)))


def test_folder_splits_hold_out_a_share_of_each_class(tmp_path):
    _classes(tmp_path / "src", {"a": 20, "b": 10, "c": 1})
    train, test = import_folder_splits(tmp_path / "src", tmp_path / "ds", size=7, channels=1,
                                       test_fraction=0.2, seed=3)
    assert (train.split, test.split) == ("train", "test")
    assert train.class_names == test.class_names == ["a", "b", "c"]
    held, kept = _values(tmp_path / "ds" / "test"), _values(tmp_path / "ds" / "train")
    # 4 of a's 20, 2 of b's 10; c's one image stays in training
    assert [label for label, _ in held] == [0] * 4 + [1] * 2
    assert sorted(held + kept) == sorted((label, k) for label, n in enumerate((20, 10, 1))
                                         for k in range(n))
    # another seed holds out other images; the same seed the same ones
    again = import_folder_splits(tmp_path / "src", tmp_path / "ds2", size=7, channels=1,
                                 test_fraction=0.2, seed=3)
    assert again[1].num_samples == 6 and _values(tmp_path / "ds2" / "test") == held
    import_folder_splits(tmp_path / "src", tmp_path / "ds3", size=7, channels=1,
                         test_fraction=0.2, seed=4)
    assert _values(tmp_path / "ds3" / "test") != held


@pytest.mark.parametrize("fraction, message", [
    (0.0, "must be above 0 and below 1"), (1.0, "must be above 0 and below 1"),
    (0.01, "holds out no image"),
])
def test_folder_splits_refuse_a_fraction_that_makes_no_test_split(tmp_path, fraction, message):
    _classes(tmp_path / "src", {"a": 3, "b": 3})
    with pytest.raises(DatasetError, match=message):
        import_folder_splits(tmp_path / "src", tmp_path / "ds", size=7, channels=1,
                             test_fraction=fraction)
    assert not (tmp_path / "ds").exists()


def test_cli_folder_with_a_test_fraction_writes_train_and_test(tmp_path, capsys):
    from xcls.cli import main
    _classes(tmp_path / "src", {"a": 10, "b": 10})
    out = tmp_path / "ds"
    assert main(["data", "folder", str(tmp_path / "src"), "--out", str(out), "--size", "7",
                 "--test-fraction", "0.1"]) == 0
    assert capsys.readouterr().out.strip() == \
        f"wrote {out}/train (18 images) and {out}/test (2 images), 2 classes"
    assert main(["data", "folder", str(tmp_path / "src"), "--out", str(tmp_path / "x"),
                 "--test-fraction", "0.1", "--split", "val"]) == 2
    assert "with it the splits are OUT/train and OUT/test" in capsys.readouterr().err
    assert main(["data", "folder", str(tmp_path / "src"), "--out", str(tmp_path / "one")]) == 0
    assert capsys.readouterr().out.strip() == \
        f"wrote {tmp_path / 'one'} (20 images, 2 classes, split train)"


def test_cli_output_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, capsys):
    from xcls.cli import main
    root = tmp_path / "src" / "a"
    root.mkdir(parents=True)
    Image.new("L", (9, 9), 3).save(root / "1.png")
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory must go")
    assert main(["data", "folder", str(tmp_path / "src"), "--out", str(blocker / "ds")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {blocker}") and "Not a directory" in err[0]


def test_rec_index_that_is_not_text_is_refused_naming_it(tmp_path):
    """A binary file given as --idx (the .rec itself, an image) is one line naming it, not a
    UnicodeDecodeError traceback; no dataset is left."""
    rec = _write_rec(tmp_path, [(_png(1), 0), (_png(2), 1)])
    binary = tmp_path / "image.png"
    binary.write_bytes(_png(3))
    done = import_rec_limited(rec, tmp_path / "ds", "--idx", str(binary))
    assert one_line_error(done) == (f"error: {binary}: not an index ('index<TAB>offset' text "
                                    "lines): byte 0 is not UTF-8 text")
    assert not (tmp_path / "ds").exists()


def test_cli_refuses_a_missing_rec_with_exit_code_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "xcls", "data", "rec", str(tmp_path / "no.rec"),
                          "--out", str(tmp_path / "ds"), "--processes", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"error: {tmp_path / 'no.rec'}: file not found"
