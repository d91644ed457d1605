"""Read a font's character map (code point -> glyph id) straight from its sfnt tables.

Pillow draws glyphs but cannot list which code points a font maps; asking it one code point at a
time over the ~200k CJK code points is the slow part of a coverage scan. Parsing the ``cmap``
table directly takes milliseconds. Supports .ttf/.otf and faces inside .ttc collections, cmap
subtable formats 4 (BMP) and 12 (full Unicode).
"""

from __future__ import annotations

import struct
from pathlib import Path

from workers.data.errors import DatasetError

# (platform id, encoding id) of Unicode subtables, best first: full repertoire before BMP only.
_UNICODE_SUBTABLES = [(3, 10), (0, 6), (0, 4), (3, 1), (0, 3)]


def _face_offset(data: bytes, face_index: int, path: Path) -> int:
    if data[:4] != b"ttcf":
        if face_index != 0:
            raise DatasetError(f"{path}: not a font collection, face {face_index} does not exist")
        return 0
    (num_fonts,) = struct.unpack_from(">I", data, 8)
    if not 0 <= face_index < num_fonts:
        raise DatasetError(f"{path}: collection has {num_fonts} faces, asked for {face_index}")
    return struct.unpack_from(">I", data, 12 + 4 * face_index)[0]


def _table_offset(data: bytes, face_offset: int, tag: bytes, path: Path) -> int:
    (num_tables,) = struct.unpack_from(">H", data, face_offset + 4)
    for i in range(num_tables):
        rec = face_offset + 12 + 16 * i
        if data[rec:rec + 4] == tag:
            return struct.unpack_from(">I", data, rec + 8)[0]
    raise DatasetError(f"{path}: font has no {tag.decode()} table")


def _format4(data: bytes, off: int) -> dict[int, int]:
    (seg_x2,) = struct.unpack_from(">H", data, off + 6)
    segs = seg_x2 // 2
    ends = struct.unpack_from(f">{segs}H", data, off + 14)
    starts = struct.unpack_from(f">{segs}H", data, off + 16 + seg_x2)
    deltas = struct.unpack_from(f">{segs}h", data, off + 16 + 2 * seg_x2)
    range_base = off + 16 + 3 * seg_x2
    range_offsets = struct.unpack_from(f">{segs}H", data, range_base)
    mapping: dict[int, int] = {}
    for i in range(segs):
        start, end, delta, ro = starts[i], ends[i], deltas[i], range_offsets[i]
        if start == 0xFFFF:
            continue
        for cp in range(start, end + 1):
            if ro == 0:
                gid = (cp + delta) & 0xFFFF
            else:
                # idRangeOffset is relative to its own slot in the idRangeOffset array.
                addr = range_base + 2 * i + ro + 2 * (cp - start)
                (gid,) = struct.unpack_from(">H", data, addr)
                if gid:
                    gid = (gid + delta) & 0xFFFF
            if gid:
                mapping[cp] = gid
    return mapping


def _format12(data: bytes, off: int) -> dict[int, int]:
    (num_groups,) = struct.unpack_from(">I", data, off + 12)
    mapping: dict[int, int] = {}
    for g in range(num_groups):
        start, end, gid0 = struct.unpack_from(">III", data, off + 16 + 12 * g)
        for cp in range(start, end + 1):
            mapping[cp] = gid0 + cp - start
    return mapping


def read_cmap(path: str | Path, face_index: int = 0) -> dict[int, int]:
    """Code point -> glyph id for one face (glyph 0, ``.notdef``, is left out)."""
    path = Path(path)
    try:
        data = path.read_bytes()
        face = _face_offset(data, face_index, path)
        cmap = _table_offset(data, face, b"cmap", path)
        version, count = struct.unpack_from(">HH", data, cmap)
        subtables = {}
        for i in range(count):
            plat, enc, sub_off = struct.unpack_from(">HHI", data, cmap + 4 + 8 * i)
            subtables[(plat, enc)] = cmap + sub_off
        for key in _UNICODE_SUBTABLES:
            if key in subtables:
                off = subtables[key]
                (fmt,) = struct.unpack_from(">H", data, off)
                if fmt == 12:
                    return {cp: g for cp, g in _format12(data, off).items() if g}
                if fmt == 4:
                    return _format4(data, off)
    except (OSError, struct.error) as exc:
        raise DatasetError(f"{path}: cannot read font cmap ({exc})") from exc
    raise DatasetError(f"{path}: face {face_index} has no Unicode cmap subtable (format 4/12)")
