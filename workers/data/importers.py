"""Importers from common image-classification layouts into the LMDB dataset format.

* ``import_folder``: ``ROOT/<class name>/<image>``, one sub-folder per class.
* ``import_recordio``: insightface ``train.rec`` + ``train.idx`` (MXNet RecordIO), read without
  mxnet. A record is ``<II`` (magic 0xced7230a, lrecord: continuation flag in the top 3 bits,
  length in the low 29) then the payload padded to 4 bytes. The payload starts with IRHeader
  ``<IfQQ`` (flag, label, id, id2); ``flag`` > 0 means ``flag`` float labels follow (the first is
  the class). Then the encoded image. insightface puts a header at index 0 whose label field
  ``(id, id2)`` gives the range of image indices: records ``1 .. id-1`` are images.
"""

from __future__ import annotations

import io
import logging
import os
import struct
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from workers.data.errors import DatasetError
from workers.data.lmdb_dataset import DatasetMetadata, LmdbImageWriter

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
RECORDIO_MAGIC = 0xCED7230A
IR_HEADER = struct.Struct("<IfQQ")


def load_image(data: bytes | Path, size: int, channels: int, where: str) -> np.ndarray:
    """Decode and resize to ``size`` x ``size``: uint8 [H, W] (channels 1) or [H, W, 3]."""
    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as img:
            img = img.convert("L" if channels == 1 else "RGB")
            if img.size != (size, size):
                img = img.resize((size, size), Image.Resampling.BILINEAR)
            return np.asarray(img)
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DatasetError(f"{where}: not a readable image ({exc})") from exc


def import_folder(root: str | os.PathLike, out: str | os.PathLike, *, size: int, channels: int,
                  split: str = "train", overwrite: bool = False) -> DatasetMetadata:
    """One sub-folder per class (sorted names -> labels 0..); every image file inside."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"{root}: not a directory")
    classes = sorted(p for p in root.iterdir() if p.is_dir())
    files = [(label, f) for label, d in enumerate(classes) for f in sorted(d.rglob("*"))
             if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise DatasetError(f"{root}: no images found (expected ROOT/<class>/<image>, suffixes "
                           f"{sorted(IMAGE_SUFFIXES)})")
    with LmdbImageWriter(out, height=size, width=size, channels=channels,
                         class_names=[d.name for d in classes], split=split,
                         sources={"importer": "folder", "root": str(root)},
                         overwrite=overwrite) as writer:
        for label, path in tqdm(files, desc="import folder", unit="img"):
            writer.add(load_image(path, size, channels, str(path)), label)
    return writer.close_metadata


def _read_record(data: bytes, offset: int, path: Path) -> bytes:
    """The payload of the record starting at ``offset``."""
    if offset + 8 > len(data):
        raise DatasetError(f"{path}: record at offset {offset} lies past the end of the file "
                           f"({len(data)} bytes)")
    magic, lrecord = struct.unpack_from("<II", data, offset)
    if magic != RECORDIO_MAGIC:
        raise DatasetError(f"{path}: bad RecordIO magic {magic:#x} at offset {offset} "
                           f"(expected {RECORDIO_MAGIC:#x})")
    cflag, length = lrecord >> 29, lrecord & ((1 << 29) - 1)
    if cflag != 0:
        raise DatasetError(f"{path}: record at offset {offset} is split (cflag {cflag}); "
                           "multi-part records are not supported")
    if offset + 8 + length > len(data):
        raise DatasetError(f"{path}: record at offset {offset} is truncated: needs {length} "
                           f"bytes, file ends after {len(data) - offset - 8}")
    return data[offset + 8:offset + 8 + length]


def _unpack(payload: bytes, path: Path, index: int) -> tuple[float, tuple[int, int], bytes]:
    """``(label, (id, id2), image bytes)`` of one record payload."""
    if len(payload) < IR_HEADER.size:
        raise DatasetError(f"{path}: record {index} is shorter than its IRHeader")
    flag, label, id1, id2 = IR_HEADER.unpack_from(payload)
    start = IR_HEADER.size
    if flag > 0:
        if len(payload) < start + 4 * flag:
            raise DatasetError(f"{path}: record {index} says {flag} labels but is too short")
        label = struct.unpack_from("<f", payload, start)[0]
        start += 4 * flag
    return label, (id1, id2), payload[start:]


def read_index(idx_path: Path) -> dict[int, int]:
    """``index -> byte offset`` from an insightface ``.idx`` file (``index\\toffset`` lines)."""
    index = {}
    for lineno, line in enumerate(idx_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            key, offset = line.split("\t")
            index[int(key)] = int(offset)
        except ValueError as exc:
            raise DatasetError(f"{idx_path}:{lineno}: expected 'index<TAB>offset', got "
                               f"{line[:60]!r}") from exc
    return index


def import_recordio(rec: str | os.PathLike, out: str | os.PathLike, *, size: int,
                    channels: int, idx: str | os.PathLike | None = None, split: str = "train",
                    overwrite: bool = False) -> DatasetMetadata:
    """Import an insightface/MXNet ``.rec`` (with its ``.idx``, default: same stem)."""
    rec = Path(rec)
    idx_path = Path(idx) if idx else rec.with_suffix(".idx")
    for p in (rec, idx_path):
        if not p.is_file():
            raise DatasetError(f"{p}: file not found")
    data = rec.read_bytes()
    index = read_index(idx_path)
    if not index:
        raise DatasetError(f"{idx_path}: index is empty")
    keys = sorted(index)
    label0, (id1, id2), _ = _unpack(_read_record(data, index[keys[0]], rec), rec, keys[0])
    if keys[0] == 0 and label0 > 0:
        # insightface header record: images are indices 1 .. id1-1.
        keys = [k for k in keys if 1 <= k < id1]
    records = []
    for k in keys:
        label, _, image = _unpack(_read_record(data, index[k], rec), rec, k)
        records.append((k, int(label), image))
    labels = sorted({lab for _, lab, _ in records})
    if labels and labels[0] < 0:
        raise DatasetError(f"{rec}: negative label {labels[0]}")
    num_classes = labels[-1] + 1
    with LmdbImageWriter(out, height=size, width=size, channels=channels,
                         class_names=[str(i) for i in range(num_classes)], split=split,
                         sources={"importer": "recordio", "rec": str(rec)},
                         overwrite=overwrite) as writer:
        for k, label, image in tqdm(records, desc="import rec", unit="img"):
            writer.add(load_image(image, size, channels, f"{rec} record {k}"), label)
    return writer.close_metadata
