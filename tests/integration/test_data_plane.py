"""The data plane of real ``xcls serve shard`` processes, spoken frame by frame.

Frames are built here from the layout in proto/ams/api/frames.md with ``struct`` (the hostile
ones on purpose wrong), not by the code under test; answers are checked for their code, and
the shard for having changed nothing.
"""

from __future__ import annotations

import collections
import concurrent.futures
import fcntl
import json
import math
import os
import random
import re
import socket
import ssl
import struct
import subprocess
import threading
import time

import grpc
import pytest
import torch

import ams
from ams.api import shard_pb2 as pb
from ams.api import shard_pb2_grpc as pb_grpc
from ams.dataplane.admission import HELLO_TIMEOUT_S
from ams.errors import IdOutOfRange, InvalidArgument
from ams.limits import PIECE_BYTES, SHARED_PIECE_BYTES
from ams.server.service import create_server
from ams.shard.store import ShardStore
from tests.conftest import dense_sgd_with_sparse_grads, free_port

N, D = 1000, 16
HEADER = struct.Struct("<4sBBBBIIQQQ")
HELLO, WELCOME, PULL, ROWS, PUSH, PUSHED, ERROR, SCAN = range(1, 9)
F32, F16, I64 = 1, 2, 4


def frame(kind, meta=None, ids=(), rows=None, *, dtype=None, magic=b"XAMS", version=1,
          flags=0, num_ids=None, num_rows=None, dim=None, body_bytes=None, raw_meta=None,
          positions=()):
    """The bytes of one frame; every header field can be overridden to lie. ``positions``
    follow the ids (a shared PULL's, flags 3)."""
    meta_bytes = raw_meta if raw_meta is not None else \
        (json.dumps(meta).encode() if meta is not None else b"")
    id_bytes = torch.tensor(list(ids) + list(positions), dtype=torch.int64).numpy().tobytes()
    row_bytes = b"" if rows is None else rows.contiguous().view(torch.uint8).numpy().tobytes()
    if dtype is None:
        dtype = 0 if rows is None else {torch.float32: F32, torch.float16: F16}[rows.dtype]
    header = HEADER.pack(
        magic, version, kind, dtype, flags, len(meta_bytes),
        (0 if rows is None else rows.shape[1]) if dim is None else dim,
        len(ids) if num_ids is None else num_ids,
        (0 if rows is None else rows.shape[0]) if num_rows is None else num_rows,
        len(meta_bytes) + len(id_bytes) + len(row_bytes) if body_bytes is None else body_bytes)
    return header + meta_bytes + id_bytes + row_bytes


def data_port(grpc_address: str, token: str | None = None) -> int:
    """The data port the shard tells over gRPC."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(grpc_address) as channel:
        port = pb_grpc.ShardStub(channel).Stats(pb.StatsRequest(), timeout=10,
                                                metadata=metadata).data_port
    assert port > 0
    return port


class Peer:
    """One raw connection to a shard's data port."""

    def __init__(self, grpc_address: str, token: str | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", data_port(grpc_address, token)),
                                             timeout=30)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            got = self.sock.recv(n - len(data))
            if not got:
                raise ConnectionError("closed")
            data += got
        return data

    def answer(self):
        """(kind, meta, ids, rows bytes) of the next frame from the shard; its flags and
        announced rows go to ``flags`` and ``announced`` (num_rows, dim, dtype)."""
        magic, version, kind, dtype, self.flags, meta_bytes, dim, num_ids, num_rows, body = \
            HEADER.unpack(self._exact(HEADER.size))
        assert (magic, version) == (b"XAMS", 1)
        self.announced = (num_rows, dim, dtype)
        raw = self._exact(body)
        meta = json.loads(raw[:meta_bytes]) if meta_bytes else {}
        ids = raw[meta_bytes:meta_bytes + 8 * num_ids]
        return kind, meta, ids, raw[meta_bytes + 8 * num_ids:]

    def hello(self, token=None, shared=None):
        meta = {"token": token} if token else {}
        if shared is not None:
            meta["shared"] = shared
        self.send(frame(HELLO, meta or None))
        kind, meta, _, _ = self.answer()
        assert kind == WELCOME, meta
        return meta

    def is_closed(self) -> bool:
        self.sock.settimeout(10)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def cluster(module_cluster):
    procs = module_cluster(2)
    client = ams.connect([p.address for p in procs])
    client.create_table("fc", num_rows=N, dim=D, seed=4)
    yield procs[0].address, client
    client.close()


def refused(address, data, code, needle) -> Peer:
    """A greeted connection that sent ``data`` and was answered with an ERROR of ``code``
    whose message holds ``needle`` (and stays short)."""
    peer = Peer(address)
    peer.hello()
    peer.send(data)
    kind, meta, _, _ = peer.answer()
    assert (kind, meta["code"]) == (ERROR, code), meta
    assert needle in meta["message"] and len(meta["message"]) < 1000
    return peer


def unchanged(client, before):
    assert torch.equal(client.pull("fc", torch.arange(N)), before)
    assert sum(s["tables"]["fc"]["rows_pushed"] for s in client.stats()) == 0


def grads(n, dim=D, value=0.1, dtype=torch.float32):
    return torch.full((n, dim), value, dtype=dtype)


PUSH_META = {"table": "fc", "lr": 0.1, "client_id": "c", "sequence": 1}
# (name, frame bytes, code, needle): frames the shard cannot read; it closes the connection
UNREADABLE = [
    ("magic", frame(PULL, {"table": "fc"}, [0], magic=b"HTTP"), "INVALID_ARGUMENT", "magic"),
    ("version", frame(PULL, {"table": "fc"}, [0], version=2), "INVALID_ARGUMENT", "version 2"),
    ("kind", frame(99, {"table": "fc"}, [0]), "INVALID_ARGUMENT", "unknown kind 99"),
    ("flags", frame(PULL, {"table": "fc"}, [0], flags=4), "INVALID_ARGUMENT", "flags"),
    ("positions-unshared", frame(PULL, {"table": "fc"}, [0], flags=2, positions=[0]),
     "INVALID_ARGUMENT", "only a PULL with shared rows has positions"),
    ("positions-push", frame(PUSH, {**PUSH_META, "offset": 0}, [0], dtype=F32, dim=D,
                             num_rows=1, flags=3, positions=[0]), "INVALID_ARGUMENT",
     "not a shared PUSH"),
    ("positions-missing", frame(PULL, {"table": "fc", "offset": 0, "bytes": 64}, [0, 2],
                                flags=3), "INVALID_ARGUMENT", "2 ids with positions"),
    ("flags-scan", frame(SCAN, {"table": "fc", "start": 0}, flags=1), "INVALID_ARGUMENT",
     "SCAN cannot have its rows in a shared buffer"),
    ("flags-shared-rows-length", frame(PUSH, {**PUSH_META, "offset": 0}, [0], grads(1),
                                       flags=1), "INVALID_ARGUMENT", "shared rows"),
    ("dtype", frame(PUSH, PUSH_META, [0], grads(1), dtype=77), "INVALID_ARGUMENT", "dtype 77"),
    ("length", frame(PUSH, PUSH_META, [0], grads(1), body_bytes=10_000), "INVALID_ARGUMENT",
     "body_bytes 10000"),
    ("counts", frame(PUSH, PUSH_META, [0, 2], grads(1)), "INVALID_ARGUMENT",
     "2 ids carries 1 gradient rows"),
    ("rows-in-pull", frame(PULL, {"table": "fc"}, [0], grads(1)), "INVALID_ARGUMENT",
     "carries no rows"),
    ("ids-in-scan", frame(SCAN, {"table": "fc", "start": 0}, [0]), "INVALID_ARGUMENT",
     "SCAN carries no ids"),
    ("answer-kind", frame(ROWS, None, [], grads(1)), "INVALID_ARGUMENT", "is an answer"),
    ("meta-json", frame(PULL, ids=[0], raw_meta=b"{nope"), "INVALID_ARGUMENT", "not JSON"),
    ("meta-list", frame(PULL, ids=[0], raw_meta=b"[1, 2]"), "INVALID_ARGUMENT", "JSON object"),
    ("meta-not-utf8", frame(PULL, ids=[0], raw_meta=b'{"table": "\xff"}'), "INVALID_ARGUMENT",
     "not JSON"),
    ("meta-utf16", frame(PULL, ids=[0], raw_meta='{"table": "t"}'.encode("utf-16")),
     "INVALID_ARGUMENT", "not JSON"),
    ("meta-deep", frame(PULL, ids=[0], raw_meta=b"[" * 60_000), "INVALID_ARGUMENT", "not JSON"),
    ("meta-huge", frame(PULL, ids=[0], raw_meta=b" " * 70_000), "INVALID_ARGUMENT",
     "bytes of meta"),
    ("rows-no-dtype", frame(PUSH, PUSH_META, [0], grads(1), dtype=0), "INVALID_ARGUMENT",
     "without a dtype"),
    ("body-huge", frame(PULL, {"table": "fc"}, [0], body_bytes=1 << 40), "RESOURCE_EXHAUSTED",
     "split the request"),
    ("ids-many", frame(PULL, {"table": "fc"}, [0], num_ids=1 << 21,
                       body_bytes=len('{"table": "fc"}') + (8 << 21)),
     "RESOURCE_EXHAUSTED", "2097152 ids in one request"),
]


@pytest.mark.parametrize("name,data,code,needle", UNREADABLE, ids=[u[0] for u in UNREADABLE])
def test_unreadable_frame_is_refused_and_closes_the_connection(cluster, name, data, code,
                                                                needle):
    address, client = cluster
    before = client.pull("fc", torch.arange(N))
    peer = refused(address, data, code, needle)
    assert peer.is_closed()
    peer.close()
    unchanged(client, before)


def test_truncated_frame_is_refused_and_applies_nothing(cluster):
    address, client = cluster
    before = client.pull("fc", torch.arange(N))
    peer = Peer(address)
    peer.hello()
    whole = frame(PUSH, PUSH_META, [0, 2], grads(2))
    peer.send(whole[:-7])
    peer.sock.shutdown(socket.SHUT_WR)  # the rest never comes
    kind, meta, _, _ = peer.answer()
    assert (kind, meta["code"]) == (ERROR, "INVALID_ARGUMENT")
    assert "truncated" in meta["message"]
    assert peer.is_closed()
    peer.close()
    unchanged(client, before)


# (name, frame bytes, code, needle): well-formed frames the store refuses; the connection
# stays open and answers the next request
REFUSED = [
    ("no-table", frame(PULL, {"table": "nope"}, [0]), "NOT_FOUND", "nope"),
    ("id-high", frame(PULL, {"table": "fc"}, [N]), "OUT_OF_RANGE", str(N)),
    ("id-negative", frame(PULL, {"table": "fc"}, [-2]), "OUT_OF_RANGE", "-2"),
    ("id-foreign", frame(PULL, {"table": "fc"}, [1]), "OUT_OF_RANGE", "belongs to shard 1"),
    ("no-table-field", frame(PULL, {}, [0]), "INVALID_ARGUMENT", "'table' is required"),
    ("table-not-str", frame(PULL, {"table": 5}, [0]), "INVALID_ARGUMENT", "'table' must be"),
    ("long-table", frame(PULL, {"table": "x" * 60_000}, [0]), "NOT_FOUND", "(60002 chars)"),
    ("grads-width", frame(PUSH, PUSH_META, [0, 2], grads(2, D + 1)), "INVALID_ARGUMENT",
     "grads"),
    ("grads-nan", frame(PUSH, PUSH_META, [0], grads(1, value=float("nan"))),
     "INVALID_ARGUMENT", "non-finite"),
    ("grads-int", frame(PUSH, PUSH_META, [0],
                        torch.zeros(1, D, dtype=torch.int64).view(torch.float64), dtype=I64),
     "INVALID_ARGUMENT", "float"),
    ("lr-inf", frame(PUSH, {**PUSH_META, "lr": float("inf")}, [0], grads(1)),
     "INVALID_ARGUMENT", "lr"),
    ("lr-over-float32", frame(PUSH, {**PUSH_META, "lr": 1e308}, [0], grads(1)),
     "INVALID_ARGUMENT", "lr=1e+308 must be a number in [0, "),
    ("lr-bool", frame(PUSH, {**PUSH_META, "lr": True}, [0], grads(1)), "INVALID_ARGUMENT",
     "'lr' must be"),
    ("lr-missing", frame(PUSH, {k: v for k, v in PUSH_META.items() if k != "lr"}, [0],
                         grads(1)), "INVALID_ARGUMENT", "'lr' is required"),
    ("clock-negative", frame(PUSH, {**PUSH_META, "decay_clock": -3.0}, [0], grads(1)),
     "INVALID_ARGUMENT", "decay_clock"),
    ("sequence-negative", frame(PUSH, {**PUSH_META, "sequence": -1}, [0], grads(1)),
     "INVALID_ARGUMENT", "sequence"),
    ("client-long", frame(PUSH, {**PUSH_META, "client_id": "c" * 129}, [0], grads(1)),
     "INVALID_ARGUMENT", "client_id"),
    ("scan-no-start", frame(SCAN, {"table": "fc"}), "INVALID_ARGUMENT", "'start' is required"),
    ("scan-start-negative", frame(SCAN, {"table": "fc", "start": -1}), "INVALID_ARGUMENT",
     "start=-1"),
    ("scan-start-bool", frame(SCAN, {"table": "fc", "start": True}), "INVALID_ARGUMENT",
     "'start' must be"),
    ("scan-rows-zero", frame(SCAN, {"table": "fc", "start": 0, "rows": 0}), "INVALID_ARGUMENT",
     "block_rows=0"),
    ("scan-no-table", frame(SCAN, {"table": "nope", "start": 0}), "NOT_FOUND", "nope"),
    # finite gradients whose update overflows float32
    ("overflow", frame(PUSH, {**PUSH_META, "lr": 10.0}, [0], grads(1, value=3e38)),
     "INVALID_ARGUMENT", "non-finite"),
    ("overflow-summed", frame(PUSH, {**PUSH_META, "lr": 1.0}, [2, 2], grads(2, value=3e38)),
     "INVALID_ARGUMENT", "non-finite"),
]


@pytest.mark.parametrize("name,data,code,needle", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_request_changes_nothing_and_the_connection_serves_on(cluster, name, data,
                                                                      code, needle):
    address, client = cluster
    before = client.pull("fc", torch.arange(N))
    peer = refused(address, data, code, needle)
    peer.send(frame(PULL, {"table": "fc"}, [0, 4]))
    kind, _, _, rows = peer.answer()
    assert kind == ROWS
    assert rows == before[[0, 4]].numpy().tobytes()
    peer.close()
    unchanged(client, before)


def test_the_first_frame_must_be_a_hello(cluster):
    address, client = cluster
    before = client.pull("fc", torch.arange(N))
    peer = Peer(address)
    peer.send(frame(PUSH, PUSH_META, [0], grads(1)))
    kind, meta, _, _ = peer.answer()
    assert (kind, meta["code"]) == (ERROR, "UNAUTHENTICATED")
    assert peer.is_closed()
    peer.close()
    unchanged(client, before)


def test_a_hello_expecting_another_incarnation_is_aborted(cluster):
    address, _ = cluster
    peer = Peer(address)
    welcome = peer.hello()
    assert welcome["shard_id"] == 0 and welcome["num_shards"] == 2
    other = Peer(address)
    other.send(frame(HELLO, {"expect_incarnation": "0" * 32}))
    kind, meta, _, _ = other.answer()
    assert (kind, meta["code"]) == (ERROR, "ABORTED")
    assert welcome["incarnation"] in meta["message"]
    for p in (peer, other):
        p.close()


def test_requests_are_answered_in_order_on_one_connection(cluster):
    """A client may send before the last answer came (the pipelining the client does)."""
    address, client = cluster
    expected = client.pull("fc", torch.arange(0, N, 2))
    peer = Peer(address)
    peer.hello()
    chunks = torch.arange(0, N, 2).split(100)
    peer.send(b"".join(frame(PULL, {"table": "fc"}, c.tolist()) for c in chunks))
    got = []
    for _ in chunks:
        kind, _, _, rows = peer.answer()
        assert kind == ROWS
        got.append(torch.frombuffer(bytearray(rows), dtype=torch.float32).view(-1, D))
    assert torch.equal(torch.cat(got), expected)
    peer.close()



@pytest.mark.parametrize("refused", ["pull", "push"])
def test_a_refused_piece_leaves_the_connection_in_step(cluster, refused):
    """A request of many pipelined pieces whose first piece the shard refuses: the pieces
    still on the wire are answered too, and the connection's next request must read its own
    answer, not one of theirs (another request's rows, of the same shape)."""
    _, reference = cluster
    client = ams.connect(client_addresses(reference))
    table = f"step_{refused}"
    client.create_table(table, num_rows=N, dim=D, seed=5)
    for shard in client.shards:
        shard.piece_bytes = 8 * D * 4  # pieces of 8 rows: several on the wire at once
    ids = torch.arange(0, 200, 2)  # all on shard 0: 13 pieces on one connection
    if refused == "pull":
        with pytest.raises(IdOutOfRange):
            client.pull(table, torch.cat([torch.tensor([N + 2]), ids]))
    else:  # a gradient the client passes (finite) but whose row the shard refuses
        g = grads(ids.numel())
        g[0, 0] = 3e38
        with pytest.raises(InvalidArgument, match="would become non-finite"):
            client.push(table, ids, g, 10.0)
    for _ in range(3):  # each pooled connection is used again
        assert torch.equal(client.pull(table, torch.arange(N)),
                           reference.pull(table, torch.arange(N)))
    client.close()

def test_scan_blocks_cover_the_shard_in_id_order(cluster):
    address, client = cluster
    peer = Peer(address)
    peer.hello()
    start, ids, rows = 0, [], []
    while True:
        peer.send(frame(SCAN, {"table": "fc", "start": start, "rows": 150}))
        kind, _, block_ids, block_rows = peer.answer()
        assert kind == ROWS
        if not block_ids:  # past the last row
            assert not block_rows
            break
        got = torch.frombuffer(bytearray(block_ids), dtype=torch.int64)
        assert got.numel() <= 150
        ids.append(got)
        rows.append(torch.frombuffer(bytearray(block_rows), dtype=torch.float32).view(-1, D))
        start += got.numel()
    peer.close()
    ids = torch.cat(ids)
    assert ids.tolist() == list(range(0, N, 2))  # shard 0 of 2 owns the even ids
    assert torch.equal(torch.cat(rows), client.pull("fc", ids))


def test_a_resent_push_applies_once_and_a_refused_one_is_not_remembered(cluster):
    address, client = cluster
    client.create_table("once", num_rows=N, dim=D, seed=4, momentum=0.0, weight_decay=0.0)
    start = client.pull("once", torch.tensor([0, 4])).double()
    peer = Peer(address)
    peer.hello()
    meta = {"table": "once", "lr": 0.5, "client_id": "worker-7", "sequence": 41}
    peer.send(frame(PUSH, {**meta, "lr": 10.0}, [0], grads(1, value=3e38)))  # overflows
    assert peer.answer()[1]["code"] == "INVALID_ARGUMENT"
    push = frame(PUSH, meta, [0, 4], grads(2, value=0.1))  # the corrected push, same sequence
    peer.send(push)
    assert peer.answer()[:2] == (PUSHED, {"applied": True})
    peer.send(push)  # resent, as after a lost answer
    assert peer.answer()[:2] == (PUSHED, {"applied": False})
    peer.close()
    torch.testing.assert_close(client.pull("once", torch.tensor([0, 4])).double(),
                               start - 0.5 * 0.1, rtol=0, atol=1e-6)


@pytest.mark.parametrize("where", ["in process", "shard processes"])
def test_a_shard_without_rows_in_a_step_still_takes_its_decay(cluster, where):
    """Pushes that land on one shard only (and a step with no rows at all): every row, on
    either shard, pulls and scans as float64 dense SGD has it, which shrinks each row by its
    weight decay in every step."""
    wd = 0.05
    client = ams.connect(local_shards=2) if where == "in process" else cluster[1]
    client.create_table("decay", num_rows=N, dim=D, seed=4, momentum=0.0, weight_decay=wd)
    gen = torch.Generator().manual_seed(3)
    even = torch.arange(0, N, 2)  # shard 0's classes of two
    steps = [(even[torch.randint(0, even.numel(), (5,), generator=gen)],
              torch.randn(5, D, generator=gen), 0.5) for _ in range(3)]
    steps.append((torch.zeros(0, dtype=torch.int64), torch.zeros(0, D), 0.25))
    dense = dense_sgd_with_sparse_grads(client.pull("decay", torch.arange(N)).double(), steps,
                                        wd)[-1]
    clock = 0.0
    for ids, g, lr in steps:
        client.push("decay", ids, g, lr, decay_clock=clock)
        clock -= math.log1p(-lr * wd)
    torch.testing.assert_close(client.pull("decay", torch.arange(N)).double(), dense,
                               rtol=1e-6, atol=1e-7)
    ids, rows = (torch.cat(parts) for parts in zip(*client.scan("decay"), strict=True))
    torch.testing.assert_close(rows[ids.argsort()].double(), dense, rtol=1e-6, atol=1e-7)
    if where == "in process":
        client.close()


@pytest.mark.parametrize("where", ["in process", "shard processes"])
def test_a_narrow_tables_pulls_and_pushes_are_cut_within_the_ids_a_request_may_name(
        cluster, where):
    """Rows of one float each: a request's bytes allow far more ids than a shard takes
    (MAX_IDS_PER_REQUEST), and the client still moves 2.5M of them in one call."""
    n = 2_500_000  # 1.25M ids per shard
    client = ams.connect(local_shards=2) if where == "in process" else cluster[1]
    client.create_table("narrow", num_rows=n, dim=1, seed=5, momentum=0.0, weight_decay=0.0)
    ids = torch.arange(n)
    start = client.pull("narrow", ids).double()
    grads = torch.linspace(-1.0, 1.0, n).reshape(n, 1)
    client.push("narrow", ids, grads, 0.5)
    torch.testing.assert_close(client.pull("narrow", ids).double(),
                               start - 0.5 * grads.double(), rtol=0, atol=1e-6)
    if where == "in process":
        client.close()


@pytest.mark.parametrize("where", ["in process", "shard processes"])
def test_a_push_refused_for_its_ids_or_gradients_changes_no_shard(cluster, where):
    """Over two shards, a push with one bad id or one non-finite gradient row (of a class on
    the other shard than the first id's) is refused before any shard applies its part, so
    the corrected push applies exactly once."""
    client = ams.connect(local_shards=2) if where == "in process" else cluster[1]
    client.create_table("whole", num_rows=N, dim=D, seed=6, momentum=0.0, weight_decay=0.0)
    ids = torch.tensor([2, 7, 10])  # shards 0, 1, 0
    start = client.pull("whole", torch.arange(N)).double()
    g = grads(3, value=0.25)
    bad = g.clone()
    bad[1, 3] = float("inf")
    with pytest.raises(InvalidArgument, match="row 1 has a non-finite value"):
        client.push("whole", ids, bad, 0.5)
    with pytest.raises(IdOutOfRange, match=f"id {N + 1} is outside"):
        client.push("whole", torch.tensor([2, 7, N + 1]), g, 0.5)
    assert torch.equal(client.pull("whole", torch.arange(N)).double(), start)
    client.push("whole", ids, g, 0.5)
    expected = start.clone()
    expected[ids] -= 0.5 * g.double()
    torch.testing.assert_close(client.pull("whole", torch.arange(N)).double(), expected,
                               rtol=0, atol=1e-6)
    if where == "in process":
        client.close()


def test_a_pull_reply_over_the_limit_is_refused_before_it_is_built(cluster):
    address, client = cluster
    client.create_table("wide", num_rows=10, dim=512, momentum=0.0)
    peer = Peer(address)
    peer.hello()
    n = 300_000  # 300k x 512 x 4 bytes: 614 MB of rows
    peer.send(frame(PULL, {"table": "wide"}, [0] * n))
    kind, meta, _, _ = peer.answer()
    assert (kind, meta["code"]) == (ERROR, "RESOURCE_EXHAUSTED")
    assert "split the request" in meta["message"]
    peer.close()


def _valid_frame(rng: random.Random, table: str) -> bytes:
    """A PULL, SCAN or PUSH this shard (the only one) would serve."""
    ids = rng.sample(range(N), rng.randint(1, 20))
    kind = rng.choice((PULL, SCAN, PUSH, PUSH))
    if kind == PULL:
        return frame(PULL, {"table": table}, ids)
    if kind == SCAN:
        return frame(SCAN, {"table": table, "start": rng.randrange(N)})
    meta = {"table": table, "lr": 0.01, "client_id": f"c{rng.randrange(3)}",
            "sequence": rng.randrange(1 << 20), "decay_clock": rng.random()}
    g = grads(len(ids), value=rng.uniform(-1e-3, 1e-3))
    return frame(PUSH, meta, sorted(ids), g.half() if rng.random() < 0.3 else g)


def _mutated(rng: random.Random, data: bytes) -> bytes:
    """``data`` with one to four random changes: a byte set, a header bit flipped, cut short,
    lengthened, a count or length field of the header lying, a number of the meta at an
    extreme (same-length JSON is not needed: the body length is then off, another lie)."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        change = rng.randrange(6)
        if change == 5:
            numbers = list(re.finditer(rb"-?[0-9][0-9.e+-]*", bytes(out[HEADER.size:])))
            if numbers:
                hit = rng.choice(numbers)
                extreme = rng.choice([b"1e308", b"-1e308", b"1e39", b"-0.0", b"-1", b"0",
                                      b"1e-320", b"18446744073709551616"])
                start, stop = HEADER.size + hit.start(), HEADER.size + hit.end()
                out[start:stop] = extreme
                # the header's meta and body lengths follow the new meta, or the frame lies
                grow = len(extreme) - (stop - start)
                if rng.random() < 0.8:
                    meta_bytes, body = struct.unpack_from("<I", out, 8)[0], \
                        struct.unpack_from("<Q", out, 32)[0]
                    struct.pack_into("<I", out, 8, (meta_bytes + grow) % (1 << 32))
                    struct.pack_into("<Q", out, 32, (body + grow) % (1 << 64))
            continue
        if change == 0 and out:
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif change == 1 and out:
            out[rng.randrange(min(len(out), HEADER.size))] ^= 1 << rng.randrange(8)
        elif change == 2:
            del out[rng.randrange(len(out) + 1):]
        elif change == 3:
            out += rng.randbytes(rng.randint(1, 64))
        elif len(out) >= HEADER.size:
            offset, fmt = rng.choice([(8, "<I"), (12, "<I"), (16, "<Q"), (24, "<Q"), (32, "<Q")])
            width = struct.calcsize(fmt)
            out[offset:offset + width] = struct.pack(
                fmt, rng.choice([0, 1, 2, rng.randrange(1 << 16), (1 << 8 * width) - 1]))
    return bytes(out)


TYPED_CODES = {"INVALID_ARGUMENT", "NOT_FOUND", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED"}


def typed_answer(peer: Peer, data: bytes) -> tuple[str, dict]:
    """Send ``data`` and shut the sending side (so that no frame leaves the shard waiting for
    bytes); the answer, checked to be rows, a push receipt or a typed error that is not
    INTERNAL, as ("rows" | "pushed" | "error", meta), or ("closed", {})."""
    peer.send(data)
    peer.sock.shutdown(socket.SHUT_WR)
    try:
        kind, meta, _, _ = peer.answer()
    except ConnectionError:
        return "closed", {}
    assert kind in (ROWS, PUSHED, ERROR), (kind, meta, data[:64])
    if kind == ERROR:
        assert meta["code"] in TYPED_CODES, (meta, data[:200])
    return {ROWS: "rows", PUSHED: "pushed", ERROR: "error"}[kind], meta


def assert_no_traceback(log_dir) -> None:
    logs = list(log_dir.glob("*.log"))
    assert logs
    log = "".join(p.read_text(errors="replace") for p in logs)
    assert "Traceback" not in log, log[-3000:]


def test_mutated_frames_get_a_typed_answer_and_the_shard_serves_on(shard_cluster, tmp_path):
    """Valid frames with random changes, one per connection whose sender then shuts its side
    (so that no frame leaves the shard waiting for bytes): each gets rows, a push receipt or
    a typed error that is not INTERNAL, or its connection closes. Afterwards the shard serves,
    its rows are finite, and its log holds no traceback."""
    (proc,) = shard_cluster(1)
    rng = random.Random(7)
    answers: collections.Counter[str] = collections.Counter()
    with ams.connect([proc.address]) as client:
        client.create_table("fz", num_rows=N, dim=D, seed=5, dtype="float16")
        for _ in range(300):
            data = _mutated(rng, _valid_frame(rng, "fz"))
            peer = Peer(proc.address)
            peer.hello()
            answer, meta = typed_answer(peer, data)
            if answer == "error":
                assert len(meta["message"]) < 1000
            answers[answer] += 1
            peer.close()
        rows = client.pull("fz", torch.arange(N))
    # the changes were both refused and, where they left a valid frame, served
    assert answers["error"] > 50 and answers["rows"] + answers["pushed"] > 10, answers
    assert bool(torch.isfinite(rows.float()).all())
    assert_no_traceback(tmp_path)


def test_token_is_required_in_the_hello(shard_cluster, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    (proc,) = shard_cluster(1, token_file=token_file)
    with ams.connect([proc.address], token="s3cret") as client:
        client.create_table("fc", num_rows=10, dim=4)
        before = client.pull("fc", torch.arange(10))
        # JSON may carry a lone surrogate, which no UTF-8 token file holds
        for hello in (frame(HELLO), frame(HELLO, {"token": "wrong"}),
                      frame(HELLO, raw_meta=b'{"token": "\\ud800"}'),
                      frame(HELLO, raw_meta=b'{"token": "s3cret\\udfff"}'),
                      frame(PUSH, PUSH_META, [0], grads(1, 4))):
            peer = Peer(proc.address, token="s3cret")
            peer.send(hello)
            kind, meta, _, _ = peer.answer()
            assert (kind, meta["code"]) == (ERROR, "UNAUTHENTICATED")
            assert peer.is_closed()
            peer.close()
        assert torch.equal(client.pull("fc", torch.arange(10)), before)
        peer = Peer(proc.address, token="s3cret")
        peer.hello(token="s3cret")
        peer.close()
    assert_no_traceback(tmp_path)


# ---- strangers, slow senders and peers that leave --------------------------------------------


def closed_by_the_shard(sock: socket.socket, by: float) -> bool:
    """Whether the shard closes ``sock`` (after an ERROR frame, or without a word) before
    time ``by`` (``time.monotonic``)."""
    while True:
        sock.settimeout(max(0.01, by - time.monotonic()))
        try:
            if not sock.recv(1 << 16):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False


def test_strangers_that_never_greet_cannot_keep_a_client_with_the_token_out(shard_cluster,
                                                                           tmp_path):
    """Hundreds of sockets to the data port that never send a HELLO, and one that sends its
    HELLO a byte at a time, all from the client's own address: the client with the token
    connects, and pulls and pushes on several connections at once, as an embedded store
    does; every stranger is closed within the HELLO's time."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    (proc,) = shard_cluster(1, token_file=token_file)
    port = data_port(proc.address, "s3cret")
    strangers = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(300)]
    trickler = socket.create_connection(("127.0.0.1", port), timeout=30)
    hello = frame(HELLO, {"token": "s3cret" + "x" * 200})  # over a minute at this pace
    stop = threading.Event()

    def trickle() -> None:
        for i in range(len(hello)):
            if stop.wait(0.3):
                return
            try:
                trickler.sendall(hello[i:i + 1])
            except OSError:
                return

    trickling = threading.Thread(target=trickle)
    trickling.start()
    gen = torch.Generator().manual_seed(8)
    with ams.connect([proc.address], token="s3cret") as client, \
            ams.connect(local_shards=1) as reference:
        for c in (client, reference):
            c.create_table("fc", num_rows=N, dim=D, seed=4)
        # more strangers while the client works, and pulls on new connections among them
        strangers += [socket.create_connection(("127.0.0.1", port), timeout=30)
                      for _ in range(300)]
        opened = time.monotonic()
        for step in range(3):
            ids = torch.randint(0, N, (200,), generator=gen)
            g = torch.randn(200, D, generator=gen)
            for c in (client, reference):
                c.push("fc", ids, g, 0.1, decay_clock=float(step))
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                pulled = list(pool.map(lambda _: client.pull("fc", torch.arange(N)), range(4)))
            expected = reference.pull("fc", torch.arange(N))
            assert all(torch.equal(rows, expected) for rows in pulled)
    by = opened + HELLO_TIMEOUT_S + 20  # the last one's HELLO time, and room for a busy host
    assert all(closed_by_the_shard(sock, by) for sock in [*strangers, trickler])
    stop.set()
    trickling.join()
    for sock in [*strangers, trickler]:
        sock.close()
    assert_no_traceback(tmp_path)


ANNOUNCED_DIM = 50_000_000  # one gradient row of about 190 MiB of float32


@pytest.mark.parametrize("meta,code,needle", [
    (PUSH_META, "INVALID_ARGUMENT", f"grads: shape (1, {ANNOUNCED_DIM}), need (1, {D})"),
    ({**PUSH_META, "table": "nope"}, "NOT_FOUND", "nope"),
])
def test_a_push_that_cannot_fit_its_table_is_refused_before_its_body_comes(cluster, meta, code,
                                                                            needle):
    """A PUSH announcing a gradient row far wider than its table's (or for a table that does
    not exist) is answered as soon as its meta is in: the shard does not wait for, nor make
    room for, the body."""
    address, client = cluster
    before = client.pull("fc", torch.arange(N))
    peer = Peer(address)
    peer.hello()
    raw = json.dumps(meta).encode()
    peer.send(HEADER.pack(b"XAMS", 1, PUSH, F32, 0, len(raw), ANNOUNCED_DIM, 1, 1,
                          len(raw) + 8 + 4 * ANNOUNCED_DIM) + raw)  # no byte of the body
    peer.sock.settimeout(20)
    kind, reply, _, _ = peer.answer()
    assert (kind, reply["code"]) == (ERROR, code) and needle in reply["message"], reply
    peer.close()
    unchanged(client, before)


def announce_push(address: str, table: str, num_ids: int, dim: int) -> Peer:
    """A greeted connection that sent the header and meta of a float32 PUSH of ``num_ids``
    rows of ``dim``, and none of its body."""
    peer = Peer(address)
    peer.hello()
    raw = json.dumps({**PUSH_META, "table": table}).encode()
    peer.send(HEADER.pack(b"XAMS", 1, PUSH, F32, 0, len(raw), dim, num_ids, num_ids,
                          len(raw) + num_ids * (8 + 4 * dim)) + raw)
    return peer


def no_answer_within(peer: Peer, seconds: float) -> bool:
    peer.sock.settimeout(seconds)
    try:
        peer.sock.recv(1, socket.MSG_PEEK)
    except TimeoutError:
        return True
    return False


def test_request_bodies_a_shard_holds_at_once_are_bounded(cluster):
    """Greeted peers that announce pushes of 250 MiB and send them slowly: the shard holds
    four such bodies (1 GiB) and answers the fifth with UNAVAILABLE (busy: retry) at once; once the
    four are gone, it holds a new one again."""
    address, client = cluster
    client.create_table("budget", num_rows=2, dim=65536, momentum=0.0)
    ids = 1000  # 1000 x 65536 float32: 250 MiB, under the 256 MiB of one frame
    held = [announce_push(address, "budget", ids, 65536) for _ in range(4)]
    assert all(no_answer_within(peer, 1.0) for peer in held)  # waiting for their bodies
    over = announce_push(address, "budget", ids, 65536)
    over.sock.settimeout(20)
    kind, reply, _, _ = over.answer()
    assert (kind, reply["code"]) == (ERROR, "UNAVAILABLE"), reply
    assert "bytes of request bodies" in reply["message"]
    for peer in [*held, over]:
        peer.close()
    deadline = time.monotonic() + 30
    while True:  # the shard sees the closed connections and gives their bytes back
        again = announce_push(address, "budget", ids, 65536)
        if no_answer_within(again, 1.0):
            break
        assert time.monotonic() < deadline, again.answer()
        again.close()
    again.close()


def test_answers_a_peer_does_not_read_count_in_what_the_shard_holds(cluster):
    """A pull's answer waiting for a peer that does not read it is held in the same budget
    as request bodies: three announced 250 MiB pushes and one such answer fill it, and the
    next 250 MiB pull is refused with UNAVAILABLE (busy: a client retries; its connection
    serves on)."""
    address, client = cluster
    client.create_table("answers", num_rows=2000, dim=65536, momentum=0.0, init_std=0.0)
    ids = list(range(0, 2000, 2))  # shard 0's 1000 rows: 250 MiB
    held = [announce_push(address, "answers", 1000, 65536) for _ in range(3)]
    unread = Peer(address)
    unread.hello()
    unread.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    unread.send(frame(PULL, {"table": "answers"}, ids))
    time.sleep(1.0)  # the answer is built and waits in the shard's send
    over = Peer(address)
    over.hello()
    over.send(frame(PULL, {"table": "answers"}, ids))
    over.sock.settimeout(30)
    kind, reply, _, _ = over.answer()
    assert (kind, reply["code"]) == (ERROR, "UNAVAILABLE"), reply
    assert "bytes of request bodies and answers" in reply["message"]
    over.send(frame(PULL, {"table": "answers"}, [0]))
    assert over.answer()[0] == ROWS
    for peer in [*held, unread, over]:
        peer.close()


def test_an_answer_must_be_taken_within_its_deadline_not_only_byte_by_byte(monkeypatch):
    """A greeted peer that reads a 64 MiB answer 64 KiB every 0.3 s, well within the time
    allowed between two bytes, is cut off once the answer's deadline passed (BODY_TIMEOUT_S,
    shortened here, plus its size at MIN_BODY_BYTES_PER_S, raised here): the shard stops
    holding its memory, and serves others on."""
    import ams.dataplane.server

    monkeypatch.setattr(ams.dataplane.server, "BODY_TIMEOUT_S", 1.5)
    monkeypatch.setattr(ams.dataplane.server, "MIN_BODY_BYTES_PER_S", 1 << 30)
    store = ShardStore(0, 1)
    running = create_server(store)
    address = f"127.0.0.1:{running.port}"
    try:
        store.create_table(ams.TableSpec("big", num_rows=16384, dim=1024, momentum=0.0))
        peer = Peer(address)
        peer.hello()
        peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        peer.send(frame(PULL, {"table": "big"}, list(range(16384))))
        got = 0
        for _ in range(17):  # five seconds at a pace that would take five minutes
            time.sleep(0.3)
            got += len(peer.sock.recv(1 << 16))
        peer.sock.settimeout(20)
        while True:  # then the rest at once: what was sent before the cut, and the end
            try:
                data = peer.sock.recv(1 << 20)
            except ConnectionResetError:
                break
            if not data:
                break
            got += len(data)
        assert got < 64 << 20  # the answer's rows alone are 64 MiB
        peer.close()
        with ams.connect([address]) as other:
            assert other.pull("big", torch.tensor([5])).shape == (1, 1024)
    finally:
        running.stop(0)


def test_a_body_must_arrive_within_its_deadline_not_only_byte_by_byte(monkeypatch):
    """A greeted peer that sends a push a byte every 0.3 s, well within the time allowed
    between two bytes, is cut off once the frame's own deadline passed (BODY_TIMEOUT_S from
    its first byte, shortened here, plus its size at MIN_BODY_BYTES_PER_S): answered with
    INVALID_ARGUMENT, the connection closed, nothing applied."""
    import ams.dataplane.server

    monkeypatch.setattr(ams.dataplane.server, "BODY_TIMEOUT_S", 1.5)
    store = ShardStore(0, 1)
    running = create_server(store)
    address = f"127.0.0.1:{running.port}"
    try:
        store.create_table(ams.TableSpec("fc", num_rows=10, dim=4, momentum=0.0))
        before = store.pull("fc", torch.arange(10))
        peer = Peer(address)
        peer.hello()
        push = frame(PUSH, PUSH_META, [3], grads(1, 4))  # about a minute at this pace
        stop = threading.Event()

        def trickle() -> None:
            for i in range(len(push)):
                if stop.wait(0.3):
                    return
                try:
                    peer.sock.sendall(push[i:i + 1])
                except OSError:
                    return

        sending = threading.Thread(target=trickle)
        began = time.monotonic()
        sending.start()
        peer.sock.settimeout(20)
        kind, reply, _, _ = peer.answer()
        took = time.monotonic() - began
        stop.set()
        sending.join()
        assert (kind, reply["code"]) == (ERROR, "INVALID_ARGUMENT") and \
            "truncated" in reply["message"], reply
        assert took < 10, took
        assert peer.is_closed()
        peer.close()
        assert torch.equal(store.pull("fc", torch.arange(10)), before)
    finally:
        running.stop(0)


def test_a_client_that_leaves_with_requests_unanswered_is_no_internal_error(shard_cluster,
                                                                             tmp_path):
    """A peer sends pulls whose answers fill the socket's buffers and resets its connection
    while the shard sends them: the shard logs no error and counts no INTERNAL call; the
    answer it could not send is counted as CANCELLED (its caller went away)."""
    from tests.integration.test_metrics import scrape_when

    metrics_port = free_port()
    (proc,) = shard_cluster(1, ["--metrics-port", str(metrics_port)])
    with ams.connect([proc.address]) as client:
        client.create_table("wide", num_rows=64, dim=4096, seed=1)  # 1 MiB for all rows
    peer = Peer(proc.address)
    peer.hello()
    peer.send(b"".join(frame(PULL, {"table": "wide"}, list(range(64))) for _ in range(20)))
    peer._exact(HEADER.size)  # the shard is answering
    peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.close()  # a reset: the unread answers are refused

    def errors(scraped: dict) -> dict:
        return {labels: value for (name, labels), value in scraped.items()
                if name == "xcls_shard_request_errors_total"}

    m = scrape_when(metrics_port, errors, "the shard to count the refused answer")
    assert errors(m) == {(("code", "CANCELLED"), ("method", "Pull")): 1.0}
    assert_no_traceback(tmp_path)
    log = "".join(path.read_text() for path in tmp_path.glob("*.log"))
    assert "level=error" not in log, log[-3000:]


@pytest.mark.parametrize("order", [None, "stop_waits_first", "thread_waits_first"])
def test_stop_finishes_the_request_under_way_and_closes_idle_connections(order):
    """A push whose first bytes reached the shard before stop looked is finished, whether or
    not the connection's thread has read them yet. ``order``: the server's lock is held while
    the bytes arrive, and stop and the connection's thread (woken by the bytes) queue for it
    in this order (the first to queue usually gets it first, so both races are run)."""
    running = create_server(ShardStore(0, 1))
    address = f"127.0.0.1:{running.port}"
    try:
        with ams.connect([address]) as client:
            client.create_table("fc", num_rows=10, dim=4, momentum=0.0, weight_decay=0.0)
            start = client.pull("fc", torch.arange(10)).double()
        idle, busy = Peer(address), Peer(address)
        for peer in (idle, busy):
            peer.hello()
        push = frame(PUSH, {**PUSH_META, "lr": 0.5}, [3], grads(1, 4, value=0.25))
        stopper = threading.Thread(target=running.stop, args=(30,))
        lock = running.data_plane._lock  # white box: the only way to line up the race
        if order is not None:
            lock.acquire()
        if order == "stop_waits_first":
            stopper.start()
            time.sleep(0.1)
        busy.send(push[:-8])  # a push under way: its last bytes come after stop began
        if order is not None:
            time.sleep(0.1)  # the connection's thread wakes and waits for the lock
        if order != "stop_waits_first":
            stopper.start()
        if order == "thread_waits_first":
            time.sleep(0.1)
        if order is not None:
            lock.release()
        assert idle.is_closed()
        time.sleep(0.2)
        assert stopper.is_alive()  # waiting for the push under way
        busy.send(push[-8:])
        assert busy.answer()[:2] == (PUSHED, {"applied": True})
        assert busy.is_closed()
        stopper.join(30)
        assert not stopper.is_alive()
        expected = start.clone()
        expected[3] -= 0.5 * 0.25
        torch.testing.assert_close(running.servicer.store.pull("fc", torch.arange(10)).double(),
                                   expected, rtol=0, atol=1e-7)
    finally:
        running.stop(0)


class HeldStore(ShardStore):
    """A store whose pushes wait for ``release`` once they began (``entered``): a request
    still computing when its server stops."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.entered, self.release = threading.Event(), threading.Event()

    def push(self, *args, **kwargs):
        self.entered.set()
        assert self.release.wait(30)
        return super().push(*args, **kwargs)


def test_stop_without_grace_returns_once_the_request_in_the_store_ended():
    """Past its grace a stop cuts the connections, but returns only when the threads serving
    them have left the store: a thread still inside it when the process exits would abort
    the process (torch gives the GIL up there, and taking it back while the interpreter
    finalizes unwinds the thread through C++), so a stopped shard exited with SIGABRT."""
    store = HeldStore()
    running = create_server(store)
    address = f"127.0.0.1:{running.port}"
    try:
        store.create_table(ams.TableSpec("fc", num_rows=10, dim=4, momentum=0.0,
                                         weight_decay=0.0))
        start = store.pull("fc", torch.arange(10)).double()
        busy = Peer(address)
        busy.hello()
        busy.send(frame(PUSH, {**PUSH_META, "lr": 0.5}, [3], grads(1, 4, value=0.25)))
        assert store.entered.wait(10)
        stopper = threading.Thread(target=running.stop, args=(0,))
        stopper.start()
        time.sleep(0.3)
        assert stopper.is_alive()  # the push is still in the store
        store.release.set()
        stopper.join(30)
        assert not stopper.is_alive()
        assert busy.is_closed()
        expected = start.clone()
        expected[3] -= 0.5 * 0.25  # whole: the stop waited for the update's end
        torch.testing.assert_close(store.pull("fc", torch.arange(10)).double(), expected,
                                   rtol=0, atol=1e-7)
    finally:
        store.release.set()
        running.stop(0)


def test_stop_closes_idle_tls_connections(tmp_path):
    """A TLS connection's socket is the wrapped one: stop reaches it and closes it."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    running = create_server(ShardStore(0, 1), tls_cert=cert.read_bytes(),
                            tls_key=key.read_bytes())
    try:
        context = ssl.create_default_context(cadata=cert.read_text())
        raw = socket.create_connection(("127.0.0.1", running.data_plane.port), timeout=10)
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            sock.sendall(frame(HELLO))
            assert HEADER.unpack(sock.recv(HEADER.size))[2] == WELCOME
            sock.recv(1 << 16)  # the rest of the WELCOME
            began = time.monotonic()
            running.stop(30)
            assert time.monotonic() - began < 10  # not held by the idle connection
            assert sock.recv(1) == b""  # closed by the shard, not left open
    finally:
        running.stop(0)


# ---- shared buffers (proto/ams/api/frames.md, "Shared buffers") ----------------------------

SHARED_BYTES = 4 << 20
BIG_N, BIG_D = 40_000, 64  # float32 rows of 256 bytes: 4,096 of them fill 1 MiB
SHARED_MIN = 1 << 20


class Memfd:
    """A sealed memory file as the frames page describes it, made here, and its offer."""

    def __init__(self, size=SHARED_BYTES, seal=True):
        self.fd = os.memfd_create("xcls-data", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, 4096 + size)
        if seal:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        self.nonce = os.urandom(16)
        os.pwrite(self.fd, self.nonce, 0)
        self.offer = {"pid": os.getpid(), "fd": self.fd, "bytes": size, "nonce": self.nonce.hex()}

    def write(self, offset, tensor):
        os.pwrite(self.fd, tensor.contiguous().view(torch.uint8).numpy().tobytes(), 4096 + offset)

    def read(self, offset, n, dim, dtype=torch.float32):
        size = n * dim * torch.empty((), dtype=dtype).element_size()
        return torch.frombuffer(bytearray(os.pread(self.fd, size, 4096 + offset)),
                                dtype=dtype).view(n, dim)

    def close(self):
        os.close(self.fd)


@pytest.fixture
def big(cluster):
    """A fresh float32 table of 256-byte rows on the module's shards, its name, and an
    embedded reference holding the same table."""
    address, client = cluster
    name = f"big{random.randrange(1 << 30)}"
    reference = ams.connect(local_shards=2)
    for c in (client, reference):
        c.create_table(name, num_rows=BIG_N, dim=BIG_D, seed=9)
    yield address, client, name, reference
    reference.close()


def shared_peer(address):
    memfd = Memfd()
    peer = Peer(address)
    assert peer.hello(shared=memfd.offer)["shared"] is True
    return peer, memfd


def test_rows_move_through_the_shared_buffer_the_shard_maps(big):
    """A pull asked into the buffer is answered with the SHARED flag and no row bytes, the
    rows being in the buffer, in order or each at its position; a push whose gradients are
    there applies them as the embedded store applies the same push."""
    address, client, name, reference = big
    peer, memfd = shared_peer(address)
    ids = list(range(0, 2 * 4096, 2))  # shard 0's first 4,096 rows: 1 MiB
    peer.send(frame(PULL, {"table": name, "offset": 64, "bytes": SHARED_MIN}, ids, flags=1))
    kind, meta, _, rows = peer.answer()
    assert (kind, peer.flags, rows, peer.announced) == (ROWS, 1, b"", (4096, BIG_D, F32)), meta
    assert torch.equal(memfd.read(64, 4096, BIG_D), reference.pull(name, torch.tensor(ids)))

    g = torch.randn(4096, BIG_D)
    memfd.write(SHARED_MIN + 64, g)
    peer.send(frame(PUSH, {**PUSH_META, "table": name, "offset": SHARED_MIN + 64}, ids,
                    dtype=F32, dim=BIG_D, num_rows=4096, flags=1))
    assert peer.answer()[:2] == (PUSHED, {"applied": True})
    reference.push(name, torch.tensor(ids), g, 0.1)
    assert torch.equal(client.pull(name, torch.arange(BIG_N)),
                       reference.pull(name, torch.arange(BIG_N)))

    # a few rows, each at its position in a region of 10 rows at an offset of 4 bytes (the
    # float32 rows' own alignment); the rows between them are not written
    memfd.write(4, torch.full((10, BIG_D), -1.0))
    few, positions = [6, 0, 4], [9, 2, 0]
    peer.send(frame(PULL, {"table": name, "offset": 4, "bytes": 10 * BIG_D * 4}, few,
                    flags=3, positions=positions))
    kind, meta, _, rows = peer.answer()
    assert (kind, peer.flags, rows, peer.announced) == (ROWS, 1, b"", (3, BIG_D, F32)), meta
    expected = torch.full((10, BIG_D), -1.0)
    expected[positions] = reference.pull(name, torch.tensor(few))
    assert torch.equal(memfd.read(4, 10, BIG_D), expected)
    peer.close()
    memfd.close()


@pytest.mark.parametrize("name,meta,kind,needle", [
    ("offset-odd", {"offset": 2, "bytes": SHARED_MIN}, PULL, "non-negative multiple of 4"),
    ("offset-negative", {"offset": -64, "bytes": SHARED_MIN}, PULL, "non-negative multiple"),
    ("offset-missing", {"bytes": SHARED_MIN}, PULL, "'offset' is required"),
    ("offset-float", {"offset": 0.0, "bytes": SHARED_MIN}, PULL, "'offset' must be int"),
    ("bytes-missing", {"offset": 0}, PULL, "'bytes' is required"),
    ("region-past-end", {"offset": SHARED_BYTES - SHARED_MIN + 64, "bytes": SHARED_MIN}, PULL,
     "not in the 4194304-byte shared buffer"),
    ("bytes-negative", {"offset": 0, "bytes": -1}, PULL, "not in the"),
    ("bytes-too-few", {"offset": 0, "bytes": SHARED_MIN - 64}, PULL, "do not fit in the"),
    ("position-past-region", {"offset": 0, "bytes": SHARED_MIN, "positions": 4096}, PULL,
     "position 4096 is outside the 4096 rows"),
    ("position-negative", {"offset": 0, "bytes": SHARED_MIN, "positions": -1}, PULL,
     "position -1 is outside"),
    ("push-past-end", {"offset": SHARED_BYTES - 64}, PUSH, "pass the end"),
    ("push-offset-missing", {}, PUSH, "'offset' is required"),
])
def test_shared_requests_the_shard_refuses_change_nothing(big, name, meta, kind, needle):
    address, client, table, reference = big
    peer, memfd = shared_peer(address)
    ids = list(range(0, 2 * 4096, 2))
    memfd.write(0, torch.full((4096, BIG_D), 0.5))
    if kind == PULL and "positions" in meta:  # every row at its place, one of them wrong
        meta = dict(meta)
        positions = list(range(len(ids)))
        positions[len(ids) // 2] = meta.pop("positions")
        peer.send(frame(PULL, {"table": table, **meta}, ids, flags=3, positions=positions))
    elif kind == PULL:
        peer.send(frame(PULL, {"table": table, **meta}, ids, flags=1))
    else:
        peer.send(frame(PUSH, {**PUSH_META, "table": table, **meta}, ids, dtype=F32,
                        dim=BIG_D, num_rows=4096, flags=1))
    answer, reply, _, _ = peer.answer()
    assert (answer, reply["code"]) == (ERROR, "INVALID_ARGUMENT"), reply
    assert needle in reply["message"], reply
    peer.send(frame(PULL, {"table": table}, [0, 2]))  # the connection serves on
    assert peer.answer()[0] == ROWS
    assert torch.equal(client.pull(table, torch.arange(BIG_N)),
                       reference.pull(table, torch.arange(BIG_N)))
    assert torch.equal(memfd.read(0, 4096, BIG_D), torch.full((4096, BIG_D), 0.5))
    peer.close()
    memfd.close()


def test_shared_rows_without_a_granted_buffer_are_refused(big):
    address, client, table, reference = big
    unsealed = Memfd(seal=False)
    for offer in (None, unsealed.offer, {**Memfd().offer, "nonce": "00" * 16}):
        peer = Peer(address)
        welcome = peer.hello(shared=offer)
        assert welcome.get("shared") is (None if offer is None else False)
        peer.send(frame(PUSH, {**PUSH_META, "table": table, "offset": 0}, [0], dtype=F32,
                        dim=BIG_D, num_rows=1, flags=1))
        kind, reply, _, _ = peer.answer()
        assert (kind, reply["code"]) == (ERROR, "INVALID_ARGUMENT")
        assert "this connection has none" in reply["message"]
        peer.close()
    assert torch.equal(client.pull(table, torch.arange(BIG_N)),
                       reference.pull(table, torch.arange(BIG_N)))
    unsealed.close()


@pytest.mark.parametrize("offer", ["yes", {"pid": 1}, {"pid": True, "fd": 3, "bytes": 64,
                                                       "nonce": "00" * 16}])
def test_a_hello_with_a_malformed_offer_is_refused_and_closed(cluster, offer):
    address, _ = cluster
    peer = Peer(address)
    peer.send(frame(HELLO, {"shared": offer}))
    kind, meta, _, _ = peer.answer()
    assert (kind, meta["code"]) == (ERROR, "INVALID_ARGUMENT")
    assert "shared" in meta["message"]
    assert peer.is_closed()
    peer.close()


@pytest.fixture
def shared_views(monkeypatch) -> list[int]:
    """The bytes of each view of a shared buffer this process takes from now on
    (``SharedBuffer.rows``: a push piece's gradients, a staged pull piece's rows)."""
    from ams.dataplane.shm import SharedBuffer

    taken: list[int] = []
    rows_at = SharedBuffer.rows

    def counted(self, offset, dtype, num_rows, dim):
        taken.append(num_rows * dim * dtype.itemsize)
        return rows_at(self, offset, dtype, num_rows, dim)

    monkeypatch.setattr(SharedBuffer, "rows", counted)
    return taken


def test_the_client_moves_large_rows_through_shared_buffers(big, shared_views):
    """``ams.connect`` on the shards' host maps shared buffers; pulls and pushes through them
    (push pieces of 8 MiB, two on the wire, repeated ids) equal the embedded store's, and so
    do a client's with ``shared_memory=False``."""
    address, client, table, reference = big
    tcp = ams.connect(client_addresses(client), shared_memory=False)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        ids = torch.randint(0, BIG_N, (30_000,), generator=gen)
        g = torch.randn(30_000, BIG_D, generator=gen)
        for c in (client, reference):
            c.push(table, ids, g, 0.05, decay_clock=float(step))
    every = torch.randperm(BIG_N, generator=gen)
    expected = reference.pull(table, every)
    assert torch.equal(client.pull(table, every), expected)
    assert torch.equal(tcp.pull(table, every), expected)
    assert tcp.arena is None
    # pieces through the buffer are larger than those that cross the socket
    assert {s.piece_bytes for s in client.shards} == {SHARED_PIECE_BYTES}
    assert {s.piece_bytes for s in tcp.shards} == {PIECE_BYTES}
    # every push piece went through the client's buffer, and all were of 1 MiB or more: 3
    # pushes of about 10,500 rows a shard (one piece of 2.6 MiB); the pulls' rows were written
    # by the shards straight into the result, which lies in the buffer (the tcp client's
    # does not), and its region is the buffer's only one in use until the result is gone
    through_buffer = collections.Counter(n >= SHARED_MIN for n in shared_views)
    assert through_buffer == {True: 3 * 2}, through_buffer
    result = client.pull(table, every)
    assert client.arena.offset_of(result) is not None and tcp.arena is None
    assert client.arena.in_use() == BIG_N * BIG_D * 4
    del result
    assert client.arena.in_use() == 0
    tcp.close()


def client_addresses(client):
    return [shard.address for shard in client.shards]


def test_mutated_shared_frames_get_a_typed_answer_and_the_shard_serves_on(shard_cluster,
                                                                          tmp_path):
    """As the test above, on connections whose shared buffer was granted: pulls asking for
    rows there and pushes whose gradients are there, randomly changed, get rows, a receipt
    or a typed error that is not INTERNAL; the shard serves on, rows finite, no traceback."""
    (proc,) = shard_cluster(1)
    rng = random.Random(11)
    rows_n, dim = 4096, 256  # float32 rows of 1 KiB: 1,024 of them fill 1 MiB
    answers: collections.Counter[str] = collections.Counter()
    with ams.connect([proc.address]) as client:
        client.create_table("fs", num_rows=rows_n, dim=dim, seed=5)
        for _ in range(150):
            memfd = Memfd()
            peer = Peer(proc.address)
            assert peer.hello(shared=memfd.offer)["shared"] is True
            ids = sorted(rng.sample(range(rows_n), rng.choice((1, 30, 1024, 2048))))
            offset = rng.choice((0, 64, SHARED_MIN))
            if rng.random() < 0.5:
                data = frame(PULL, {"table": "fs", "offset": offset,
                                    "bytes": rng.choice((SHARED_MIN, 2 * SHARED_MIN))},
                             ids, flags=1)
            else:
                memfd.write(offset, torch.full((len(ids), dim), rng.uniform(-1e-3, 1e-3)))
                meta = {"table": "fs", "lr": 0.01, "client_id": f"c{rng.randrange(3)}",
                        "sequence": rng.randrange(1 << 20), "offset": offset}
                data = frame(PUSH, meta, ids, dtype=F32, dim=dim, num_rows=len(ids), flags=1)
            answers[typed_answer(peer, _mutated(rng, data))[0]] += 1
            peer.close()
            memfd.close()
        rows = client.pull("fs", torch.arange(rows_n))
    assert answers["error"] > 20 and answers["rows"] + answers["pushed"] > 5, answers
    assert bool(torch.isfinite(rows).all())
    assert_no_traceback(tmp_path)


def test_gradients_rewritten_while_the_shard_applies_them_are_refused_not_internal(
        shard_cluster, tmp_path):
    """A client that rewrites its shared gradients while the shard applies them, one value
    turning nan and back: each push is applied or refused with INVALID_ARGUMENT (a nan seen
    in the update, whatever the later looks see), never INTERNAL; the rows stay finite."""
    (proc,) = shard_cluster(1)
    rows_n, dim = 1024, 256  # 1 MiB of float32 gradients
    with ams.connect([proc.address]) as client:
        client.create_table("fr", num_rows=rows_n, dim=dim, seed=5, momentum=0.0)
    memfd = Memfd()
    peer = Peer(proc.address)
    assert peer.hello(shared=memfd.offer)["shared"] is True
    memfd.write(0, torch.full((rows_n, dim), 1e-3))
    nan, finite = (torch.tensor([v], dtype=torch.float32).numpy().tobytes()
                   for v in (float("nan"), 1e-3))
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            os.pwrite(memfd.fd, nan, 4096)  # the first gradient value
            os.pwrite(memfd.fd, finite, 4096)

    rewriting = threading.Thread(target=rewrite)
    rewriting.start()
    answers: collections.Counter[str] = collections.Counter()
    try:
        for sequence in range(600):
            peer.send(frame(PUSH, {"table": "fr", "lr": 0.01, "client_id": "c",
                                   "sequence": sequence, "offset": 0}, list(range(rows_n)),
                            dtype=F32, dim=dim, num_rows=rows_n, flags=1))
            kind, meta, _, _ = peer.answer()
            answers[meta["code"] if kind == ERROR else "applied"] += 1
    finally:
        stop.set()
        rewriting.join()
    assert set(answers) <= {"applied", "INVALID_ARGUMENT"}, answers
    assert answers["INVALID_ARGUMENT"] > 0, answers  # the rewrites were seen
    peer.close()
    memfd.close()
    with ams.connect([proc.address]) as client:
        assert bool(torch.isfinite(client.pull("fr", torch.arange(rows_n))).all())
    assert_no_traceback(tmp_path)


def test_refused_connections_leave_no_descriptor_or_mapping_behind(shard_cluster, tmp_path,
                                                                   monkeypatch):
    """A client whose HELLO is refused, or whose shard is gone, keeps no memory file or
    mapping beyond its shared buffer's own, and once that is closed, none: this process's
    descriptors and mappings are as before."""
    from ams.dataplane import shm
    from ams.dataplane.connection import DataConnection
    from ams.dataplane.shm import SharedArena

    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    (proc,) = shard_cluster(1, token_file=token_file)
    port = data_port(proc.address, "s3cret")

    def memfds() -> dict[int, tuple[int, int]]:
        """Shared buffers of this process, by inode: (descriptors, mappings). By inode because
        an earlier test's client, collected meanwhile, may close its own buffer."""
        found: dict[int, list[int]] = {}
        for fd in os.listdir("/proc/self/fd"):
            try:
                if "xcls-data" in os.readlink(f"/proc/self/fd/{fd}"):
                    found.setdefault(os.stat(f"/proc/self/fd/{fd}").st_ino, [0, 0])[0] += 1
            except OSError:  # the listing's own descriptor, or one closed meanwhile
                continue
        for line in open("/proc/self/maps").read().splitlines():
            if "xcls-data" in line:
                found.setdefault(int(line.split()[4]), [0, 0])[1] += 1
        return {inode: (fds, maps) for inode, (fds, maps) in found.items()}

    def new_since(before: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
        return {inode: n for inode, n in memfds().items() if inode not in before}

    with socket.socket() as probe:  # a port nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        gone = probe.getsockname()[1]
    before = memfds()
    monkeypatch.setattr(shm, "ARENA_BYTES", 1 << 20)
    arena = SharedArena.create()
    # the offered descriptor, mmap's own, and the mapping
    ours = new_since(before)
    assert list(ours.values()) == [(2, 1)]
    for _ in range(20):
        with pytest.raises(ams.errors.Unauthenticated):
            DataConnection("127.0.0.1", port, token="wrong", tls_ca=None,
                           expect_incarnation=None, timeout=10, arena=arena)
        with pytest.raises(ConnectionRefusedError):
            DataConnection("127.0.0.1", gone, token=None, tls_ca=None,
                           expect_incarnation=None, timeout=10, arena=arena)
    granted = DataConnection("127.0.0.1", port, token="s3cret", tls_ca=None,
                             expect_incarnation=None, timeout=10, arena=arena)
    assert granted.shared is arena
    assert new_since(before) == ours
    granted.close()
    arena.close()
    assert new_since(before) == {}


@pytest.mark.parametrize("setting,mapped", [(None, True), ("false", False)])
def test_the_trainers_client_follows_ams_shared_memory(cluster, tmp_path, setting, mapped):
    from xcls.config import load_config
    from xcls.run import connect_ams

    _, client = cluster
    overrides = [f"ams.addresses={client_addresses(client)!r}"]  # both shards, in order
    if setting is not None:
        overrides.append(f"ams.shared_memory={setting}")
    trainer_client = connect_ams(load_config(None, overrides), tmp_path, None)
    trainer_client.pull("fc", torch.arange(8))
    # pieces through a mapped buffer are larger than those that cross the socket
    want = SHARED_PIECE_BYTES if mapped else PIECE_BYTES
    assert {shard.piece_bytes for shard in trainer_client.shards} == {want}
    assert (trainer_client.arena is not None) is mapped
    trainer_client.close()


def test_a_lost_connection_never_gives_back_the_regions_it_may_still_write(big, monkeypatch):
    """A pull into a result's region whose connection is closed before its answer came: the
    shard may write the region after the client dropped the result, so the region is never
    handed out again; a region whose answer came is."""
    from ams.dataplane import shm
    from ams.dataplane.connection import DataConnection
    from ams.dataplane.shm import SharedArena
    from ams.wire.frames import Kind

    address, _, table, reference = big
    monkeypatch.setattr(shm, "ARENA_BYTES", 8 << 20)
    arena = SharedArena.create()
    conn = DataConnection("127.0.0.1", data_port(address), token=None, tls_ca=None,
                          expect_incarnation=None, timeout=10, arena=arena)
    assert conn.shared is arena
    ids = torch.arange(0, 2 * 4096, 2)  # shard 0's: 1 MiB of rows
    answered = arena.result(4096, BIG_D, torch.float32)
    conn.pull(table, [ids], (answered, None), 2, time.monotonic() + 30)
    assert torch.equal(answered, reference.pull(table, ids))
    lost = arena.result(4096, BIG_D, torch.float32)
    where = arena.offset_of(lost)
    conn.send(Kind.PULL, {"table": table, "offset": where, "bytes": 4096 * BIG_D * 4},
               ids=ids, region=where)
    conn.close()  # before the answer
    del answered, lost
    assert arena.in_use() == 4096 * BIG_D * 4  # the lost one's region only
    arena.close()



def cut_data_connections(port: int) -> int:
    """Shut down, for sending, this process's connections to data port ``port`` (found by their
    descriptors): the next request on each cannot be sent. Returns how many there were."""
    cut = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            with socket.socket(fileno=os.dup(int(fd))) as sock:
                if sock.type == socket.SOCK_STREAM and sock.getpeername()[1] == port:
                    sock.shutdown(socket.SHUT_WR)  # the connection's, not just this descriptor's
                    cut += 1
        except OSError:  # not a connected socket, or closed meanwhile
            continue
    return cut


def check_a_retried_pull(client, reference, table, ids):
    assert torch.equal(client.pull(table, ids), reference.pull(table, ids))
    assert cut_data_connections(client.stats()[0]["data_port"]) >= 1
    before = client.arena.in_use()
    got = client.pull(table, ids)
    assert torch.equal(got, reference.pull(table, ids))
    assert client.arena.offset_of(got) is None  # the process's own memory
    # the first try's result region is never reused; the next pull takes another one
    assert client.arena.in_use() - before == ids.numel() * BIG_D * 4
    fresh = client.pull(table, ids)
    assert client.arena.offset_of(fresh) is not None and torch.equal(fresh, got)


def test_a_pull_retried_after_a_lost_connection_returns_rows_no_shard_still_writes(big):
    """A pull whose pooled connection is found broken is retried on a new one. The broken
    connection's shard may yet write the region it was asked to fill, so the rows the caller
    gets must not lie there: they equal the embedded store's and are the process's own
    memory. Two shards, each writing its rows at their positions in the result."""
    _, client, table, reference = big
    ids = torch.randperm(BIG_N, generator=torch.Generator().manual_seed(4))[:16_384]
    check_a_retried_pull(client, reference, table, ids)


def test_a_one_shard_pull_retried_after_a_lost_connection(shard_cluster):
    """As above with one shard, whose rows fill the result in order, piece by piece."""
    (proc,) = shard_cluster(1)
    with ams.connect([proc.address]) as client, ams.connect(local_shards=1) as reference:
        for c in (client, reference):
            c.create_table("r", num_rows=BIG_N, dim=BIG_D, seed=9)
        check_a_retried_pull(client, reference, "r", torch.arange(3, 16_387))


@pytest.mark.parametrize("free_bytes,staged", [(8 << 20, True), (0, False)])
def test_a_pull_whose_result_does_not_fit_the_buffer(big, shared_views, free_bytes, staged):
    """A result larger than the shared buffer's free room is the process's own memory. Its
    pieces are written to regions of their own where there is room for them, and copied to
    their places from there; where there is none they come in the frames. Either way the
    rows equal the embedded store's, and every region is given back."""
    _, module_client, table, reference = big
    with ams.connect(client_addresses(module_client)) as client:
        for shard in client.shards:  # 3 pieces a shard, 2 on the wire: 6.5 MiB of regions
            shard.piece_bytes = 2 << 20
        arena = client.arena
        held = arena.allocate(arena.capacity - free_bytes)
        assert held is not None
        every = torch.randperm(BIG_N, generator=torch.Generator().manual_seed(6))
        got = client.pull(table, every)
        assert arena.offset_of(got) is None
        assert torch.equal(got, reference.pull(table, every))
        # 20,000 rows of 256 bytes a shard: 3 pieces of 1.6 MiB each
        through_buffer = collections.Counter(shared_views)
        assert sum(through_buffer.values()) == (6 if staged else 0), through_buffer
        assert arena.in_use() == arena.capacity - free_bytes


def test_a_data_connection_that_cannot_be_opened_at_first_contact_waits_for_the_first_call(
        cluster, monkeypatch):
    """``ams.connect`` opens each shard's first data connection (which sizes the pieces);
    where the data port refuses it, nothing is raised then, and the first call asks the
    shard for its port again and is answered."""
    from ams.client.remote import RemoteShard
    from ams.dataplane import shm
    from ams.dataplane.shm import SharedArena

    address, client = cluster
    monkeypatch.setattr(shm, "ARENA_BYTES", 8 << 20)
    arena = SharedArena.create()
    shard = RemoteShard(address, arena=arena)
    shard.learn_incarnation()
    with socket.socket() as probe:  # a port nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        shard.data_port = probe.getsockname()[1]
    shard.open_data_connection()
    assert shard.piece_bytes == PIECE_BYTES
    ids = torch.arange(0, 2 * 100, 2)  # shard 0's
    out = torch.empty(100, D)
    shard.pull("fc", [ids], (out, None))
    assert torch.equal(out, client.pull("fc", ids))
    assert shard.piece_bytes == SHARED_PIECE_BYTES
    shard.close()
    arena.close()


def test_a_pull_waits_for_a_slow_shard_until_its_deadline(stopped_for):
    """The connection's socket gives up a receive after the timeout it was opened with
    (about 1 s); a call whose deadline is later waits on for the rest of it."""
    from ams.dataplane.connection import DataConnection

    address, stop = stopped_for
    with ams.connect([address]) as client:
        spec = client.spec("fc")
    reference = ShardStore()
    reference.create_table(spec)
    conn = DataConnection("127.0.0.1", data_port(address), token=None, tls_ca=None,
                          expect_incarnation=None, timeout=1.0)
    ids, out = torch.tensor([5, 0, 9]), torch.empty(3, D)
    stop(1.5)
    started = time.monotonic()
    conn.pull("fc", [ids], (out, None), 2, started + 1.8)
    assert time.monotonic() - started >= 1.4
    assert torch.equal(out, reference.pull("fc", ids))
    conn.close()


def test_a_call_past_its_deadline_is_deadline_exceeded(stopped_for):
    from ams.dataplane.connection import DataConnection

    address, stop = stopped_for
    conn = DataConnection("127.0.0.1", data_port(address), token=None, tls_ca=None,
                          expect_incarnation=None, timeout=10)
    stop(1.5)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        conn.pull("fc", [torch.tensor([1])], (torch.empty(1, D), None), 2, started + 0.8)
    assert 0.7 <= time.monotonic() - started < 3.0
    conn.close()

    with ams.connect([address], timeout=1.0) as client:
        client.pull("fc", torch.tensor([1]))  # its data connection is open and pooled
        stop(4.0)
        started = time.monotonic()
        with pytest.raises(ams.errors.AmsError) as raised:
            client.pull("fc", torch.tensor([1]))
        assert raised.value.code == "DEADLINE_EXCEEDED"
        assert 0.9 <= time.monotonic() - started < 3.0
