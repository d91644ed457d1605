"""Bytes <-> arrays for everything the bridge stores: feature entries, accumulator records and
gradient stream entries. Raw little-endian payloads behind small fixed headers, so a reader can
check an entry (magic, dtype, dim, length) before trusting a single byte of it.

Feature entry (one per sample id)::

    magic b"XCF1" | dtype code u8 | 3 pad | dim u32 | version i64 | timestamp f64 | dim x dtype

Accumulator record (per sample, Redis accumulator)::

    magic b"XGA1" | count u32 | dim u32 | version i64 | seq i64 | dim x float32 sum (count > 0)
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import numpy as np

from bridge.errors import CorruptEntryError, MalformedGradientError

FEATURE_MAGIC = b"XCF1"
FEATURE_HEADER = struct.Struct("<4sB3xIqd")
# Codes are part of the stored format: never renumber, only append.
DTYPE_CODES: dict[str, int] = {"float16": 1, "float32": 2}
NP_DTYPES: dict[str, np.dtype] = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4")}

# The dtype of a ready mean on the stream: the float32 the accumulator sums in, so a mean
# loses nothing on its way to the slow gear (the entry names it; readers take either).
GRAD_DTYPE = "float32"

RECORD_MAGIC = b"XGA1"
RECORD_HEADER = struct.Struct("<4sIIqq")


def check_dtype(dtype: str) -> np.dtype:
    """The little-endian numpy dtype for a feature/gradient dtype name; ValueError if unknown."""
    if dtype not in NP_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(NP_DTYPES)}, got {dtype!r}")
    return NP_DTYPES[dtype]


def entry_nbytes(dim: int, dtype: str) -> int:
    """Size in bytes of one encoded feature entry."""
    return FEATURE_HEADER.size + dim * check_dtype(dtype).itemsize


def encode_features(features: np.ndarray, version: int, timestamp: float,
                    dtype: str) -> list[bytes]:
    """Encode rows of ``features`` (n, dim), any float dtype, as ``dtype`` entries.

    All rows share one header (same dim, version and timestamp), so it is packed once.
    Returns n ``bytes`` objects of :func:`entry_nbytes` each.
    """
    if features.ndim != 2:
        raise ValueError(f"features must be (n, dim), got shape {features.shape}")
    n, dim = features.shape
    raw = np.ascontiguousarray(features, dtype=check_dtype(dtype)).tobytes()
    header = FEATURE_HEADER.pack(FEATURE_MAGIC, DTYPE_CODES[dtype], dim, int(version), timestamp)
    row = len(raw) // n if n else 0
    return [header + raw[i * row:(i + 1) * row] for i in range(n)]


def decode_feature_header(blob: bytes, dim: int, dtype: str) -> tuple[int, float]:
    """Check one feature entry against the expected ``dim`` and ``dtype``.

    Returns (version, timestamp). Raises :class:`CorruptEntryError` naming what is wrong.
    """
    expected = entry_nbytes(dim, dtype)
    if len(blob) != expected:
        raise CorruptEntryError(f"feature entry is {len(blob)} bytes, expected {expected} "
                                f"(dim={dim} dtype={dtype})")
    magic, code, got_dim, version, timestamp = FEATURE_HEADER.unpack_from(blob)
    if magic != FEATURE_MAGIC:
        raise CorruptEntryError(f"feature entry has magic {magic!r}, expected {FEATURE_MAGIC!r}")
    if code != DTYPE_CODES[dtype]:
        raise CorruptEntryError(f"feature entry has dtype code {code}, this cache stores "
                                f"{dtype} (code {DTYPE_CODES[dtype]})")
    if got_dim != dim:
        raise CorruptEntryError(f"feature entry has dim {got_dim}, expected {dim}")
    if not math.isfinite(timestamp):  # no freshness check could refuse it
        raise CorruptEntryError(f"feature entry has timestamp {timestamp}")
    return version, timestamp


class DecodedFeatures(NamedTuple):
    """Result of :func:`decode_features` for n looked-up entries.

    features: (n, dim) float32, zeros where not ``found``; found: (n,) bool, a valid entry;
    corrupt: (n,) bool, an entry was there but failed validation; versions: (n,) int64;
    timestamps: (n,) float64 (seconds since the epoch); first_error: message of the first
    corrupt entry, for the log.
    """

    features: np.ndarray
    found: np.ndarray
    corrupt: np.ndarray
    versions: np.ndarray
    timestamps: np.ndarray
    first_error: str | None


def decode_features(blobs: list[bytes | None], dim: int, dtype: str) -> DecodedFeatures:
    """Decode looked-up entries (``None`` = absent). Invalid entries are flagged, not raised:
    one bad key must not cost the other n-1 their hits."""
    n = len(blobs)
    np_dtype = check_dtype(dtype)
    out = np.zeros((n, dim), dtype=np.float32)
    found = np.zeros(n, dtype=bool)
    corrupt = np.zeros(n, dtype=bool)
    versions = np.zeros(n, dtype=np.int64)
    stamps = np.zeros(n, dtype=np.float64)
    first_error: str | None = None
    rows: list[int] = []
    payloads: list[bytes] = []
    for i, blob in enumerate(blobs):
        if blob is None:
            continue
        try:
            versions[i], stamps[i] = decode_feature_header(blob, dim, dtype)
        except CorruptEntryError as e:
            corrupt[i] = True
            first_error = first_error or str(e)
            continue
        rows.append(i)
        payloads.append(blob[FEATURE_HEADER.size:])
    if rows:
        # One frombuffer over the joined payloads instead of n small ones.
        values = np.frombuffer(b"".join(payloads), dtype=np_dtype).reshape(len(rows), dim)
        values = values.astype(np.float32)
        idx = np.asarray(rows, dtype=np.int64)
        finite = np.isfinite(values).all(axis=1)
        if not finite.all():
            # NaN/inf features would poison the head; they are garbage like a bad header.
            corrupt[idx[~finite]] = True
            first_error = first_error or "feature entry holds non-finite values"
        out[idx[finite]] = values[finite]
        found[idx[finite]] = True
    return DecodedFeatures(out, found, corrupt, versions, stamps, first_error)


class AccumRecord(NamedTuple):
    """Per-sample accumulator state: ``sum`` (dim,) float32 of ``count`` gradients, the newest
    contributing backbone ``version`` and ``seq``, the number of means already emitted."""

    count: int
    version: int
    seq: int
    sum: np.ndarray


def encode_record(rec: AccumRecord) -> bytes:
    """Pack an accumulator record; the sum is omitted when count is 0."""
    dim = rec.sum.shape[0]
    header = RECORD_HEADER.pack(RECORD_MAGIC, rec.count, dim, rec.version, rec.seq)
    if rec.count == 0:
        return header
    return header + np.ascontiguousarray(rec.sum, dtype="<f4").tobytes()


def decode_record(blob: bytes, dim: int) -> AccumRecord:
    """Unpack an accumulator record; :class:`MalformedGradientError` if it is not one of ours."""
    if len(blob) < RECORD_HEADER.size:
        raise MalformedGradientError(f"accumulator record is {len(blob)} bytes, shorter than "
                                     f"its {RECORD_HEADER.size}-byte header")
    magic, count, got_dim, version, seq = RECORD_HEADER.unpack_from(blob)
    if magic != RECORD_MAGIC or got_dim != dim:
        raise MalformedGradientError(f"accumulator record has magic {magic!r} dim {got_dim}, "
                                     f"expected {RECORD_MAGIC!r} dim {dim}")
    expected = RECORD_HEADER.size + (dim * 4 if count else 0)
    if len(blob) != expected:
        raise MalformedGradientError(f"accumulator record is {len(blob)} bytes, expected "
                                     f"{expected} for count={count} dim={dim}")
    total = np.zeros(dim, dtype=np.float32)
    if count:
        total = np.frombuffer(blob, dtype="<f4", offset=RECORD_HEADER.size).astype(np.float32)
    return AccumRecord(count, version, seq, total)


class GradEntry(NamedTuple):
    """One ready mean gradient: sample ``sample_id``, backbone ``version`` of its newest
    contribution, ``seq`` (the sample's n-th mean), ``count`` gradients averaged, ``grad``
    (dim,) float32."""

    sample_id: int
    version: int
    seq: int
    count: int
    grad: np.ndarray


def encode_grad_entry(entry: GradEntry) -> dict[bytes, bytes]:
    """Stream fields of a ready mean gradient (raw little-endian ``GRAD_DTYPE`` payload)."""
    raw = np.ascontiguousarray(entry.grad, dtype=check_dtype(GRAD_DTYPE)).tobytes()
    return {
        b"id": str(entry.sample_id).encode(),
        b"version": str(entry.version).encode(),
        b"seq": str(entry.seq).encode(),
        b"count": str(entry.count).encode(),
        b"dim": str(entry.grad.shape[0]).encode(),
        b"dtype": GRAD_DTYPE.encode(),
        b"grad": raw,
    }


def decode_grad_entry(fields: dict[bytes, bytes], dim: int) -> GradEntry:
    """Validate and unpack stream fields; :class:`MalformedGradientError` on anything off."""
    try:
        sample_id = int(fields[b"id"])
        version = int(fields[b"version"])
        seq = int(fields[b"seq"])
        count = int(fields[b"count"])
        got_dim = int(fields[b"dim"])
        dtype = fields[b"dtype"].decode()
        raw = fields[b"grad"]
    except (KeyError, ValueError, UnicodeDecodeError) as e:
        raise MalformedGradientError(f"gradient entry lacks or garbles a field: {e!r}") from e
    if dtype not in NP_DTYPES:
        raise MalformedGradientError(f"gradient entry has dtype {dtype!r}, expected one of "
                                     f"{sorted(NP_DTYPES)}")
    if got_dim != dim:
        raise MalformedGradientError(f"gradient entry has dim {got_dim}, consumer expects {dim}")
    for name, value in (("id", sample_id), ("version", version), ("seq", seq)):
        if not 0 <= value < 2**63:  # they become int64 tensors
            raise MalformedGradientError(f"gradient entry has {name} {value}, outside "
                                         "[0, 2**63)")
    if not 1 <= count < 2**63:
        raise MalformedGradientError(f"gradient entry averages count={count} gradients")
    expected = dim * NP_DTYPES[dtype].itemsize
    if len(raw) != expected:
        raise MalformedGradientError(f"gradient entry payload is {len(raw)} bytes, expected "
                                     f"{expected} (dim={dim} dtype={dtype})")
    grad = np.frombuffer(raw, dtype=NP_DTYPES[dtype]).astype(np.float32)
    if not np.isfinite(grad).all():
        raise MalformedGradientError("gradient entry holds non-finite values")
    return GradEntry(sample_id, version, seq, count, grad)
