"""CacheIndex: the exact per-P state after event sequences; a gap, a new epoch or a skipped
seq asks for the snapshot and applies nothing; hits through anchors."""

from __future__ import annotations

from pdrouter.router.instances.cache_index import CacheIndex
from pdrouter.wire.cache_events import Anchor, CacheEvent, CacheEvents, CacheSnapshot

P = "http://p1"


def _snap(epoch: str = "e1", next_seq: int = 0, device: tuple[str, ...] = ()) -> CacheSnapshot:
    return CacheSnapshot(epoch=epoch, next_seq=next_seq, tiers={"device": list(device)},
                         anchors=[Anchor(key="k0", num_blocks=1, last_hash="a")])  # fmt: skip


def _ev(seq: int, kind: str, *hashes: str, tier: str = "device") -> CacheEvent:
    return CacheEvent(seq=seq, kind=kind, tier=tier, hashes=list(hashes))  # type: ignore[arg-type]


def _answer(*events: CacheEvent, epoch: str = "e1", gap: bool = False) -> CacheEvents:
    next_seq = events[-1].seq + 1 if events else 0
    return CacheEvents(epoch=epoch, next_seq=next_seq, gap=gap, events=list(events))


def test_events_in_order_give_the_exact_state() -> None:
    index = CacheIndex()
    assert index.position(P) is None and not index.apply(P, _answer())  # no view: snapshot
    index.load(P, _snap(device=("a",)))
    assert index.apply(P, _answer(_ev(0, "stored", "b", "c"), _ev(1, "removed", "a")))
    assert index.apply(P, _answer(_ev(1, "removed", "a"), _ev(2, "stored", "x", tier="host")))
    assert index.held(P, "device") == {"b", "c"} and index.held(P, "host") == {"x"}
    assert index.position(P) == ("e1", 3)
    anchored = CacheEvent(seq=3, kind="anchored", hashes=["c"], key="k1", num_blocks=3)
    assert index.apply(P, _answer(anchored))
    assert index.hit_blocks(P, ["k0", "k1"]) == 3  # k1's last block c is held
    assert index.hit_blocks(P, ["k0"]) == 0  # k0's last block a was removed
    assert index.hit_blocks("http://other", ["k1"]) == 0


def test_a_gap_a_new_epoch_or_a_skipped_seq_applies_nothing() -> None:
    index = CacheIndex()
    index.load(P, _snap(next_seq=5, device=("a",)))
    assert not index.apply(P, _answer(_ev(5, "stored", "b"), gap=True))
    assert not index.apply(P, _answer(_ev(0, "stored", "b"), epoch="e2"))  # restarted
    assert not index.apply(P, _answer(_ev(6, "stored", "b")))  # seq 5 is missing
    assert index.held(P, "device") == {"a"} and index.position(P) == ("e1", 5)
    index.load(P, _snap(epoch="e2", next_seq=1, device=("z",)))  # the rebuild
    assert index.held(P, "device") == {"z"} and index.position(P) == ("e2", 1)
    assert index.num_snapshots == 2
    index.forget(P)
    assert index.position(P) is None and index.held(P, "device") == set()


def test_anchors_are_bounded_least_recent_first() -> None:
    index = CacheIndex(max_anchors=2)
    index.load(P, _snap(device=("a", "b", "c")))
    for seq, (key, last) in enumerate((("k1", "b"), ("k2", "c"), ("k3", "a"))):
        event = CacheEvent(seq=seq, kind="anchored", hashes=[last], key=key, num_blocks=seq + 1)
        assert index.apply(P, _answer(event))
    assert list(index.anchors) == ["k2", "k3"]


def test_describe_shows_the_view() -> None:
    index = CacheIndex()
    assert index.describe(P) == {}
    index.load(P, _snap(next_seq=4, device=("a", "b")))
    assert index.describe(P) == {
        "cache": {"epoch": "e1", "next_seq": 4, "device_blocks": 2, "host_blocks": 0}
    }
