"""An LMDB data file checked against its own meta pages before LMDB maps it.

LMDB maps ``data.mdb`` and reads its pages straight from the map: a page past the end of a file
that was cut short (an interrupted copy or download) kills the reading process with SIGBUS, with
no message, in a DataLoader worker as in the main process. The file's first two pages are its
meta pages (``MDB_meta`` in LMDB's ``mdb.c``); the newer of the two (the larger transaction id)
names the last page in use, so the file must hold at least ``(last page + 1) * page size``
bytes. Both LMDB files of xcls are checked so: a dataset (``workers.data.lmdb_dataset``) and
the gear's feature cache (``bridge.lmdb_cache``).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

# A meta page of a 64-bit build (py-lmdb's): the page header (page number, pad, flags, bounds),
# then MDB_meta: magic, version, fixed address, map size, the free pages' database (its first
# field is the page size) and the main database (48 bytes each), the last page in use, the
# transaction id.
_META = struct.Struct("<QHHI" "IIQQ" "I44x" "48x" "QQ")
_P_META = 0x08
MDB_MAGIC = 0xBEEFC0DE
# LMDB's page size is the OS page size, at least 4 KiB; anything else is not a meta page.
_PAGE_SIZES = {1 << n for n in range(12, 17)}


class DamagedDataFile(ValueError):
    """An LMDB ``data.mdb`` that LMDB must not map: what is wrong with it, in one line naming
    the file, for the caller to add what to do about it."""


def check_data_file(path: Path) -> None:
    """DamagedDataFile naming ``path`` (an LMDB ``data.mdb``) when it is shorter than its meta
    pages say, or has no valid meta page: one line, instead of a SIGBUS when it is read."""
    # The meta pages first, the size after: a writer in another process (the ranks of a host
    # share a feature cache) writes a transaction's pages before the meta page that names them,
    # and LMDB never shrinks its file, so the size read later covers every page named earlier.
    # The other order judged a file that grew in between truncated.
    try:
        with open(path, "rb") as f:
            head = f.read(_META.size)
            if len(head) < _META.size:
                raise DamagedDataFile(f"{path}: truncated: {len(head)} bytes, not even an LMDB "
                                      "meta page")
            first = _meta(head, 0)
            if first is None:
                raise DamagedDataFile(f"{path}: not an LMDB data file (no meta page at its start)")
            page_size = first[0]
            f.seek(page_size)
            second = _meta(f.read(_META.size), 1)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise DamagedDataFile(f"{path}: cannot read it ({e.strerror})") from None
    if second is None:
        raise DamagedDataFile(f"{path}: truncated or damaged: {size} bytes, its second meta "
                              f"page (at byte {page_size}) is missing or not a meta page")
    _, last_page, _ = max(first, second, key=lambda meta: meta[2])
    needed = (last_page + 1) * page_size
    if size < needed:
        raise DamagedDataFile(f"{path}: truncated: {size} bytes, its meta page says {needed} "
                              f"({last_page + 1} pages of {page_size})")


def _meta(raw: bytes, page: int) -> tuple[int, int, int] | None:
    """(page size, last page, transaction id) of meta page ``page`` from its first bytes;
    None when they are not one."""
    if len(raw) < _META.size:
        return None
    pgno, _, flags, _, magic, _, _, _, page_size, last_page, txnid = _META.unpack(raw)
    if pgno != page or not flags & _P_META or magic != MDB_MAGIC \
            or page_size not in _PAGE_SIZES:
        return None
    return page_size, last_page, txnid
