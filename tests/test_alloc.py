"""In-memory tables live in private anonymous memory advised onto transparent huge pages."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from ams.alloc import zeros_on_huge_pages

HUGE = 2 << 20


def mapping_of(address: int) -> tuple[str, list[str]]:
    """(permissions, VmFlags) of the mapping of this process that holds ``address``, read
    from /proc/self/smaps."""
    header, flags = None, []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and len(line.split()) >= 5 and not first.endswith(":"):
            start, stop = (int(x, 16) for x in first.split("-"))
            header = line.split()[1] if start <= address < stop else None
        elif header is not None and first == "VmFlags:":
            flags = line.split()[1:]
            return header, flags
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeros_of_the_asked_shape_and_dtype_and_writable():
    for shape, dtype in (((3, 5), torch.float32), ((4 * HUGE // 256, 128), torch.float16)):
        t = zeros_on_huge_pages(shape, dtype)
        assert t.shape == shape and t.dtype == dtype
        assert bool((t == 0).all())
        t[-1, -1] = 7
        assert float(t[-1, -1]) == 7


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists()
                    or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="a kernel with transparent huge pages (Linux)")
def test_a_large_table_is_private_memory_advised_for_huge_pages():
    """Private, not shared: the kernel gives shared anonymous memory huge pages only under
    its ``shmem_enabled`` setting, commonly ``never``, whatever the advice says."""
    t = zeros_on_huge_pages((4 * HUGE // 512, 128), torch.float32)
    permissions, flags = mapping_of(t.data_ptr())
    assert permissions.endswith("p"), permissions
    assert "hg" in flags, flags


def test_a_kernel_that_refuses_the_advice_still_gets_its_table(monkeypatch):
    class Refusing(mmap.mmap):
        def madvise(self, *args: int) -> None:
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", Refusing)
    t = zeros_on_huge_pages((4 * HUGE // 512, 128), torch.float32)
    assert t.shape == (4 * HUGE // 512, 128) and bool((t == 0).all())
