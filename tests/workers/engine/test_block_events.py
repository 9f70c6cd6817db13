"""BlockEventLog: numbered events, coalescing only what no reader has seen, gaps, snapshots;
and the device tier's hooks in BlockPool (registration stores, eviction removes)."""

from __future__ import annotations

from workers.engine.block_events import BlockEventLog
from workers.engine.block_pool import BlockPool


def _events(log: BlockEventLog, since: int) -> list[tuple[int, str, str, list[str]]]:
    answer = log.since(since)
    assert not answer.gap
    return [(e.seq, e.kind, e.tier, e.hashes) for e in answer.events]


def test_events_are_numbered_and_coalesced_until_read() -> None:
    log = BlockEventLog()
    log.stored("device", ["a"])
    log.stored("device", ["b"])  # joins event 0: nobody has read it
    log.removed("device", ["a"])
    assert _events(log, 0) == [(0, "stored", "device", ["a", "b"]), (1, "removed", "device", ["a"])]
    log.removed("device", ["b"])  # event 1 was read: a new event, event 1 unchanged
    log.stored("host", ["a"])
    assert _events(log, 1) == [
        (1, "removed", "device", ["a"]),
        (2, "removed", "device", ["b"]),
        (3, "stored", "host", ["a"]),
    ]
    assert log.since(4).events == [] and log.since(4).next_seq == 4
    assert log.held("device") == set() and log.held("host") == {"a"}


def test_a_reader_behind_the_buffer_or_ahead_gets_a_gap_and_the_snapshot_is_whole() -> None:
    log = BlockEventLog(max_events=2)
    for name in ("a", "b", "c"):
        log.stored("device", [name])
        log.since(log.since(0).next_seq)  # read: the next store is a new event
    assert log.since(0).gap and log.since(1).events[0].seq == 1
    assert log.since(9).gap
    log.anchored("k1", 2, "b")
    log.anchored("k1", 2, "b")  # the same anchor again: no event
    snap = log.snapshot()
    assert (snap.epoch, snap.next_seq) == (log.epoch, 4)
    assert snap.tiers == {"device": ["a", "b", "c"], "host": []}
    assert [(a.key, a.num_blocks, a.last_hash) for a in snap.anchors] == [("k1", 2, "b")]
    log.stored("device", ["d"])
    assert _events(log, 4) == [(4, "stored", "device", ["d"])]


def test_the_buffer_is_bounded_in_hashes_too() -> None:
    log = BlockEventLog(max_hashes=3)
    log.stored("device", ["a", "b"])
    log.since(0)
    log.removed("device", ["a", "b"])  # 4 hashes buffered: event 0 goes
    assert log.since(0).gap and _events(log, 1) == [(1, "removed", "device", ["a", "b"])]
    log.stored("device", ["c", "d", "e", "f"])  # alone over the bound: kept, event 1 goes
    assert _events(log, 2) == [(2, "stored", "device", ["c", "d", "e", "f"])]
    assert log.since(1).gap and log.held("device") == {"c", "d", "e", "f"}


def test_on_change_is_a_tier_hook() -> None:
    log = BlockEventLog()
    log.on_change("host")(["x", "y"], [])
    log.on_change("host")([], ["x"])
    assert _events(log, 0) == [(0, "stored", "host", ["x", "y"]), (1, "removed", "host", ["x"])]


def test_block_pool_reports_registration_and_eviction() -> None:
    pool = BlockPool(2, enable_caching=True)
    assert pool.events is not None
    a, b = pool.allocate(2) or []
    assert pool.cache_block(a, "ha") and pool.cache_block(b, "hb")
    assert pool.cache_block(a, "ha")  # already cached: nothing new
    pool.free([a, b])
    pool.touch([a])  # a hit: nothing changes in what the tier holds
    assert pool.allocate(1) == [b]  # evicts hb
    assert _events(pool.events, 0) == [
        (0, "stored", "device", ["ha", "hb"]),
        (1, "removed", "device", ["hb"]),
    ]
    assert pool.events.held("device") == set(pool.cached_blocks()) == {"ha"}
    assert BlockPool(2).events is None  # caching off: no log
