"""The bridge's Redis transactions when Redis applies one but its reply comes too late.

redis-py reports a socket timeout inside a watched transaction as WatchError, the error of a
transaction that was not applied. A TCP proxy between the bridge and a real redis-server holds
the reply to one EXEC past the client's socket timeout (a busy Redis, a network stall): the
transaction is applied, the bridge hears "not applied".
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import redis
import torch

from bridge.codec import decode_grad_entry
from bridge.redis_accumulator import RedisGradientAccumulator, stream_key
from bridge.redis_util import make_client
from bridge.weight_store import WeightStore


class LateReplyProxy:
    """Forwards 127.0.0.1 connections to ``port``; once :meth:`hold_next_exec_reply` is called,
    the answer to the next EXEC reaches the client ``delay_s`` late."""

    def __init__(self, port: int, delay_s: float) -> None:
        self.upstream, self.delay_s = port, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._armed = threading.Event()
        self.held = threading.Event()  # an EXEC's reply was held
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def hold_next_exec_reply(self) -> None:
        self.held.clear()
        self._armed.set()

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
                if to_server and b"EXEC" in data and self._armed.is_set():
                    self._armed.clear()
                    exec_sent.set()
                elif not to_server and exec_sent.is_set():
                    exec_sent.clear()
                    time.sleep(self.delay_s)  # applied by Redis; the client has given up
                    self.held.set()
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
def late(redis_server):
    proxy = LateReplyProxy(redis_server.port, delay_s=0.8)  # the bridge's timeout: 0.5 s
    yield proxy
    proxy.close()


def test_a_gradient_whose_add_is_answered_late_is_added_once(redis_server, late):
    dim, prefix = 4, "late-add"
    direct = redis.Redis(host=redis_server.host, port=redis_server.port)
    acc = RedisGradientAccumulator(make_client(redis_server.host, late.port), dim, m=3,
                                   prefix=prefix)
    acc.add(np.array([5]), np.full((1, dim), 1.0), version=0)
    late.hold_next_exec_reply()
    acc.add(np.array([5]), np.full((1, dim), 10.0), version=0)
    assert late.held.wait(5)
    assert direct.xlen(stream_key(prefix)) == 0  # two of m = 3 gradients: no mean yet
    assert acc.add(np.array([5]), np.full((1, dim), 100.0), version=0) == 1
    [(_, fields)] = direct.xrange(stream_key(prefix))
    entry = decode_grad_entry(fields, dim)
    assert entry.count == 3 and np.allclose(entry.grad, 37.0)  # (1 + 10 + 100) / 3


def test_a_publication_answered_late_is_reported_published(redis_server, late):
    store = WeightStore(make_client(redis_server.host, late.port), "late-publish")
    model = torch.nn.Linear(2, 2)
    late.hold_next_exec_reply()
    assert store.publish(model, 5, replaces=-1)
    assert late.held.wait(5)
    assert WeightStore(make_client(redis_server.host, redis_server.port),
                       "late-publish").published_version() == 5
