"""The scheduler's state: who holds a lease, the shard map, and the generation. Pure: time is
passed in as monotonic milliseconds, so every rule is testable without a clock or a network.

A member (a shard or a training worker) registers for a slot and renews its lease within the
TTL; a lease not renewed in time expires. The **generation** counts the events after which a
worker's view of the cluster is stale and training must roll back to its newest checkpoint:

* a shard's lease expires (a dead or hung shard) or a shard releases it (a shard leaving);
* a shard slot is registered by a different incarnation than the one that last held it (a
  restarted shard, whose rows are not the ones the workers trained against);
* a worker's lease expires (a hung worker stalls every collective of the job).

A worker registering or releasing changes nothing: a job restarted by torchrun re-registers
every rank. A lease that expired, was released or was replaced is gone for good: renewing it
answers EXPIRED and its incarnation may not register again, so a member the cluster gave up on
stays fenced off. Lease ids carry the issuing table's instance id, so a member can tell "this
scheduler gave up on me" (EXPIRED) from "this scheduler never knew me" (UNKNOWN: it restarted,
and the member registers again, as a *rejoin*).

A restarted scheduler has forgotten whom it gave up on, so a rejoin never displaces another
incarnation: a shard cut off from the cluster long enough to be replaced, whose link comes
back only after the scheduler restarted, finds its replacement in the slot and is refused,
rather than taking the slot back with rows the workers have not trained against. (Should it
rejoin first, its replacement is refused and exits; restarted as a new process, it registers
afresh and displaces the old one, and the workers, which check the incarnations after a
scheduler restart, roll back.)

    table = LeaseTable(num_shards=2, ttl_ms=10_000)
    grant = table.register(Role.SHARD, 0, "10.0.0.5:7001", "a1b2", now_ms=0)
    table.renew(grant.lease_id, now_ms=4_000)       # Renewal(ALIVE, generation=0)
    table.expire_due(now_ms=20_000)                  # [the lease]; generation is now 1
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from enum import StrEnum

from ams.addresses import parse_address
from ams.errors import FailedPrecondition, InvalidArgument

MAX_ADDRESS_CHARS = 255
MAX_INCARNATION_CHARS = 64
MAX_LEASE_ID_CHARS = 128
# Worker slots are global ranks; the bound keeps a bad request from growing the table.
MAX_WORKER_SLOTS = 1 << 20
# Every shard map lists every slot: a mistyped count must not make each answer that long.
MAX_SHARD_SLOTS = 1 << 20


class Role(StrEnum):
    """What a lease holder is."""

    SHARD = "shard"  # a model-server shard; slot = its shard index, address = where it serves
    WORKER = "worker"  # a training worker; slot = its global rank, address = informational


class LeaseStatus(StrEnum):
    """The answer to a renewal."""

    ALIVE = "alive"  # renewed for another TTL
    EXPIRED = "expired"  # this table issued it and gave up on it (expired, released, replaced)
    UNKNOWN = "unknown"  # another table issued it: the scheduler restarted, register again


@dataclass
class Lease:
    """One member's lease; ``deadline_ms``: when it expires unless renewed."""

    lease_id: str
    role: Role
    slot: int
    address: str
    incarnation: str
    deadline_ms: int


@dataclass(frozen=True)
class Grant:
    """A registration's answer: the lease to renew every ``ttl_ms`` / 3 or so, and the
    generation at registration."""

    lease_id: str
    ttl_ms: int
    generation: int


@dataclass(frozen=True)
class Renewal:
    status: LeaseStatus
    generation: int


@dataclass(frozen=True)
class ShardMap:
    """The shards as the scheduler sees them: ``addresses[i]`` and ``incarnations[i]`` of shard
    i, "" for a slot nobody holds; ``generation`` of this view."""

    num_shards: int
    addresses: tuple[str, ...]
    incarnations: tuple[str, ...]
    generation: int

    @property
    def complete(self) -> bool:
        """Every slot is held: the addresses are usable as a client's shard list."""
        return all(self.addresses)

    def missing(self) -> list[int]:
        """The slots nobody holds."""
        return [s for s, a in enumerate(self.addresses) if not a]


def _check_text(value: object, what: str, limit: int) -> str:
    """``value`` as a non-empty printable string of at most ``limit`` characters."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{what}: need a non-empty string")
    if len(value) > limit:
        raise InvalidArgument(f"{what}: {len(value)} characters, at most {limit} allowed")
    if not value.isprintable() or any(c.isspace() for c in value):
        raise InvalidArgument(f"{what}: {value[:80]!r} has whitespace or unprintable characters")
    return value


class LeaseTable:
    """Leases of the members of one job with ``num_shards`` shards, each valid ``ttl_ms``
    after its last renewal. Not thread-safe: the scheduler serializes calls. ``instance``:
    this table's random id, which leads every lease id it issues."""

    def __init__(self, num_shards: int, ttl_ms: int) -> None:
        if not isinstance(num_shards, int) or not 1 <= num_shards <= MAX_SHARD_SLOTS:
            raise InvalidArgument(f"num_shards={num_shards!r} must be an integer in "
                                  f"1..{MAX_SHARD_SLOTS}")
        if not isinstance(ttl_ms, int) or ttl_ms < 1:
            raise InvalidArgument(f"ttl_ms={ttl_ms!r} must be an integer >= 1")
        self.num_shards = num_shards
        self.ttl_ms = ttl_ms
        self.instance = uuid.uuid4().hex[:16]
        self.generation = 0
        self._issued = 0
        self._leases: dict[str, Lease] = {}
        self._holder: dict[tuple[Role, int], str] = {}  # (role, slot) -> lease id
        # The incarnation that last held each shard slot, kept after it is gone, so a new one
        # taking the slot is told apart from the first fill.
        self._last_shard: dict[int, str] = {}
        # Incarnations the table gave up on; one entry per lost member, so it grows with
        # failures only.
        self._dead: set[str] = set()

    # ---- members ----------------------------------------------------------------------

    def register(self, role: Role | str, slot: int, address: str, incarnation: str,
                 now_ms: int, rejoin: bool = False) -> Grant:
        """Take ``slot`` of ``role`` for this incarnation; the slot's previous holder, if any,
        loses its lease. The same incarnation registering again keeps its lease (a retried
        call). FailedPrecondition for an incarnation this table already gave up on, and for a
        ``rejoin`` (a member whose earlier scheduler restarted) to a slot another incarnation
        holds."""
        role = self._check_role(role)
        self._check_slot(role, slot)
        address = _check_text(address, "address", MAX_ADDRESS_CHARS)
        if role is Role.SHARD:
            parse_address(address)  # workers dial it
        incarnation = _check_text(incarnation, "incarnation", MAX_INCARNATION_CHARS)
        self.expire_due(now_ms)
        if incarnation in self._dead:
            raise FailedPrecondition(f"incarnation {incarnation} was declared dead; a new "
                                     "process (a new incarnation) must take its place")
        held = self._leases.get(self._holder.get((role, slot), ""))
        if held is not None and held.incarnation == incarnation:
            held.address, held.deadline_ms = address, now_ms + self.ttl_ms
            return Grant(held.lease_id, self.ttl_ms, self.generation)
        if held is not None and rejoin:
            raise FailedPrecondition(
                f"{role} {slot}: incarnation {incarnation} rejoins after a scheduler restart, "
                f"but incarnation {held.incarnation} holds the slot: it was replaced")
        if held is not None:  # a new process took the slot: the old one must not return
            self._drop(held)
            self._dead.add(held.incarnation)
        if role is Role.SHARD:
            if self._last_shard.get(slot, incarnation) != incarnation:
                self.generation += 1
            self._last_shard[slot] = incarnation
        self._issued += 1
        lease = Lease(f"{self.instance}-{self._issued}", role, slot, address, incarnation,
                      now_ms + self.ttl_ms)
        self._leases[lease.lease_id] = lease
        self._holder[(role, slot)] = lease.lease_id
        return Grant(lease.lease_id, self.ttl_ms, self.generation)

    def renew(self, lease_id: str, now_ms: int) -> Renewal:
        """Extend a live lease by the TTL; EXPIRED for one this table gave up on (a lease past
        its deadline expires here, whether or not ``expire_due`` ran), UNKNOWN for one another
        table issued."""
        lease_id = _check_text(lease_id, "lease_id", MAX_LEASE_ID_CHARS)
        self.expire_due(now_ms)
        lease = self._leases.get(lease_id)
        if lease is not None:
            lease.deadline_ms = now_ms + self.ttl_ms
            return Renewal(LeaseStatus.ALIVE, self.generation)
        status = LeaseStatus.EXPIRED if self._issued_here(lease_id) else LeaseStatus.UNKNOWN
        return Renewal(status, self.generation)

    def release(self, lease_id: str, now_ms: int) -> Lease | None:
        """Give a lease up (a member leaving cleanly); the lease, or None if it was gone. A
        shard leaving counts as a lost shard; a worker leaving changes nothing."""
        lease_id = _check_text(lease_id, "lease_id", MAX_LEASE_ID_CHARS)
        self.expire_due(now_ms)
        lease = self._leases.get(lease_id)
        if lease is None:
            return None
        self._drop(lease)
        self._dead.add(lease.incarnation)
        if lease.role is Role.SHARD:
            self.generation += 1
        return lease

    def expire_due(self, now_ms: int) -> list[Lease]:
        """Expire every lease whose deadline is at or before ``now_ms``; the expired leases.
        Each one moves the generation on (a lost shard, or a hung worker)."""
        due = [lease for lease in self._leases.values() if lease.deadline_ms <= now_ms]
        for lease in due:
            self._drop(lease)
            self._dead.add(lease.incarnation)
            self.generation += 1
        return due

    # ---- views ------------------------------------------------------------------------

    def shard_map(self) -> ShardMap:
        """Who holds each shard slot now (call ``expire_due`` first for a current view)."""
        held = [self._leases.get(self._holder.get((Role.SHARD, s), ""))
                for s in range(self.num_shards)]
        return ShardMap(self.num_shards,
                        tuple(lease.address if lease else "" for lease in held),
                        tuple(lease.incarnation if lease else "" for lease in held),
                        self.generation)

    def leases(self) -> list[Lease]:
        """The live leases."""
        return list(self._leases.values())

    # ---- helpers ----------------------------------------------------------------------

    def _drop(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        if self._holder.get((lease.role, lease.slot)) == lease.lease_id:
            del self._holder[(lease.role, lease.slot)]

    def _issued_here(self, lease_id: str) -> bool:
        prefix, sep, number = lease_id.rpartition("-")
        return prefix == self.instance and number.isdigit() and 0 < int(number) <= self._issued

    @staticmethod
    def _check_role(role: Role | str) -> Role:
        try:
            return Role(role)
        except ValueError:
            raise InvalidArgument(f"role {str(role)[:80]!r}: expected one of "
                                  f"{', '.join(r.value for r in Role)}") from None

    def _check_slot(self, role: Role, slot: int) -> None:
        limit = self.num_shards if role is Role.SHARD else MAX_WORKER_SLOTS
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < limit:
            raise InvalidArgument(f"slot {slot!r} of a {role.value}: expected an integer in "
                                  f"0..{limit - 1}")
