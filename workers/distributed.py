"""The torchrun side of a worker process: its rank, its device and the default process group's
lifetime."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum

import torch
import torch.distributed as dist


def torchrun_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun sets them; (0, 1, 0) in a plain process.
    Raises ValueError, naming the variable, when they are not integers or not consistent."""
    values = []
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        text = os.environ.get(name, default)
        try:
            values.append(int(text))
        except ValueError:
            raise ValueError(f"{name}={text!r}: torchrun sets it to an integer") from None
    rank, world, local_rank = values
    if world < 1 or not 0 <= rank < world or not 0 <= local_rank < world:
        raise ValueError(f"RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local_rank}: need "
                         "WORLD_SIZE >= 1 and 0 <= RANK, LOCAL_RANK < WORLD_SIZE")
    return rank, world, local_rank


def address_toward(peer: str) -> str:
    """This host's IP address on the route to ``peer`` (a host name or address): the address
    the other hosts of a job can reach it at. A lookup of the host's own name may give a
    loopback address instead (Debian maps it to 127.0.1.1), which no other host can reach.
    Nothing is sent: connecting a UDP socket only picks the route. Raises ValueError when
    ``peer`` does not resolve or no route leads there."""
    if not peer:
        raise ValueError("no peer to tell this host's address by (MASTER_ADDR is not set)")
    try:
        family, _, _, _, address = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError as e:
        raise ValueError(f"no route to {peer!r} to tell this host's address by: {e}") from None


class DeviceSetting(StrEnum):
    """Where a worker computes."""

    AUTO = "auto"  # the GPU of its local rank when CUDA is available, else the CPU
    CPU = "cpu"  # the CPU, even with a GPU at hand
    CUDA = "cuda"  # the GPU of its local rank; an error without one


def worker_device(setting: DeviceSetting | str, local_rank: int) -> torch.device:
    """The device a worker computes on, for ``setting`` "cpu", "cuda" or "auto" (CUDA when
    there is one): ``cuda:<local_rank>``, made the current CUDA device, or ``cpu``. Raises
    ValueError for "cuda" without CUDA, or a local rank past the GPUs this host has."""
    if setting not in list(DeviceSetting):
        *others, last = DeviceSetting
        raise ValueError(f"{setting!r}: use {', '.join(others)} or {last}")
    if setting == DeviceSetting.CPU or (setting == DeviceSetting.AUTO
                                        and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("'cuda' but no CUDA device is available")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK={local_rank} but this host has "
                         f"{torch.cuda.device_count()} CUDA device(s); start at most that many "
                         "workers per host")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def group_max(value: int, world: int, device: torch.device) -> int:
    """The largest of every rank's ``value``: a collective every rank of the default group calls
    at the same point (``value`` itself when ``world`` == 1)."""
    if world == 1:
        return value
    largest = torch.tensor([value], device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return int(largest.item())


@contextmanager
def process_group(world: int, device: torch.device) -> Iterator[None]:
    """The default process group for workers on ``device`` (NCCL for CUDA, gloo for CPU) for the
    body of the ``with``, rendezvous from torchrun's environment; destroyed on the way out, even
    on an error. With ``world == 1`` there is none and nothing is sent.
    """
    if world == 1:
        yield
        return
    # torch.distributed.nn binds `group=group.WORLD` defaults when it is first imported, and
    # torch imports it lazily (building any optimizer does). Imported after the group exists, it
    # keeps that group alive past destroy_process_group: gloo's threads then live on into
    # interpreter shutdown, where torch 2.13 now and then aborts ("terminate called without an
    # active exception") after all the work is done. Imported first, it binds None.
    import torch.distributed.nn  # noqa: F401
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()
