"""The bridge's Redis transactions when Redis applies one but its answer comes too late, or
when its EXEC itself is held up past the client's timeout.

redis-py reports a socket timeout inside a watched transaction as WatchError, the error of a
transaction that was not applied. A TCP proxy between the bridge and a real redis-server holds
the answer to one EXEC, or the EXEC itself, past the client's socket timeout (a busy Redis, a
network stall), and can stall the connections opened after it.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import redis
import torch

from bridge import redis_util
from bridge.codec import decode_grad_entry, decode_record
from bridge.redis_accumulator import RedisGradientAccumulator, stream_key
from bridge.redis_util import make_client
from bridge.weight_store import WeightStore

HELD_S = 0.8  # past the bridge's 0.5 s socket timeout


class StallingProxy:
    """Forwards 127.0.0.1 connections to ``port``. ``hold_next_exec`` holds the next EXEC's
    answer (``what="answer"``: Redis applies it, the client hears of it too late) or the EXEC
    itself (``"request"``: Redis gets it after the client gave up) for ``HELD_S``, and then
    (``then_stall``) every request sent in the next seconds after that EXEC."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._hold: str | None = None
        self._stalled_until = 0.0
        self._then_stall = 0.0
        self.released = threading.Event()  # the held answer or request went on
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def hold_next_exec(self, what: str, then_stall: float = 0.0) -> None:
        self.released.clear()
        self._then_stall = then_stall
        self._hold = what

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self._sockets += [client, server]
            exec_sent = threading.Event()
            threading.Thread(target=self._forward, args=(client, server, exec_sent, True),
                             daemon=True).start()
            threading.Thread(target=self._forward, args=(server, client, exec_sent, False),
                             daemon=True).start()

    def _forward(self, src: socket.socket, dst: socket.socket, exec_sent: threading.Event,
                 to_server: bool) -> None:
        try:
            while data := src.recv(65536):
                if to_server:
                    time.sleep(max(0.0, self._stalled_until - time.monotonic()))
                    if b"EXEC" in data and self._hold == "request":
                        self._hold = None
                        time.sleep(HELD_S)
                        self.released.set()
                    elif b"EXEC" in data and self._hold == "answer":
                        self._hold = None
                        exec_sent.set()
                        self._stalled_until = time.monotonic() + self._then_stall
                elif exec_sent.is_set():
                    exec_sent.clear()
                    time.sleep(HELD_S)  # applied by Redis; the client has given up
                    self.released.set()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.listener.close()
        for s in self._sockets:
            s.close()


@pytest.fixture
def proxy(redis_server):
    proxy = StallingProxy(redis_server.port)
    yield proxy
    proxy.close()


def mean_of(direct: redis.Redis, prefix: str, dim: int):
    [(_, fields)] = direct.xrange(stream_key(prefix))
    return decode_grad_entry(fields, dim)


def test_a_gradient_whose_add_is_answered_late_is_added_once(redis_server, proxy):
    dim, prefix = 4, "late-add"
    direct = redis.Redis(host=redis_server.host, port=redis_server.port)
    acc = RedisGradientAccumulator(make_client(redis_server.host, proxy.port), dim, m=3,
                                   prefix=prefix)
    acc.add(np.array([5]), np.full((1, dim), 1.0), version=0)
    proxy.hold_next_exec("answer")
    acc.add(np.array([5]), np.full((1, dim), 10.0), version=0)
    assert proxy.released.wait(5)
    assert direct.xlen(stream_key(prefix)) == 0  # two of m = 3 gradients: no mean yet
    assert acc.add(np.array([5]), np.full((1, dim), 100.0), version=0) == 1
    entry = mean_of(direct, prefix, dim)
    assert entry.count == 3 and np.allclose(entry.grad, 37.0)  # (1 + 10 + 100) / 3


def test_an_add_redis_may_have_applied_is_not_also_kept_in_the_fallback(redis_server, proxy,
                                                                         monkeypatch):
    """The answer lost, then Redis silent for the retry that would read the add's token: the
    fallback's copy would reach Redis beside the applied one once it answers again."""
    monkeypatch.setattr(redis_util, "RETRY_AFTER_S", 0.0)
    dim, prefix = 4, "late-add-outage"
    direct = redis.Redis(host=redis_server.host, port=redis_server.port)
    acc = RedisGradientAccumulator(make_client(redis_server.host, proxy.port), dim, m=3,
                                   prefix=prefix)
    assert acc.fallback is not None
    acc.add(np.array([5]), np.full((1, dim), 1.0), version=0)
    # the retry's WATCH times out, twice with redis-py's own retry
    proxy.hold_next_exec("answer", then_stall=3.0)
    acc.add(np.array([5]), np.full((1, dim), 10.0), version=0)
    time.sleep(3.2 - HELD_S)
    # Redis answers again: an add to another sample ends the outage (moving what the
    # fallback took to Redis), then the third gradient of sample 5 completes its mean
    acc.add(np.array([6]), np.full((1, dim), 0.5), version=0)
    assert acc.add(np.array([5]), np.full((1, dim), 100.0), version=0) == 1
    entry = mean_of(direct, prefix, dim)
    assert entry.count == 3 and np.allclose(entry.grad, 37.0)
    # and sample 5 holds nothing more: the fallback's copy of 10 did not reach its window
    record = decode_record(direct.get(acc.record_key(5)), dim)
    assert record.count == 0, record


@pytest.mark.parametrize("held", ["answer", "request"])
def test_a_publication_says_whether_it_landed(redis_server, proxy, held):
    """Its answer held (it landed) or its EXEC held until the client gave up (it may land
    after the answer unless that answer fenced it off): True exactly when version 5 is the
    published one once nothing is held anymore."""
    store = WeightStore(make_client(redis_server.host, proxy.port), f"late-publish-{held}")
    model = torch.nn.Linear(2, 2)
    proxy.hold_next_exec(held)
    landed = store.publish(model, 5, replaces=-1)
    assert proxy.released.wait(5)
    time.sleep(0.2)  # a held EXEC reaches Redis
    published = WeightStore(make_client(redis_server.host, redis_server.port),
                            f"late-publish-{held}").published_version()
    assert landed == (published == 5), (landed, published)
    if held == "answer":
        assert landed
