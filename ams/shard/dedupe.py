"""The push dedupe state of a table: which (client id, sequence) pairs it applied, so that a
retried push applies once. Kept with the rows in snapshots and in a closed mmap table's
``table.json``."""

from __future__ import annotations

from collections import OrderedDict

from ams.errors import InvalidArgument, shorten

# Per-client memory of applied push sequences. A retry arrives within a deadline or two, so a
# window of recent sequences per client is enough to apply each push once.
PUSH_DEDUPE_WINDOW = 4096
# Clients whose pushes a table remembers; the one that pushed least recently goes first. A
# client forgotten this way stopped pushing long before any retry of its could arrive.
PUSH_DEDUPE_CLIENTS = 1024
MAX_CLIENT_ID = 128
MAX_SEQUENCE = 2**64  # the wire field is uint64


class PushDedupe:
    """The (client id, sequence) pairs of the pushes a table applied, so that a retried push
    applies once.

    Bounded: the newest ``PUSH_DEDUPE_WINDOW`` sequences of each client, and the
    ``PUSH_DEDUPE_CLIENTS`` clients that pushed most recently (least recent forgotten first).
    Not thread-safe: its table's lock guards it, so it always agrees with the table's rows.
    """

    def __init__(self) -> None:
        self._clients: OrderedDict[str, OrderedDict[int, None]] = OrderedDict()

    def __contains__(self, key: tuple[str, int]) -> bool:
        client_id, sequence = key
        return sequence in self._clients.get(client_id, ())

    def add(self, client_id: str, sequence: int) -> None:
        seen = self._clients.setdefault(client_id, OrderedDict())
        self._clients.move_to_end(client_id)
        seen[sequence] = None
        if len(seen) > PUSH_DEDUPE_WINDOW:
            seen.popitem(last=False)
        if len(self._clients) > PUSH_DEDUPE_CLIENTS:
            self._clients.popitem(last=False)

    def merge(self, other: PushDedupe) -> None:
        """Add ``other``'s pairs (a table restored from several pieces holds all of them)."""
        for client_id, sequences in other._clients.items():
            for sequence in sequences:
                self.add(client_id, sequence)

    def to_json(self) -> list:
        """JSON-able form: [[client id, [sequence, ...]], ...], least recent first."""
        return [[client_id, list(seen)] for client_id, seen in self._clients.items()]

    @classmethod
    def from_json(cls, data: object) -> PushDedupe:
        """Inverse of ``to_json``; ``InvalidArgument`` for anything malformed."""
        out = cls()
        if not isinstance(data, list):
            raise InvalidArgument(f"push dedupe state: need a list, got {type(data).__name__}")
        for item in data:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], list)):
                raise InvalidArgument(f"push dedupe state: malformed entry {shorten(item)}")
            check_client(item[0], 0)
            for sequence in item[1]:
                check_client(item[0], sequence)
                out.add(item[0], sequence)
        return out


def check_client(client_id: object, sequence: object) -> None:
    """A push's (client id, sequence): a string of at most ``MAX_CLIENT_ID`` characters and
    an integer in [0, 2**64), else ``InvalidArgument``."""
    if not isinstance(client_id, str) or len(client_id) > MAX_CLIENT_ID:
        raise InvalidArgument(f"client_id {shorten(client_id)}: need a string of at most "
                              f"{MAX_CLIENT_ID} characters")
    if isinstance(sequence, bool) or not isinstance(sequence, int) \
            or not 0 <= sequence < MAX_SEQUENCE:
        raise InvalidArgument(f"sequence={shorten(sequence)} must be an integer in [0, 2**64)")
