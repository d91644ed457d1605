"""Importers from common image-classification layouts into the LMDB dataset format.

* ``import_folder``: ``ROOT/<class name>/<image>``, one sub-folder per class;
  ``import_folder_splits`` the same into a train and a test split, holding out a share of each
  class's images.
* ``import_pairs_bin``: an insightface verification ``.bin`` (LFW, CFP-FP, AgeDB-30 pairs).
* ``import_recordio``: insightface ``train.rec`` + ``train.idx`` (MXNet RecordIO), read without
  mxnet. A record is ``<II`` (magic 0xced7230a, lrecord: continuation flag in the top 3 bits,
  length in the low 29) then the payload padded to 4 bytes. The payload starts with IRHeader
  ``<IfQQ`` (flag, label, id, id2); ``flag`` > 0 means ``flag`` float labels follow (the first is
  the class). Then the encoded image. insightface puts a header at index 0 with ``flag`` > 0
  whose first label is the end of the image range: records ``1 .. end-1`` are images.
  Nothing a file says is allocated before it is checked against what the files hold: an image
  range against the index, a record's labels against its length, a class id against the
  number of classes (by default the number of images: insightface's ids are dense).
"""

from __future__ import annotations

import codecs
import io
import logging
import math
import os
import pickle
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from multiprocessing import Pool
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image
from tqdm import tqdm

from ams.sharding import MAX_ROWS
from workers.data.class_names import NumberedClasses
from workers.data.errors import DatasetError
from workers.data.lmdb_dataset import (
    IMAGE_ERRORS,
    DatasetMetadata,
    LmdbImageWriter,
    encode_png,
)

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
RECORDIO_MAGIC = 0xCED7230A
IR_HEADER = struct.Struct("<IfQQ")
# Records per task of the decode pool: large enough to amortize the pickling.
_CHUNK = 256


def load_image(data: bytes | Path, size: int, channels: int, where: str) -> np.ndarray:
    """Decode and resize to ``size`` x ``size``: uint8 [H, W] (channels 1) or [H, W, 3]."""
    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as img:
            img = img.convert("L" if channels == 1 else "RGB")
            if img.size != (size, size):
                img = img.resize((size, size), Image.Resampling.BILINEAR)
            return np.asarray(img)
    except IMAGE_ERRORS as exc:
        raise DatasetError(f"{where}: not a readable image ({exc})") from exc


def _folder_images(root: Path) -> tuple[list[str], list[list[Path]]]:
    """The class names of ROOT/<class>/<image> (sorted folder names: label i is the i-th) and
    each class's image files, sorted."""
    if not root.is_dir():
        raise DatasetError(f"{root}: not a directory")
    classes = sorted(p for p in root.iterdir() if p.is_dir())
    images = [[f for f in sorted(d.rglob("*")) if f.is_file()
               and f.suffix.lower() in IMAGE_SUFFIXES] for d in classes]
    if not any(images):
        raise DatasetError(f"{root}: no images found (expected ROOT/<class>/<image>, suffixes "
                           f"{sorted(IMAGE_SUFFIXES)})")
    return [d.name for d in classes], images


def _write_folder_split(root: Path, out: str | os.PathLike, files: list[tuple[int, Path]],
                        class_names: list[str], *, size: int, channels: int, split: str,
                        overwrite: bool, sources: dict) -> DatasetMetadata:
    with LmdbImageWriter(out, height=size, width=size, channels=channels,
                         class_names=class_names, split=split,
                         sources={"importer": "folder", "root": str(root), **sources},
                         overwrite=overwrite) as writer:
        for label, path in tqdm(files, desc=f"import folder ({split})", unit="img"):
            writer.add(load_image(path, size, channels, str(path)), label)
    return writer.close_metadata


def import_folder(root: str | os.PathLike, out: str | os.PathLike, *, size: int, channels: int,
                  split: str = "train", overwrite: bool = False) -> DatasetMetadata:
    """One sub-folder per class (sorted names -> labels 0..); every image file inside."""
    root = Path(root)
    class_names, images = _folder_images(root)
    files = [(label, f) for label, paths in enumerate(images) for f in paths]
    return _write_folder_split(root, out, files, class_names, size=size, channels=channels,
                               split=split, overwrite=overwrite, sources={})


def import_folder_splits(root: str | os.PathLike, out: str | os.PathLike, *, size: int,
                         channels: int, test_fraction: float, seed: int = 0,
                         overwrite: bool = False) -> tuple[DatasetMetadata, DatasetMetadata]:
    """``import_folder`` into two datasets, ``out/train`` and ``out/test``, with the same
    classes: of each class's n images, round(``test_fraction`` * n) chosen at random (by
    ``seed``; at most n - 1, so every class keeps a training image) go to the test split.
    ``0 < test_fraction < 1``."""
    if not 0 < test_fraction < 1:
        raise DatasetError(f"test fraction {test_fraction}: must be above 0 and below 1")
    root = Path(root)
    class_names, images = _folder_images(root)
    rng = np.random.default_rng(seed)
    train: list[tuple[int, Path]] = []
    test: list[tuple[int, Path]] = []
    for label, paths in enumerate(images):
        count = min(round(test_fraction * len(paths)), max(len(paths) - 1, 0))
        held = set(rng.choice(len(paths), count, replace=False).tolist())
        for i, path in enumerate(paths):
            (test if i in held else train).append((label, path))
    if not test:
        raise DatasetError(f"{root}: a test fraction of {test_fraction} holds out no image "
                           f"({len(train)} images in {len(class_names)} classes); raise it")
    sources = {"test_fraction": test_fraction, "seed": seed}
    out = Path(out)
    return (_write_folder_split(root, out / "train", train, class_names, size=size,
                                channels=channels, split="train", overwrite=overwrite,
                                sources=sources),
            _write_folder_split(root, out / "test", test, class_names, size=size,
                                channels=channels, split="test", overwrite=overwrite,
                                sources=sources))


def _read_record(f: BinaryIO, file_size: int, offset: int, path: Path) -> bytes:
    """The payload of the record starting at ``offset`` of the open file ``f``."""
    return f.read(_seek_payload(f, file_size, offset, path))


def _read_head(f: BinaryIO, file_size: int, offset: int, path: Path, index: int
               ) -> tuple[int, float]:
    """``(flag, label)`` of the record at ``offset`` (``_unpack``), reading its IRHeader and
    first label but not its image."""
    length = _seek_payload(f, file_size, offset, path)
    head = f.read(min(length, IR_HEADER.size))
    if len(head) == IR_HEADER.size and IR_HEADER.unpack_from(head)[0] > 0:
        head += f.read(min(length - IR_HEADER.size, 4))
    flag, label, _ = _unpack(head, path, index, length)
    return flag, label


def _seek_payload(f: BinaryIO, file_size: int, offset: int, path: Path) -> int:
    """Check the record header at ``offset``, leave ``f`` at its payload; the payload's
    length."""
    if offset < 0 or offset + 8 > file_size:
        raise DatasetError(f"{path}: record at offset {offset} lies past the end of the file "
                           f"({file_size} bytes)")
    f.seek(offset)
    magic, lrecord = struct.unpack("<II", f.read(8))
    if magic != RECORDIO_MAGIC:
        raise DatasetError(f"{path}: bad RecordIO magic {magic:#x} at offset {offset} "
                           f"(expected {RECORDIO_MAGIC:#x})")
    cflag, length = lrecord >> 29, lrecord & ((1 << 29) - 1)
    if cflag != 0:
        raise DatasetError(f"{path}: record at offset {offset} is split (cflag {cflag}); "
                           "multi-part records are not supported")
    if offset + 8 + length > file_size:
        raise DatasetError(f"{path}: record at offset {offset} is truncated: needs {length} "
                           f"bytes, file ends after {file_size - offset - 8}")
    return length


def _unpack(payload: bytes, path: Path, index: int, length: int | None = None
            ) -> tuple[int, float, bytes]:
    """``(flag, label, image bytes)`` of one record payload (or of its first ``length``
    bytes' head, given the record's ``length``), as MXNet's ``recordio.unpack`` reads it:
    ``flag`` 0 gives the header's float label, ``flag`` > 0 means ``flag`` floats follow the
    header, and ``label`` is the first of them (the class, or a header's end of images; the
    others are never used, so never unpacked)."""
    length = len(payload) if length is None else length
    if length < IR_HEADER.size:
        raise DatasetError(f"{path}: record {index} is shorter than its IRHeader")
    flag, label, _, _ = IR_HEADER.unpack_from(payload)
    start = IR_HEADER.size
    if flag == 0:
        return flag, label, payload[start:]
    if length < start + 4 * flag:
        raise DatasetError(f"{path}: record {index} says {flag} labels but is too short")
    return flag, struct.unpack_from("<f", payload, start)[0], payload[start + 4 * flag:]


def _class_of(label: float, path: Path, index: int, num_classes: int) -> int:
    """The class of an image record from its (first) label: a whole number in
    ``[0, num_classes)``."""
    if not math.isfinite(label) or label < 0 or label != int(label):
        raise DatasetError(f"{path}: record {index} has label {label}; a class must be a "
                           "whole number >= 0")
    if label >= num_classes:
        raise DatasetError(f"{path}: record {index} has class {int(label)}, not below the "
                           f"class count {num_classes} (by default the number of images: a "
                           "larger id means wrong or sparse labels; if they are right, give "
                           "the class count, --num-classes)")
    return int(label)


def read_index(idx_path: Path) -> dict[int, int]:
    """``index -> byte offset`` from an insightface ``.idx`` file (``index\toffset`` lines)."""
    try:
        text = idx_path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:  # a .rec, an image, another binary file given as --idx
        raise DatasetError(f"{idx_path}: not an index ('index<TAB>offset' text lines): byte "
                           f"{exc.start} is not UTF-8 text") from None
    index = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            key, offset = line.split("\t")
            index[int(key)] = int(offset)
        except ValueError as exc:
            raise DatasetError(f"{idx_path}:{lineno}: expected 'index<TAB>offset', got "
                               f"{line[:60]!r}") from exc
    return index


def image_keys(f: BinaryIO, file_size: int, index: dict[int, int], path: Path) -> list[int]:
    """The record indices that hold images. insightface's files (MS1M, Glint360K, WebFace)
    start with a header record 0 whose ``flag`` > 0 labels are ``(end, ...)``: images are
    indices ``1 .. end-1`` and the records after them describe identities. Without such a
    header every record is an image (arcface_torch reads them the same way)."""
    if 0 in index:
        flag, end = _read_head(f, file_size, index[0], path, 0)
        if flag > 0:
            if not math.isfinite(end) or end < 1 or end != int(end):
                raise DatasetError(f"{path}: header record 0 gives image range end {end}")
            end = int(end)
            # counted, never listed: a header may claim any range (3e38 is a float32)
            present = sum(1 for k in index if 1 <= k < end)
            if present < end - 1:
                # one of the first present + 1 numbers is missing
                first = next(k for k in range(1, end) if k not in index)
                raise DatasetError(f"{path}: header record 0 says images are 1..{end - 1}, "
                                   f"but the index has no record {first} "
                                   f"({end - 1 - present} missing)")
            return list(range(1, end))
    return sorted(index)


def _encode_records(rec: Path, records: list[tuple[int, int]], size: int, channels: int,
                    num_classes: int) -> list[tuple[int, bytes]]:
    """(class, encoded image) of each (index, offset) record: the original JPEG or PNG bytes
    when the image already has the dataset's size and colour mode, else resized to PNG."""
    out = []
    file_size = rec.stat().st_size
    with rec.open("rb") as f:
        for index, offset in records:
            _, label, image = _unpack(_read_record(f, file_size, offset, rec), rec, index)
            out.append((_class_of(label, rec, index, num_classes),
                        encoded_image(image, size, channels, f"{rec} record {index}")))
    return out


def encoded_image(data: bytes, size: int, channels: int, where: str) -> bytes:
    """``data`` itself if it is a JPEG or PNG of ``size`` x ``size`` in the dataset's colour
    mode (8-bit L or RGB); otherwise the image decoded, resized and encoded as PNG."""
    mode = "L" if channels == 1 else "RGB"
    try:
        with Image.open(io.BytesIO(data)) as img:  # reads the header only
            if img.format in ("JPEG", "PNG") and img.size == (size, size) and img.mode == mode:
                return data
    except IMAGE_ERRORS as exc:
        raise DatasetError(f"{where}: not a readable image ({exc})") from exc
    return encode_png(load_image(data, size, channels, where))


def import_recordio(rec: str | os.PathLike, out: str | os.PathLike, *, size: int,
                    channels: int, idx: str | os.PathLike | None = None, split: str = "train",
                    overwrite: bool = False, workers: int = 1,
                    num_classes: int | None = None) -> DatasetMetadata:
    """Import an insightface/MXNet ``.rec`` (with its ``.idx``, default: same stem).

    Records are read by their ``.idx`` offsets, never the whole file at once; ``workers``
    processes decode (and, where the size differs, resize) them, and the dataset keeps the
    original JPEG bytes of images that already have its size. ``num_classes``: the class
    count (class ids are ``0 .. num_classes-1``); None: one more than the largest class id,
    which may not exceed the number of images.
    """
    rec = Path(rec)
    idx_path = Path(idx) if idx else rec.with_suffix(".idx")
    for p in (rec, idx_path):
        if not p.is_file():
            raise DatasetError(f"{p}: file not found")
    if workers < 1:
        raise DatasetError(f"workers must be >= 1, got {workers}")
    if num_classes is not None and not 1 <= num_classes < MAX_ROWS:
        raise DatasetError(f"num_classes must be in [1, 2**62) (what a class table holds), "
                           f"got {num_classes}")
    index = read_index(idx_path)
    if not index:
        raise DatasetError(f"{idx_path}: index is empty")
    file_size = rec.stat().st_size
    with rec.open("rb") as f:
        keys = image_keys(f, file_size, index, rec)
        limit = len(keys) if num_classes is None else num_classes
        # The class list must be known before the first write: one pass over the headers
        # (the images are read once, by the decoders).
        classes = [_class_of(_read_head(f, file_size, index[k], rec, k)[1], rec, k, limit)
                   for k in tqdm(keys, desc="read labels", unit="rec", leave=False)]
    if not keys:
        raise DatasetError(f"{rec}: no image records")
    num_classes = max(classes) + 1 if num_classes is None else num_classes
    chunks = [[(k, index[k]) for k in keys[i:i + _CHUNK]] for i in range(0, len(keys), _CHUNK)]
    encode = partial(_encode_records, rec, size=size, channels=channels,
                     num_classes=num_classes)
    with LmdbImageWriter(out, height=size, width=size, channels=channels,
                         class_names=NumberedClasses(num_classes), split=split,
                         sources={"importer": "recordio", "rec": str(rec)},
                         overwrite=overwrite) as writer, \
            _pool(workers) as pool:
        bar = tqdm(total=len(keys), desc="import rec", unit="img")
        for chunk in (pool.imap(encode, chunks) if pool else map(encode, chunks)):
            for label, image in chunk:
                writer.add_encoded(image, label)
            bar.update(len(chunk))
        bar.close()
    return writer.close_metadata


@contextmanager
def _pool(workers: int) -> Iterator[Pool | None]:
    """A process pool of ``workers`` (None for one: decode in this process)."""
    if workers == 1:
        yield None
        return
    with Pool(workers) as pool:
        yield pool


# Pair sets: the two images of pair i are samples 2i and 2i+1, both labelled with the pair's
# flag, so a pair set is an ordinary dataset of two classes.
PAIR_CLASSES = ("different", "same")


class _DataOnlyUnpickler(pickle.Unpickler):
    """Reads a pickle of plain data only (lists, tuples, bytes, numbers): a pair file never
    needs to name a class or function, and loading one that does would run code. The one
    exception is ``_codecs.encode``, which protocol 2 uses to spell bytes objects."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) == ("_codecs", "encode"):
            return _latin1_bytes
        raise pickle.UnpicklingError(f"it names {module}.{name}; a pair file holds only lists "
                                     "of image bytes and flags")


def _latin1_bytes(text: str, encoding: str) -> bytes:
    """How protocol 2 rebuilds a bytes object: ``_codecs.encode(text, "latin1")``."""
    if encoding != "latin1" or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r}: only bytes spelled "
                                     "in latin1 are read")
    return codecs.encode(text, "latin1")


def read_pairs_bin(path: Path) -> tuple[list[bytes], list[bool]]:
    """(images, flags) of an insightface verification ``.bin`` (lfw.bin, cfp_fp.bin,
    agedb_30.bin): a pickle of (list of 2n encoded images, list of n same/different flags),
    read without running any code it might carry."""
    try:
        with open(path, "rb") as f:
            data = _DataOnlyUnpickler(f, encoding="bytes").load()
    except OSError as e:
        raise DatasetError(f"{path}: cannot read it ({e.strerror})") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as e:
        raise DatasetError(f"{path}: not a pair file ({e})") from None
    except MemoryError:
        # the unpickler allocates a string's claimed length before it reads the string
        raise DatasetError(f"{path}: not a pair file (it claims a string larger than memory "
                           "allows)") from None
    if not (isinstance(data, (tuple, list)) and len(data) == 2):
        raise DatasetError(f"{path}: expected a pair (images, flags), got {type(data).__name__}")
    images, flags = data
    if not isinstance(images, (list, tuple)) or not isinstance(flags, (list, tuple)):
        raise DatasetError(f"{path}: images and flags must be lists")
    if len(images) != 2 * len(flags) or not flags:
        raise DatasetError(f"{path}: {len(images)} images for {len(flags)} pairs (needs 2 per "
                           "pair, at least one pair)")
    for i, image in enumerate(images):
        if not isinstance(image, (bytes, bytearray)):
            raise DatasetError(f"{path}: image {i} is a {type(image).__name__}, not bytes")
    for i, flag in enumerate(flags):
        if flag not in (0, 1) or isinstance(flag, float):
            raise DatasetError(f"{path}: flag {i} is {flag!r}, not a same/different bool")
    return [bytes(image) for image in images], [bool(flag) for flag in flags]


def import_pairs_bin(path: str | os.PathLike, out: str | os.PathLike, *, size: int,
                     channels: int, overwrite: bool = False) -> DatasetMetadata:
    """Import a verification ``.bin`` as a pair dataset: samples 2i and 2i+1 are pair i, both
    labelled ``PAIR_CLASSES.index(same)``; images already of ``size`` kept as they are."""
    path = Path(path)
    images, flags = read_pairs_bin(path)
    with LmdbImageWriter(out, height=size, width=size, channels=channels,
                         class_names=list(PAIR_CLASSES), split="pairs",
                         sources={"importer": "bin", "bin": str(path)},
                         overwrite=overwrite) as writer:
        for i, image in enumerate(tqdm(images, desc="import pairs", unit="img")):
            writer.add_encoded(encoded_image(image, size, channels, f"{path} image {i}"),
                               int(flags[i // 2]))
    return writer.close_metadata
