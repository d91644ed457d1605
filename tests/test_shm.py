"""The shared buffer of a data connection (ams.dataplane.shm): what a shard maps, and what it
refuses."""

from __future__ import annotations

import ctypes
import fcntl
import gc
import os
import random
import struct

import pytest
import torch

from ams.dataplane import shm
from ams.dataplane.shm import (
    ALIGN,
    MAX_SHARED_BYTES,
    MEMFD_NAME,
    RESERVED_BYTES,
    SharedArena,
    SharedBuffer,
)
from ams.errors import InvalidArgument

CAPACITY = 1 << 16


@pytest.fixture
def offered():
    made = SharedBuffer.create(CAPACITY)
    assert made is not None, "this Linux has sealable memory files"
    buffer, offer = made
    yield buffer, offer
    SharedBuffer.withdraw(offer)
    buffer.close()


def test_the_shard_maps_the_memory_the_client_writes(offered):
    client, offer = offered
    shard = SharedBuffer.attach(offer)
    assert shard is not None
    rows = torch.arange(12, dtype=torch.float32).view(3, 4)
    client.rows(128, torch.float32, 3, 4).copy_(rows)
    assert torch.equal(shard.rows(128, torch.float32, 3, 4), rows)
    shard.rows(0, torch.float16, 2, 4).fill_(1.5)  # and the client reads the shard's writes
    assert torch.equal(client.rows(0, torch.float16, 2, 4), torch.full((2, 4), 1.5,
                                                                       dtype=torch.float16))
    shard.close()


def test_the_client_cannot_shrink_the_file_under_the_shard(offered):
    """Shrinking would make the shard's accesses fault (SIGBUS): the seals forbid it."""
    _, offer = offered
    with pytest.raises(PermissionError):
        os.ftruncate(offer["fd"], RESERVED_BYTES)


@pytest.mark.parametrize("offset,rows,needle", [
    (-4, 1, "non-negative multiple of 4"),
    (2, 1, "non-negative multiple of 4"),
    (CAPACITY - 64, 5, "pass the end"),
    (0, CAPACITY // 16 + 1, "pass the end"),
])
def test_rows_outside_the_region_are_refused(offered, offset, rows, needle):
    buffer, _ = offered
    with pytest.raises(InvalidArgument, match=needle):
        buffer.rows(offset, torch.float32, rows, 4)


def _offer(offer, **changes):
    return {**offer, **changes}


@pytest.mark.parametrize("change,needle", [
    (lambda o: "yes", "must be an object"),
    (lambda o: [o["pid"], o["fd"]], "must be an object"),
    (lambda o: {k: v for k, v in o.items() if k != "nonce"}, "must be an object"),
    (lambda o: _offer(o, extra=1), "must be an object"),
    (lambda o: _offer(o, pid=True), "shared pid=True"),
    (lambda o: _offer(o, pid=0), "shared pid=0"),
    (lambda o: _offer(o, pid="1"), "shared pid="),
    (lambda o: _offer(o, fd=-1), "shared fd=-1"),
    (lambda o: _offer(o, fd=1.5), "shared fd=1.5"),
    (lambda o: _offer(o, bytes=0), "shared bytes=0"),
    (lambda o: _offer(o, bytes=MAX_SHARED_BYTES + 64), "shared bytes="),
    (lambda o: _offer(o, bytes=CAPACITY + 1), "multiple of 64"),
    (lambda o: _offer(o, nonce="zz" * 16), "nonce must be 32 hex digits"),
    (lambda o: _offer(o, nonce="ab"), "nonce must be 32 hex digits"),
    (lambda o: _offer(o, nonce=7), "nonce must be 32 hex digits"),
])
def test_a_malformed_offer_is_an_invalid_argument(offered, change, needle):
    _, offer = offered
    with pytest.raises(InvalidArgument, match=needle):
        SharedBuffer.attach(change(offer))


def test_an_offer_of_anything_but_that_sealed_memory_file_is_not_mapped(offered, tmp_path):
    """Another size or nonce, a process or descriptor that does not exist, a regular file,
    an unsealed memory file: the connection stays on plain frames (None), nothing mapped."""
    _, offer = offered
    assert SharedBuffer.attach(_offer(offer, bytes=CAPACITY - 64)) is None
    assert SharedBuffer.attach(_offer(offer, nonce="00" * 16)) is None
    assert SharedBuffer.attach(_offer(offer, fd=offer["fd"] + 1000)) is None
    assert SharedBuffer.attach(_offer(offer, pid=(1 << 32) - 1)) is None
    regular = tmp_path / "rows"
    regular.write_bytes(bytes(RESERVED_BYTES + CAPACITY))
    fd = os.open(regular, os.O_RDWR)
    unsealed = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
    os.ftruncate(unsealed, RESERVED_BYTES + CAPACITY)
    try:
        for other in (fd, unsealed):
            os.pwrite(other, bytes.fromhex(offer["nonce"]), 0)
            assert SharedBuffer.attach(_offer(offer, fd=other)) is None
        # the same file with the seals is mapped: the seals are what was missing
        sealable = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(sealable, RESERVED_BYTES + CAPACITY)
        os.pwrite(sealable, bytes.fromhex(offer["nonce"]), 0)
        assert SharedBuffer.attach(_offer(offer, fd=sealable)) is None
        fcntl.fcntl(sealable, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        mapped = SharedBuffer.attach(_offer(offer, fd=sealable))
        assert mapped is not None
        mapped.close()
        os.close(sealable)
    finally:
        os.close(fd)
        os.close(unsealed)


IN_CLOSE_WRITE, IN_CLOSE_NOWRITE = 0x8, 0x10  # <sys/inotify.h>


class CloseWatch:
    """Linux inotify on one file: how each opening of it was closed, which tells whether it
    had been opened for writing (IN_CLOSE_WRITE) or not (IN_CLOSE_NOWRITE)."""

    def __init__(self, path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0 and libc.inotify_add_watch(
            self.fd, os.fsencode(path), IN_CLOSE_WRITE | IN_CLOSE_NOWRITE) >= 0

    def closes(self) -> list[int]:
        """The events since the last call, each IN_CLOSE_WRITE or IN_CLOSE_NOWRITE."""
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        masks, at = [], 0
        while at < len(data):  # struct inotify_event: wd, mask, cookie, len, name[len]
            _, mask, _, length = struct.unpack_from("iIII", data, at)
            masks.append(mask)
            at += 16 + length
        return masks

    def close(self) -> None:
        os.close(self.fd)


def test_a_descriptor_swapped_after_its_name_was_read_is_never_opened_for_writing(
        offered, tmp_path, monkeypatch):
    """The client offers its memory file, and puts another file under the same descriptor
    number just after the shard read the descriptor's name (the worst moment, made certain
    here by doing it inside that read). The shard opens what it finds without write access,
    sees that it is not the memory file, and maps nothing: the other file is opened once,
    read-only, never for writing."""
    _, offer = offered
    other = tmp_path / "other"
    other.write_bytes(bytes(RESERVED_BYTES + CAPACITY))  # the size the offer names
    other_fd = os.open(other, os.O_RDONLY)
    number = os.dup(offer["fd"])  # the descriptor the offer names, which the client swaps
    watch = CloseWatch(other)
    read_name, swapped = os.readlink, []

    def read_then_swap(path, *args, **kwargs):
        name = read_name(path, *args, **kwargs)
        if path == f"/proc/{os.getpid()}/fd/{number}" and not swapped:
            os.dup2(other_fd, number)
            swapped.append(name)
        return name

    monkeypatch.setattr(os, "readlink", read_then_swap)
    try:
        assert SharedBuffer.attach({**offer, "fd": number}) is None
    finally:
        monkeypatch.undo()
        for fd in (number, other_fd):
            os.close(fd)
    assert swapped and swapped[0].startswith(f"/memfd:{MEMFD_NAME}")
    assert watch.closes() == [IN_CLOSE_NOWRITE]
    watch.close()


# ---- the client's regions ------------------------------------------------------------------


@pytest.fixture
def arena(monkeypatch):
    monkeypatch.setattr(shm, "ARENA_BYTES", CAPACITY)
    made = SharedArena.create()
    assert made is not None
    yield made
    made.close()


def test_regions_never_overlap_and_freed_room_is_taken_again(arena):
    """Random allocations and releases against a byte map of who holds what: a region is
    aligned, inside the buffer and overlaps no other held region; an allocation fails only
    when no free run of bytes is long enough (so freed neighbours are merged again)."""
    rng = random.Random(0)
    owner = [None] * (CAPACITY // ALIGN)  # ALIGN-sized granules: which region holds each
    held: dict[int, int] = {}
    for step in range(3000):
        if held and rng.random() < 0.45:
            offset = rng.choice(list(held))
            granules = held.pop(offset)
            arena.release(offset)
            owner[offset // ALIGN:offset // ALIGN + granules] = [None] * granules
            continue
        nbytes = rng.choice([1, 63, 64, 65, 1000, 4096, 20_000])
        granules = -(-nbytes // ALIGN)
        offset = arena.allocate(nbytes)
        longest = run = 0
        for g in owner:
            run = run + 1 if g is None else 0
            longest = max(longest, run)
        if offset is None:
            assert longest < granules, (step, nbytes, longest)
            continue
        assert offset % ALIGN == 0 and offset + nbytes <= CAPACITY
        first = offset // ALIGN
        assert owner[first:first + granules] == [None] * granules, step
        owner[first:first + granules] = [offset] * granules
        held[offset] = granules
    for offset in held:
        arena.release(offset)
    assert arena.in_use() == 0 and arena.allocate(CAPACITY) == 0


def test_a_result_region_comes_back_when_its_last_view_is_gone(arena):
    rows = arena.result(10, 16, torch.float32)
    assert rows.shape == (10, 16) and arena.offset_of(rows) is not None
    rows.copy_(torch.arange(160, dtype=torch.float32).view(10, 16))
    half, as_numpy = rows[5:], rows.numpy()
    del rows
    gc.collect()
    assert arena.in_use() == 10 * 16 * 4 // ALIGN * ALIGN  # the views keep it
    assert float(half[0, 0]) == 80.0 and as_numpy[9, 15] == 159.0
    del half, as_numpy
    assert arena.in_use() == 0
    assert arena.offset_of(torch.zeros(3)) is None  # not the buffer's memory


def test_the_shard_writes_a_result_where_the_client_reads_it(arena):
    shard = SharedBuffer.attach(arena.offer)
    assert shard is not None
    rows = arena.result(4, 8, torch.float16)
    written = torch.randn(4, 8).to(torch.float16)
    shard.rows(arena.offset_of(rows), torch.float16, 4, 8).copy_(written)
    assert torch.equal(rows, written)
    shard.close()


def test_an_abandoned_region_is_never_taken_again(arena):
    """A region a lost connection may still write: neither its release nor the death of its
    result gives it back."""
    pushed = arena.allocate(CAPACITY // 2)
    rows = arena.result(CAPACITY // 2 // 64, 16, torch.float32)  # the other half
    assert pushed is not None and rows is not None
    assert not arena.abandoned(rows)
    arena.abandon(pushed + 100)  # any byte of the region names it
    arena.abandon(arena.offset_of(rows) + 64)
    assert arena.abandoned(rows) and not arena.abandoned(torch.zeros(3))
    arena.release(pushed)
    del rows
    gc.collect()
    assert arena.in_use() == CAPACITY
    assert arena.allocate(64) is None and arena.result(1, 16, torch.float32) is None
