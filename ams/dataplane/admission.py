"""What a shard's data port lets its peers hold: connection places and request bytes.

A connection is a stranger until its HELLO is accepted (``ams.dataplane.server``), and anyone
who can reach the port can open one. So strangers have places of their own, apart from the
greeted connections': at most ``MAX_STRANGERS`` in all and ``MAX_STRANGERS_PER_PEER`` from one
address. A stranger that arrives past either cap takes the place of the oldest stranger (of
its address, or of all): a client that holds the token greets within a round trip, while
sockets that never send a HELLO grow old, so they are the ones that go, and the greeted
connections are never touched. The server also closes every stranger that has not greeted
within ``HELLO_TIMEOUT_S``.

The bodies of greeted requests are received into tensors; ``BodyBudget`` caps the bytes
held so at once, whatever the number of connections and however slowly each body arrives.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from ams.errors import Unavailable

# Greeted connections a shard serves at once.
MAX_GREETED = 256
# Connections that have not greeted yet, in all and from one peer address. A client's
# handshake takes a round trip, so even a host of many workers opening connections together
# seldom has more than a few in the middle of one.
MAX_STRANGERS = 128
MAX_STRANGERS_PER_PEER = 32
# Seconds a connection has from its accept to an accepted HELLO (the TLS handshake included).
HELLO_TIMEOUT_S = 5.0
# Bytes of request ids and gradients one shard holds at once while they arrive and are
# applied, and of answers' ids and rows while they are sent: four bodies of the largest
# size a frame may have (``frames.MAX_BODY_BYTES``); the client's pieces are a hundredth of
# that (``ams.limits.PIECE_BYTES``).
MAX_BODY_BYTES_HELD = 1 << 30

Key = TypeVar("Key")


class Admission(Generic[Key]):
    """The data port's connections, each a ``Key``, as strangers (oldest first) or greeted.
    Not thread-safe: the server calls it under its own lock."""

    def __init__(self) -> None:
        self._strangers: dict[Key, str] = {}  # key -> peer address, in order of arrival
        self._greeted: set[Key] = set()

    def arrive(self, key: Key, peer: str) -> list[Key]:
        """Admit a new connection from address ``peer`` as a stranger; the strangers it
        evicts (no longer counted here: the caller closes them)."""
        evicted = []
        same_peer = [k for k, p in self._strangers.items() if p == peer]
        if len(same_peer) >= MAX_STRANGERS_PER_PEER:
            evicted.append(same_peer[0])
        elif len(self._strangers) >= MAX_STRANGERS:
            evicted.append(next(iter(self._strangers)))
        for k in evicted:
            del self._strangers[k]
        self._strangers[key] = peer
        return evicted

    def greet(self, key: Key) -> bool:
        """Count stranger ``key`` as greeted now; False when it was evicted meanwhile or
        every greeted place is taken (it stays counted nowhere: the caller closes it).
        A connection that greets again keeps its place."""
        if key in self._greeted:
            return True
        if self._strangers.pop(key, None) is None or len(self._greeted) >= MAX_GREETED:
            return False
        self._greeted.add(key)
        return True

    def leave(self, key: Key) -> None:
        """Forget ``key`` (its connection closed)."""
        self._strangers.pop(key, None)
        self._greeted.discard(key)


class BodyBudget:
    """Bytes of requests and answers held at once, up to ``MAX_BODY_BYTES_HELD``.
    Thread-safe."""

    def __init__(self) -> None:
        self._held = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> int:
        """Hold ``nbytes`` more, until ``give_back``; returns them. ``Unavailable``, holding
        nothing, when they would pass the limit: the shard is busy now, and a client retries
        after a pause (its pieces are far below the limit, so only load fills it)."""
        with self._lock:
            if self._held + nbytes > MAX_BODY_BYTES_HELD:
                raise Unavailable(
                    f"data plane: {self._held} bytes of request bodies and answers are "
                    f"being received, applied or sent, and {nbytes} more would pass the "
                    f"shard's {MAX_BODY_BYTES_HELD}-byte limit; retry, or send smaller requests or "
                    "fewer at once")
            self._held += nbytes
        return nbytes

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes
