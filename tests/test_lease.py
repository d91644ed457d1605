"""The scheduler's lease rules (ams.cluster.lease), on a table driven by hand-set
millisecond clocks."""

from __future__ import annotations

import pytest

from ams.addresses import parse_address
from ams.cluster.lease import (
    MAX_WORKER_SLOTS,
    LeaseStatus,
    LeaseTable,
    Renewal,
    Role,
    ShardMap,
)
from ams.errors import FailedPrecondition, InvalidArgument

TTL = 1000
A0, A1 = "10.0.0.1:7001", "10.0.0.2:7002"


def two_shards(now: int = 0) -> tuple[LeaseTable, str, str]:
    """A table of 2 shards, both registered at ``now``; their lease ids."""
    table = LeaseTable(2, TTL)
    g0 = table.register(Role.SHARD, 0, A0, "inc-0", now)
    g1 = table.register("shard", 1, A1, "inc-1", now)
    return table, g0.lease_id, g1.lease_id


def test_first_registrations_fill_the_map_without_moving_the_generation():
    table = LeaseTable(2, TTL)
    assert table.shard_map() == ShardMap(2, ("", ""), ("", ""), 0)
    assert not table.shard_map().complete
    grant = table.register(Role.SHARD, 1, A1, "inc-1", now_ms=5)
    assert (grant.ttl_ms, grant.generation) == (TTL, 0)
    assert table.shard_map().missing() == [0]
    table.register(Role.SHARD, 0, A0, "inc-0", now_ms=7)
    shard_map = table.shard_map()
    assert shard_map == ShardMap(2, (A0, A1), ("inc-0", "inc-1"), 0)
    assert shard_map.complete and shard_map.missing() == []


def test_renewals_keep_a_lease_alive_past_its_first_deadline():
    table, lease0, lease1 = two_shards()
    for now in (900, 1800, 2700):
        assert table.renew(lease0, now).status is LeaseStatus.ALIVE
        assert table.renew(lease1, now).status is LeaseStatus.ALIVE
    assert table.expire_due(3699) == []
    assert table.generation == 0
    assert table.shard_map().complete


def test_expiry_vacates_the_slot_moves_the_generation_and_fences_the_incarnation():
    table, lease0, lease1 = two_shards()
    table.renew(lease0, 500)  # shard 0 renews, shard 1 hangs
    assert table.expire_due(999) == []
    expired = table.expire_due(1000)  # shard 1's deadline: 0 + TTL
    assert [(e.role, e.slot, e.incarnation) for e in expired] == [(Role.SHARD, 1, "inc-1")]
    assert table.generation == 1
    assert table.shard_map() == ShardMap(2, (A0, ""), ("inc-0", ""), 1)
    # The hung shard wakes up: its lease is gone, and it may not take the slot back.
    assert table.renew(lease1, 1200) == Renewal(LeaseStatus.EXPIRED, 1)
    with pytest.raises(FailedPrecondition, match="declared dead"):
        table.register(Role.SHARD, 1, A1, "inc-1", 1200)
    # Its restarted process (a new incarnation) takes the slot: another generation.
    table.register(Role.SHARD, 1, A1, "inc-1b", 1300)
    assert table.generation == 2
    assert table.shard_map() == ShardMap(2, (A0, A1), ("inc-0", "inc-1b"), 2)


def test_after_a_scheduler_restart_a_replaced_shard_cannot_take_its_slot_back():
    """A shard cut off long enough to be replaced, whose link comes back only after the
    scheduler restarted (which forgot whom it fenced), rejoins and is refused; its
    replacement keeps the slot."""
    before = LeaseTable(1, TTL)
    zombie = before.register(Role.SHARD, 0, A0, "inc-x", 0).lease_id
    before.expire_due(TTL)  # cut off: its lease expires
    replacement = before.register(Role.SHARD, 0, A1, "inc-y", TTL + 100).lease_id
    after = LeaseTable(1, TTL)  # the scheduler restarted: another instance
    assert after.renew(replacement, 5000).status is LeaseStatus.UNKNOWN
    after.register(Role.SHARD, 0, A1, "inc-y", 5000, rejoin=True)
    assert after.renew(zombie, 5100).status is LeaseStatus.UNKNOWN
    with pytest.raises(FailedPrecondition, match="inc-y holds the slot: it was replaced"):
        after.register(Role.SHARD, 0, A0, "inc-x", 5100, rejoin=True)
    assert after.shard_map() == ShardMap(1, (A1,), ("inc-y",), 0)
    # a rejoin of the holder itself keeps its lease; a new process still replaces it
    again = after.register(Role.SHARD, 0, A1, "inc-y", 5200, rejoin=True)
    assert after.renew(again.lease_id, 5300).status is LeaseStatus.ALIVE
    after.register(Role.SHARD, 0, A0, "inc-z", 5400)
    assert after.shard_map() == ShardMap(1, (A0,), ("inc-z",), 1)


def test_a_rejoin_fills_an_empty_slot_without_moving_the_generation():
    table = LeaseTable(2, TTL)
    table.register(Role.SHARD, 1, A1, "inc-1", 0, rejoin=True)
    table.register(Role.WORKER, 0, "host-a", "w-0", 0, rejoin=True)
    assert table.shard_map() == ShardMap(2, ("", A1), ("", "inc-1"), 0)


def test_renewing_past_the_deadline_expires_even_without_expire_due():
    table, lease0, _ = two_shards()
    renewal = table.renew(lease0, 1000)
    # Both leases were due at 1000: the renewal expires them before it answers.
    assert renewal == Renewal(LeaseStatus.EXPIRED, 2)
    assert table.shard_map().missing() == [0, 1]


def test_a_new_incarnation_replaces_a_live_shard_and_moves_the_generation():
    table, lease0, _ = two_shards()
    grant = table.register(Role.SHARD, 0, "10.0.0.9:7001", "inc-0b", 100)
    assert grant.lease_id != lease0 and grant.generation == 1
    assert table.renew(lease0, 200).status is LeaseStatus.EXPIRED
    assert table.shard_map().addresses == ("10.0.0.9:7001", A1)


def test_the_same_incarnation_registering_again_keeps_its_lease():
    table, lease0, _ = two_shards()
    grant = table.register(Role.SHARD, 0, A0, "inc-0", 600)  # a retried call
    assert (grant.lease_id, grant.generation) == (lease0, 0)
    assert table.expire_due(1000) != []  # shard 1 only: shard 0's lease now runs to 1600
    assert table.shard_map().incarnations == ("inc-0", "")


def test_workers_come_and_go_without_moving_the_generation_until_one_hangs():
    table, lease0, lease1 = two_shards()
    w0 = table.register(Role.WORKER, 0, "host-a/pid-1", "w-0", 0)
    table.register(Role.WORKER, 1, "host-b/pid-2", "w-1", 0)
    restarted = table.register(Role.WORKER, 0, "host-a/pid-3", "w-0b", 100)  # torchrun restart
    assert table.renew(w0.lease_id, 150).status is LeaseStatus.EXPIRED
    assert table.release(restarted.lease_id, 200).incarnation == "w-0b"
    assert table.generation == 0
    for lease in (lease0, lease1):
        table.renew(lease, 900)
    expired = table.expire_due(1000)  # worker 1 never renewed: a hung worker
    assert [(e.role, e.slot) for e in expired] == [(Role.WORKER, 1)]
    assert table.generation == 1
    assert table.shard_map().complete


def test_a_shard_that_releases_its_lease_counts_as_lost():
    table, lease0, _ = two_shards()
    assert table.release(lease0, 10).slot == 0
    assert table.generation == 1
    assert table.shard_map().missing() == [0]
    assert table.release(lease0, 20) is None
    assert table.renew(lease0, 30).status is LeaseStatus.EXPIRED
    assert table.generation == 1


def test_a_lease_of_another_scheduler_is_unknown():
    table, _, _ = two_shards()
    other = LeaseTable(2, TTL)  # another instance
    foreign = other.register(Role.SHARD, 0, A0, "inc-0", 0).lease_id
    assert table.renew(foreign, 10) == Renewal(LeaseStatus.UNKNOWN, 0)
    never_issued = f"{table.instance}-999"  # this table's id, a number it did not reach
    assert table.renew(never_issued, 10).status is LeaseStatus.UNKNOWN
    assert table.release(foreign, 10) is None


@pytest.mark.parametrize("role, slot, address, incarnation, message", [
    ("scheduler", 0, A0, "i", "role"),
    ("", 0, A0, "i", "role"),
    (Role.SHARD, -1, A0, "i", "slot"),
    (Role.SHARD, 2, A0, "i", "slot"),
    (Role.SHARD, True, A0, "i", "slot"),
    (Role.SHARD, 1.0, A0, "i", "slot"),
    (Role.WORKER, -3, "h", "i", "slot"),
    (Role.WORKER, MAX_WORKER_SLOTS, "h", "i", "slot"),
    (Role.SHARD, 0, "", "i", "address"),
    (Role.SHARD, 0, "h" * 251 + ":7001", "i", "address"),
    (Role.SHARD, 0, "10.0.0.1", "i", "address"),
    (Role.SHARD, 0, "10.0.0.1:0", "i", "address"),
    (Role.SHARD, 0, "10.0.0.1:70000", "i", "address"),
    (Role.SHARD, 0, "10.0.0.1 :7001", "i", "address"),
    (Role.WORKER, 0, "x" * 256, "i", "address"),
    (Role.SHARD, 0, A0, "", "incarnation"),
    (Role.SHARD, 0, A0, "i" * 65, "incarnation"),
    (Role.SHARD, 0, A0, "inc\n", "incarnation"),
])
def test_bad_registrations_are_refused_and_change_nothing(role, slot, address, incarnation,
                                                          message):
    table, lease0, _ = two_shards()
    before = table.shard_map()
    with pytest.raises(InvalidArgument, match=message):
        table.register(role, slot, address, incarnation, 10)
    assert table.shard_map() == before
    assert table.renew(lease0, 20).status is LeaseStatus.ALIVE


@pytest.mark.parametrize("lease_id", ["", "x" * 129, "a b"])
def test_bad_lease_ids_are_refused(lease_id):
    table, _, _ = two_shards()
    with pytest.raises(InvalidArgument, match="lease_id"):
        table.renew(lease_id, 10)
    with pytest.raises(InvalidArgument, match="lease_id"):
        table.release(lease_id, 10)
    assert table.generation == 0


@pytest.mark.parametrize("num_shards, ttl_ms", [(0, 10), (2, 0), (2, 1.5), (-1, 10),
                                                (10**12, 10)])
def test_bad_tables_are_refused(num_shards, ttl_ms):
    with pytest.raises(InvalidArgument):
        LeaseTable(num_shards, ttl_ms)


@pytest.mark.parametrize("address, expected", [
    ("127.0.0.1:7001", ("127.0.0.1", 7001)),
    ("shard-3.cluster:65535", ("shard-3.cluster", 65535)),
    ("[::1]:7001", ("::1", 7001)),
])
def test_parse_address(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["7001", ":7001", "host:", "host:x1", "host:-1", "[]:1"])
def test_parse_address_refuses(address):
    with pytest.raises(InvalidArgument):
        parse_address(address)
