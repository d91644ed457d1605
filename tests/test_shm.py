"""The shared buffer of a data connection (ams.shm): what a shard maps, and what it refuses."""

from __future__ import annotations

import fcntl
import os

import pytest
import torch

from ams.errors import InvalidArgument
from ams.shm import ALIGN, MAX_SHARED_BYTES, MEMFD_NAME, RESERVED_BYTES, SharedBuffer

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


def test_slots_are_aligned_and_inside_the_region(offered):
    buffer, _ = offered
    for count in (1, 2, 3, 7):
        size = buffer.slot_bytes(count)
        assert size % ALIGN == 0 and count * size <= CAPACITY
        assert [buffer.slot(i, count) for i in range(count)] == [i * size
                                                                for i in range(count)]


@pytest.mark.parametrize("offset,rows,needle", [
    (-64, 1, "non-negative multiple of 64"),
    (8, 1, "non-negative multiple of 64"),
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
