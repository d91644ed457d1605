"""Shared fixtures. Real services only: Redis and shard servers are started as processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from xcls.shards import restartable_ports

# Small fonts (fast coverage scan) that still give >= 4 families for the common hanja, plus a
# two-design family (NanumGothic regular + bold) to check that families are held out whole.
SMALL_FONTS = ["ipag.ttf", "ipam.ttf", "VL-Gothic-Regular.ttf", "UnBatang.ttf", "UnDotum.ttf",
               "NanumGothic.ttf", "NanumGothicBold.ttf"]


# The devices of device-parametrised tests: CUDA joins on a host that has it (CI has none).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this host"))]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, from outside the ephemeral range:
    no outbound connection takes it before the process it is meant for binds it."""
    return restartable_ports("127.0.0.1", 1)[0]


T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str, timeout: float,
               alive: Sequence[subprocess.Popen] = (),
               why: Callable[[], str] = lambda: "") -> T:
    """``condition()``'s first truthy value, asked every 50 ms. Fails, naming ``what`` (the
    thing waited for), once ``timeout`` seconds pass or a process of ``alive`` exits first; the
    failure message ends with ``why()`` (the process's log, say), read only then."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        for proc in alive:
            assert proc.poll() is None, \
                f"{proc.args} exited with {proc.returncode} while waiting for {what}\n{why()}"
        assert time.monotonic() < deadline, f"gave up waiting {timeout} s for {what}\n{why()}"
        time.sleep(0.05)
    return value


def set_torchrun_env(rank: int, world: int, port: int) -> None:
    """What torchrun gives rank ``rank`` of a one-host job whose rendezvous is 127.0.0.1:port
    (for test processes started with torch.multiprocessing.spawn)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))


@pytest.fixture(params=["compiled", "compiled, no F16C", "torch"],
                ids=["compiled", "compiled-no-f16c", "torch"])
def update_path(request, monkeypatch):
    """Runs a test on each way the shard's row update runs: the compiled loop
    (ams/shard/_kernels.c), the same with float16 converted without the F16C instructions (as
    CPUs without them, ARM's included, run it), and torch and numpy (as a host without a C
    compiler runs it)."""
    import ams.shard.optim

    kernels = ams.shard.optim._kernels
    if request.param == "torch":
        monkeypatch.setattr(ams.shard.optim, "_kernels", None)
        yield request.param
        return
    if kernels is None:
        pytest.skip("ams.shard._kernels is not built here (tests/test_optim.py says why)")
    before = kernels.use_f16c(request.param == "compiled")
    try:
        yield request.param
    finally:
        kernels.use_f16c(before)


@pytest.fixture
def tmp_data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    return d


# --- shard stores on each storage ------------------------------------------------------------


def png_declaring(height: int, width: int) -> bytes:
    """A grayscale PNG whose header declares ``height`` x ``width`` pixels and whose pixel
    data is a few bytes that do not decode: a reader sees the size without decompressing."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + \
            struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + \
        chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def reference_sgd_step(w: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, grads: torch.Tensor,
                       lr: float, momentum: float, wd: float) -> None:
    """torch.optim.SGD (float64) applied to just the touched rows, state carried over."""
    unique = torch.unique(ids)
    summed = torch.zeros((unique.numel(), w.shape[1]), dtype=torch.float64)
    summed.index_add_(0, torch.searchsorted(unique, ids), grads.double())
    p = torch.nn.Parameter(w[unique].clone())
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum, weight_decay=wd)
    opt.state[p]["momentum_buffer"] = v[unique].clone()
    p.grad = summed
    opt.step()
    w[unique] = p.detach()
    v[unique] = opt.state[p]["momentum_buffer"]


def dense_sgd_with_sparse_grads(w: torch.Tensor, steps: list, wd: float) -> list[torch.Tensor]:
    """The dense optimizer's answer: torch.optim.SGD (float64, momentum 0) on the whole table,
    every row shrinking by its weight decay in every step, gradient or not. Returns W after
    each step."""
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.SGD([p], lr=1.0, weight_decay=wd)
    out = []
    for ids, grads, lr in steps:
        opt.param_groups[0]["lr"] = lr
        p.grad = torch.zeros_like(p)
        p.grad.index_add_(0, ids, grads.double())
        opt.step()
        out.append(p.detach().clone())
    return out


def in_position_order(store, name: str = "fc") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, state, row_clock) of a store's table in local position order (row p first is
    the shard's p-th class), whatever slots the storage keeps them in: the store's own
    consistent copy (``ShardStore.copy_table``)."""
    copy = store.copy_table(name)
    return copy.rows, copy.state, copy.row_clock

def record_push_rates(client) -> list[float]:
    """The ``lr`` of each push made through ``client`` from now on, in order (the client's
    own ``push`` still does the work)."""
    rates: list[float] = []
    push = client.push

    def recording_push(table, ids, grads, **kwargs):
        rates.append(kwargs["lr"])
        return push(table, ids, grads, **kwargs)

    client.push = recording_push
    return rates


STORAGES = ["memory", "mmap"]


class Storages:
    """Shard stores and in-process AMS clients on one storage kind (``ams.shard.storage``); each
    mmap store or client gets a storage dir of its own under ``root``. ``close`` closes every
    one still open."""

    def __init__(self, kind: str, root: Path) -> None:
        self.kind, self.root = kind, root
        self.made: list = []

    def _dir(self) -> Path | None:
        return self.root / f"storage-{len(self.made)}" if self.kind == "mmap" else None

    def store(self, shard_id=0, num_shards=1, **kw):
        from ams.shard.store import ShardStore

        store = ShardStore(shard_id, num_shards, storage=self.kind, storage_dir=self._dir(),
                           **kw)
        self.made.append(store)
        return store

    def connect(self, local_shards, **kw):
        import ams

        client = ams.connect(local_shards=local_shards, storage=self.kind,
                             storage_dir=self._dir(), **kw)
        self.made.append(client)
        return client

    def close(self) -> None:
        for made in self.made:
            made.close()


@pytest.fixture(params=STORAGES)
def storage(request, tmp_path_factory):
    """The test runs once per storage kind, with a ``Storages`` of that kind."""
    made = Storages(request.param, tmp_path_factory.mktemp(f"storage-{request.param}"))
    yield made
    made.close()


def refused_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """stderr of ``xcls ARGV`` run in this process (``xcls.cli.main``), which must refuse it
    with exit code 2 in one line, no traceback."""
    from xcls.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# --- Redis (gear bridge tests) -------------------------------------------------------------------

class RedisServer:
    """A real ``redis-server`` on 127.0.0.1:``port`` (no persistence), that tests may kill and
    start again on the same port to play "Redis died mid-run"."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.host = "127.0.0.1"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        import redis

        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                pytest.fail(f"redis-server exited with {self.proc.returncode}: {err}")
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"redis-server on port {self.port} did not answer PING")
                time.sleep(0.02)
        client.close()

    def kill(self) -> None:
        """SIGKILL, as a crash would (no shutdown handshake)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

    def client(self):
        """A bridge client (short timeouts: ``bridge.redis_util.SOCKET_TIMEOUT_S``) for this
        server."""
        from bridge.redis_util import make_client

        return make_client(self.host, self.port)


def _redis_binary() -> str:
    binary = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)
    if binary is None:
        pytest.fail("redis-server not found: run the project setup, which installs it "
                    "(Debian: apt-get install redis-server)")
    return binary


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real Redis for the session; tests keep apart by key prefix."""
    server = RedisServer(_redis_binary(), tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_redis(tmp_path):
    """A Redis of the test's own, free to reconfigure, kill and restart."""
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = RedisServer(_redis_binary(), workdir)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def small_font_dir(tmp_path_factory):
    """A folder linking a few of the Debian CJK fonts the setup installs (fails without them:
    run scripts/setup.sh)."""
    from workers.data.fonts import find_fonts

    fonts = {f.path.name: f.path for f in find_fonts()}
    missing = [name for name in SMALL_FONTS if name not in fonts]
    if missing:
        pytest.fail(f"fonts {missing} are not installed: run bash scripts/setup.sh")
    d = tmp_path_factory.mktemp("fonts")
    for name in SMALL_FONTS:
        (d / name).symlink_to(fonts[name])
    return d


@pytest.fixture(scope="session")
def glyphs_small(small_font_dir, tmp_path_factory):
    """A real glyph dataset: 120 classes at 24x24, test designs unseen in training."""
    from workers.data.glyphs import build_glyph_dataset

    out = tmp_path_factory.mktemp("glyphs120")
    build_glyph_dataset(out, num_classes=120, size=24, min_designs=4, test_designs=1,
                        variants=3, seed=1, workers=2, font_dirs=(small_font_dir,),
                        cache_dir=out / "cache")
    return out
