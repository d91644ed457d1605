"""LMDB image datasets: sample id -> (label, PNG image), with a metadata record.

Layout (``docs/data.md`` is the reference): a directory holding one LMDB environment with two
named databases.

* ``samples``: key = sample id as 8-byte big-endian unsigned (so LMDB's byte order is numeric
  order), value = ``RECORD_HEADER`` + PNG bytes (or JPEG bytes, kept as imported). Sample ids
  are dense: ``0 .. num_samples-1``.
* ``meta``: ``b"metadata"`` = UTF-8 JSON (format name and version, counts, image size, class
  names, split, sources, labels checksum); ``b"labels"`` = every sample's label as little-endian
  int64, in sample-id order (samplers and class counts need them without decoding images).

The record header carries magic, version, label, payload length and CRC32 of the payload, so a
flipped byte or a truncated value is caught on read and reported with its sample id.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import lmdb
import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ams.jsontext import parse_json
from bridge.lmdb_file import DamagedDataFile, check_data_file
from workers.data.class_names import NumberedClasses, class_names_from_json, class_names_to_json
from workers.data.errors import DatasetError

log = logging.getLogger(__name__)

FORMAT_NAME = "xcls-lmdb-images"
FORMAT_VERSION = 1
RECORD_MAGIC = b"XIMG"
# magic, record version, label (int64), payload length (uint32), payload CRC32 (uint32).
RECORD_HEADER = struct.Struct("<4sHqII")
SAMPLES_DB = b"samples"
META_DB = b"meta"
META_KEY = b"metadata"
LABELS_KEY = b"labels"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# PNG colour types we store: 0 = grayscale (1 channel), 2 = RGB (3 channels).
PNG_COLOR_TYPE_TO_CHANNELS = {0: 1, 2: 3}
CHANNELS_TO_PIL_MODE = {1: "L", 3: "RGB"}
PIL_MODE_TO_CHANNELS = {mode: channels for channels, mode in CHANNELS_TO_PIL_MODE.items()}
JPEG_SIGNATURE = b"\xff\xd8"
# the largest image side a dataset stores: its images are resized to it, and a 4096-pixel RGB
# sample already decodes to 48 MiB
MAX_IMAGE_SIDE = 4096
# What PIL raises for bytes that are no image it can read, including an image declaring more
# pixels than its decompression-bomb guard allows (not an OSError).
IMAGE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
# Records an LmdbImageWriter puts in one write transaction: many images share a commit's cost,
# and 1000 encoded images (a few MB) are little to hold in memory until it.
WRITE_BATCH_RECORDS = 1000


@dataclass
class DatasetMetadata:
    """The metadata record of one dataset (stored as JSON under ``meta/metadata``).

    ``class_names[i]`` names class id ``i`` (e.g. ``"U+4E00"``); ``NumberedClasses`` (JSON
    ``null``) where classes have only numbers. ``sources`` says where images came from (font
    designs, folders, a .rec file) and is free-form per importer.
    """

    num_samples: int
    num_classes: int
    height: int
    width: int
    channels: int
    split: str
    class_names: list[str] | NumberedClasses
    sources: dict = field(default_factory=dict)
    labels_sha256: str = ""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        # vars, not asdict: asdict would deep-copy the names only for them to be replaced
        record = dict(vars(self), class_names=class_names_to_json(self.class_names))
        return json.dumps(record, ensure_ascii=False).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes, path: Path) -> DatasetMetadata:
        """Parse and validate; any problem raises DatasetError naming ``path`` and the field."""
        try:
            obj = parse_json(raw.decode("utf-8"))
        except ValueError as exc:  # not UTF-8, not JSON
            raise DatasetError(f"{path}: metadata record is not valid JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise DatasetError(f"{path}: metadata record is not a JSON object")
        if obj.get("format") != FORMAT_NAME:
            raise DatasetError(f"{path}: metadata field 'format' is {obj.get('format')!r}, "
                               f"expected {FORMAT_NAME!r}")
        if obj.get("format_version") != FORMAT_VERSION:
            raise DatasetError(f"{path}: metadata field 'format_version' is "
                               f"{obj.get('format_version')!r}; this reader knows {FORMAT_VERSION}")
        ints = ("num_samples", "num_classes", "height", "width", "channels")
        for name in ints:
            value = obj.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DatasetError(f"{path}: metadata field {name!r} must be a non-negative "
                                   f"integer, got {value!r}")
        if obj["channels"] not in CHANNELS_TO_PIL_MODE:
            raise DatasetError(f"{path}: metadata field 'channels' must be 1 or 3, "
                               f"got {obj['channels']}")
        if "class_names" in obj:
            try:
                obj["class_names"] = class_names_from_json(obj["class_names"], obj["num_classes"])
            except ValueError as exc:
                raise DatasetError(f"{path}: metadata field 'class_names' {exc}") from None
        try:
            return cls(**{k: obj[k] for k in cls.__dataclass_fields__ if k in obj})
        except TypeError as exc:
            raise DatasetError(f"{path}: metadata record is missing a field ({exc})") from exc


def _key(sample_id: int) -> bytes:
    return sample_id.to_bytes(8, "big")


def encode_png(image: np.ndarray) -> bytes:
    """PNG bytes of ``image``: uint8 [H, W] (grayscale) or [H, W, 3] (RGB)."""
    if image.dtype != np.uint8:
        raise DatasetError(f"image dtype must be uint8, got {image.dtype}")
    buf = io.BytesIO()
    # compress_level 1: glyph images are small; higher levels cost much more time for little size.
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def png_header(data: bytes) -> tuple[int, int, int]:
    """``(height, width, channels)`` read from a PNG's IHDR without decoding it.

    Raises DatasetError if ``data`` is not an 8-bit grayscale or RGB PNG.
    """
    if len(data) < 33 or data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise DatasetError("bytes are not a PNG image")
    width, height, bit_depth, color_type = struct.unpack(">IIBB", data[16:26])
    if bit_depth != 8 or color_type not in PNG_COLOR_TYPE_TO_CHANNELS:
        raise DatasetError(f"PNG must be 8-bit grayscale or RGB, got bit depth {bit_depth}, "
                           f"colour type {color_type}")
    return height, width, PNG_COLOR_TYPE_TO_CHANNELS[color_type]


def jpeg_header(data: bytes) -> tuple[int, int, int]:
    """``(height, width, channels)`` of a JPEG read from its header without decoding it.

    Raises DatasetError if ``data`` is not a grayscale or RGB (YCbCr) JPEG.
    """
    if data[:2] != JPEG_SIGNATURE:
        raise DatasetError("bytes are neither a PNG nor a JPEG image")
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format != "JPEG" or img.mode not in PIL_MODE_TO_CHANNELS:
                raise DatasetError(f"JPEG must be grayscale or RGB, got mode {img.mode}")
            return img.height, img.width, PIL_MODE_TO_CHANNELS[img.mode]
    except IMAGE_ERRORS as exc:
        raise DatasetError(f"JPEG header does not read ({exc})") from exc


class LmdbImageWriter:
    """Writes a dataset atomically: records go to ``PATH.tmp-<pid>``, renamed on ``close()``.

    Use as a context manager; an exception inside the ``with`` block leaves no dataset behind.
    Sample ids are assigned densely from 0 in the order images are added.

    Args:
        path: dataset directory to create.
        height, width, channels: every image's size; channels 1 (grayscale) or 3 (RGB).
        class_names: ``class_names[i]`` names class id ``i`` (a ``NumberedClasses`` is kept
            as it is, not listed).
        split: e.g. ``"train"`` or ``"test"``.
        sources: free-form JSON-able description of where the images came from.
        overwrite: replace an existing dataset at ``path`` (only once the new one is complete).
    """

    # Start the map at 64 MiB and double it whenever LMDB reports the map full; the final
    # data file is only as large as what was written.
    INITIAL_MAP_SIZE = 64 << 20

    def __init__(self, path: str | os.PathLike, *, height: int, width: int, channels: int,
                 class_names: Sequence[str], split: str, sources: dict | None = None,
                 overwrite: bool = False) -> None:
        if channels not in CHANNELS_TO_PIL_MODE:
            raise DatasetError(f"channels must be 1 or 3, got {channels}")
        for name, side in (("height", height), ("width", width)):
            if not 1 <= side <= MAX_IMAGE_SIDE:
                raise DatasetError(f"image {name} must be in [1, {MAX_IMAGE_SIDE}] pixels, got "
                                   f"{side}")
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise DatasetError(f"{self.path} already exists (pass overwrite to replace it)")
        self.overwrite = overwrite
        self.height, self.width, self.channels = height, width, channels
        self.class_names = (class_names if isinstance(class_names, NumberedClasses)
                            else list(class_names))
        self.split = split
        self.sources = dict(sources or {})
        self._tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir(parents=True)
        self._map_size = self.INITIAL_MAP_SIZE
        self._env = lmdb.open(str(self._tmp), map_size=self._map_size, max_dbs=2,
                              metasync=False, sync=False)
        self._samples_db = self._env.open_db(SAMPLES_DB)
        self._meta_db = self._env.open_db(META_DB)
        self._pending: list[tuple[bytes, bytes]] = []
        self._labels: list[int] = []
        self._closed = False
        self.close_metadata: DatasetMetadata | None = None

    def __len__(self) -> int:
        return len(self._labels)

    def add(self, image: np.ndarray, label: int) -> int:
        """Encode ``image`` (uint8 [H, W] or [H, W, 3]) as PNG and add it; returns its sample id."""
        return self.add_encoded(encode_png(image), label)

    def add_encoded(self, data: bytes, label: int) -> int:
        """Add already-encoded PNG or baseline JPEG bytes as they are (an imported JPEG is not
        re-encoded); returns the new sample id. Size and channels must match the dataset's
        (checked from the image header, without decoding)."""
        sample_id = len(self._labels)
        try:
            size = png_header(data) if data[:8] == PNG_SIGNATURE else jpeg_header(data)
        except DatasetError as exc:
            raise DatasetError(f"sample {sample_id}: {exc}") from exc
        if size != (self.height, self.width, self.channels):
            raise DatasetError(f"sample {sample_id}: image is {size} (H, W, C), dataset is "
                               f"{(self.height, self.width, self.channels)}")
        if not 0 <= label < len(self.class_names):
            raise DatasetError(f"sample {sample_id}: label {label} outside "
                               f"[0, {len(self.class_names)})")
        header = RECORD_HEADER.pack(RECORD_MAGIC, FORMAT_VERSION, label, len(data),
                                    zlib.crc32(data))
        self._pending.append((_key(sample_id), header + data))
        self._labels.append(label)
        if len(self._pending) >= WRITE_BATCH_RECORDS:
            self._flush()
        return sample_id

    def _put_all(self, db: object, items: list[tuple[bytes, bytes]]) -> None:
        """Write ``items`` in one transaction, growing the map until they fit."""
        while True:
            try:
                with self._env.begin(write=True, db=db) as txn:
                    for key, value in items:
                        txn.put(key, value, db=db)
                return
            except lmdb.MapFullError:
                self._map_size *= 2
                self._env.set_mapsize(self._map_size)
                log.debug("lmdb_map_grow path=%s map_size=%d", self._tmp, self._map_size)

    def _flush(self) -> None:
        if self._pending:
            self._put_all(self._samples_db, self._pending)
            self._pending = []

    def close(self) -> DatasetMetadata:
        """Write the metadata, sync, and move the dataset into place; returns the metadata.

        The metadata is also kept as ``close_metadata`` (for use after a ``with`` block).
        """
        self._flush()
        labels = np.asarray(self._labels, dtype="<i8").tobytes()
        meta = DatasetMetadata(
            num_samples=len(self._labels), num_classes=len(self.class_names),
            height=self.height, width=self.width, channels=self.channels, split=self.split,
            class_names=self.class_names, sources=self.sources,
            labels_sha256=hashlib.sha256(labels).hexdigest())
        self._put_all(self._meta_db, [(LABELS_KEY, labels), (META_KEY, meta.to_json())])
        self._env.sync(True)
        self._env.close()
        self._closed = True
        self.close_metadata = meta
        if self.path.exists():
            close_dataset(self.path)  # readers in this process must not keep the old files
            old = self.path.with_name(f"{self.path.name}.old-{os.getpid()}")
            self.path.rename(old)
            self._tmp.rename(self.path)
            shutil.rmtree(old)
        else:
            self._tmp.rename(self.path)
        log.info("dataset_written path=%s split=%s samples=%d classes=%d", self.path, self.split,
                 meta.num_samples, meta.num_classes)
        return meta

    def abort(self) -> None:
        """Drop everything written so far; nothing appears at ``path``."""
        if not self._closed:
            self._env.close()
            self._closed = True
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> LmdbImageWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None and not self._closed:
            self.close()
        else:
            self.abort()


# One read-only environment per dataset path per process: py-lmdb refuses to open a path that
# is already open in the process, and several readers of one dataset (trainer, bridge) may coexist.
_ENVS: dict[Path, tuple[int, lmdb.Environment]] = {}


def _open_env(path: Path) -> lmdb.Environment:
    """This process's read-only environment for ``path`` (opened on first use)."""
    key = path.resolve()
    pid, env = _ENVS.get(key, (None, None))
    if env is not None and pid == os.getpid():
        return env
    if env is not None:
        # Inherited through fork: LMDB forbids using it in the child, and py-lmdb refuses a
        # second open of the path while it exists. Closing the child's copy of the mapping
        # leaves the parent's untouched.
        env.close()
    if not (path / "data.mdb").is_file():
        raise DatasetError(f"{path}: no dataset here (expected an LMDB directory with data.mdb; "
                           "build one with 'xcls data glyphs|folder|rec')")
    # in every process that opens it (DataLoader workers too): a page LMDB maps past the end
    # of a file cut short would kill the process with SIGBUS
    try:
        check_data_file(path / "data.mdb")
    except DamagedDataFile as e:
        raise DatasetError(f"{e}; an interrupted copy or download? copy or build it "
                           "again") from None
    try:
        # lock=False: datasets are read-only once written, and many readers may share the files.
        # readahead=False: access is random, readahead would fill the page cache with waste.
        env = lmdb.open(str(path), readonly=True, lock=False, readahead=False, max_dbs=2)
    except lmdb.Error as exc:
        raise DatasetError(f"{path}: cannot open LMDB environment ({exc})") from exc
    _ENVS[key] = (os.getpid(), env)
    return env


def close_dataset(path: str | os.PathLike) -> None:
    """Close this process's environment for ``path`` (before the files are changed or removed)."""
    pid, env = _ENVS.pop(Path(path).resolve(), (None, None))
    if env is not None and pid == os.getpid():
        env.close()


def read_metadata(path: str | os.PathLike) -> DatasetMetadata:
    """The metadata of the dataset at ``path``; DatasetError if missing or malformed."""
    path = Path(path)
    return _read_metadata(_open_env(path), path)


def _read_metadata(env: lmdb.Environment, path: Path) -> DatasetMetadata:
    try:
        meta_db = env.open_db(META_DB, create=False)
    except lmdb.Error as exc:
        raise DatasetError(f"{path}: no 'meta' database; not an xcls dataset ({exc})") from exc
    with env.begin(db=meta_db) as txn:
        raw = txn.get(META_KEY)
    if raw is None:
        raise DatasetError(f"{path}: metadata record is missing (was the write interrupted?)")
    return DatasetMetadata.from_json(raw, path)


class LmdbImageDataset(Dataset):
    """Reads an LMDB image dataset; ``dataset[i]`` is sample id ``i``.

    The LMDB environment is opened lazily on first access in each process (and reopened after a
    fork), so the dataset can be handed to a DataLoader with worker processes.

    Items are ``(sample_id, image, label)``: sample_id int64 scalar tensor, image uint8 tensor
    [C, H, W], label int64 scalar tensor.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.metadata = read_metadata(self.path)
        self._env: lmdb.Environment | None = None
        self._db = self._meta_db = None
        self._pid = -1

    def __len__(self) -> int:
        return self.metadata.num_samples

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_env"], state["_db"], state["_meta_db"], state["_pid"] = None, None, None, -1
        return state

    def _txn(self) -> lmdb.Transaction:
        if self._env is None or self._pid != os.getpid():
            self._env = _open_env(self.path)
            self._db = self._env.open_db(SAMPLES_DB, create=False)
            self._meta_db = self._env.open_db(META_DB, create=False)
            self._pid = os.getpid()
        return self._env.begin(db=self._db, buffers=False)

    def labels(self) -> np.ndarray:
        """Every sample's label, int64 [num_samples], checked against the metadata checksum."""
        with self._txn() as txn:
            raw = txn.get(LABELS_KEY, db=self._meta_db)
        if raw is None or hashlib.sha256(raw).hexdigest() != self.metadata.labels_sha256:
            raise DatasetError(f"{self.path}: labels record is missing or does not match "
                               "metadata 'labels_sha256'")
        return np.frombuffer(raw, dtype="<i8").astype(np.int64)

    def read_record(self, sample_id: int) -> tuple[int, bytes]:
        """``(label, png_bytes)`` of one sample, with header and CRC checked."""
        if not 0 <= sample_id < len(self):
            raise IndexError(f"{self.path}: sample id {sample_id} outside [0, {len(self)})")
        with self._txn() as txn:
            value = txn.get(_key(sample_id))
        if value is None:
            raise DatasetError(f"{self.path}: sample {sample_id} is missing")
        return self._parse_record(sample_id, value)

    def _parse_record(self, sample_id: int, value: bytes) -> tuple[int, bytes]:
        where = f"{self.path}: sample {sample_id}"
        if len(value) < RECORD_HEADER.size:
            raise DatasetError(f"{where}: record truncated ({len(value)} bytes, header alone is "
                               f"{RECORD_HEADER.size})")
        magic, version, label, length, crc = RECORD_HEADER.unpack_from(value)
        if magic != RECORD_MAGIC:
            raise DatasetError(f"{where}: bad record magic {magic!r}")
        if version != FORMAT_VERSION:
            raise DatasetError(f"{where}: record version {version}, reader knows {FORMAT_VERSION}")
        payload = value[RECORD_HEADER.size:]
        if len(payload) != length:
            raise DatasetError(f"{where}: record truncated or padded: header says {length} image "
                               f"bytes, found {len(payload)}")
        if zlib.crc32(payload) != crc:
            raise DatasetError(f"{where}: image bytes fail their CRC32 check (corrupt record)")
        if not 0 <= label < self.metadata.num_classes:
            raise DatasetError(f"{where}: label {label} outside [0, {self.metadata.num_classes})")
        return label, payload

    def decode(self, sample_id: int, png: bytes) -> torch.Tensor:
        """Decode PNG or JPEG bytes to uint8 [C, H, W], checking size and channels against
        metadata."""
        m = self.metadata
        where = f"{self.path}: sample {sample_id}"
        try:
            with Image.open(io.BytesIO(png)) as img:
                # size and mode come from the header: a record of the wrong size is refused
                # before its pixels are decompressed (a few bytes can declare gigapixels)
                if img.mode != CHANNELS_TO_PIL_MODE[m.channels]:
                    raise DatasetError(f"{where}: image mode {img.mode}, dataset has "
                                       f"{m.channels} channel(s)")
                if (img.height, img.width) != (m.height, m.width):
                    raise DatasetError(f"{where}: image is {(img.height, img.width)} (H, W), "
                                       f"dataset says {(m.height, m.width)}")
                img.load()
                array = np.asarray(img)
        except IMAGE_ERRORS as exc:
            raise DatasetError(f"{where}: image does not decode ({exc})") from exc
        array = array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
        # A copy: the decoded array is read-only, and tensors must own writable memory.
        return torch.from_numpy(array.copy())

    def __getitem__(self, sample_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        label, png = self.read_record(int(sample_id))
        image = self.decode(int(sample_id), png)
        return (torch.tensor(sample_id, dtype=torch.int64), image,
                torch.tensor(label, dtype=torch.int64))


def verify_dataset(path: str | os.PathLike) -> dict[str, int]:
    """Read and decode every record; raises DatasetError at the first bad one.

    Returns ``{"samples": n, "classes_present": k}``. Also checks that the record labels equal
    the stored labels array and that no record lies outside ``0 .. num_samples-1``.
    """
    dataset = LmdbImageDataset(path)
    labels = dataset.labels()
    if len(labels) != len(dataset):
        raise DatasetError(f"{dataset.path}: labels record has {len(labels)} entries, metadata "
                           f"'num_samples' is {len(dataset)}")
    count = 0
    with dataset._txn() as txn:
        for key, value in txn.cursor():
            sample_id = int.from_bytes(key, "big")
            if len(key) != 8 or sample_id >= len(dataset):
                raise DatasetError(f"{dataset.path}: unexpected key {key!r} in samples")
            label, png = dataset._parse_record(sample_id, value)
            if label != labels[sample_id]:
                raise DatasetError(f"{dataset.path}: sample {sample_id}: record label {label} "
                                   f"!= labels array {labels[sample_id]}")
            dataset.decode(sample_id, png)
            count += 1
    if count != len(dataset):
        raise DatasetError(f"{dataset.path}: found {count} records, metadata 'num_samples' is "
                           f"{len(dataset)}")
    return {"samples": count, "classes_present": int(len(np.unique(labels)))}
