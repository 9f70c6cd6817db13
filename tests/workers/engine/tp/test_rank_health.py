"""RankHealth: rank 0's view of every other rank's pool client, over the real handoff links
(serve_handoff listeners answering "health" as a rank's does): the exact reason of each rank
that is degraded or does not answer, and back to healthy once they are."""

from __future__ import annotations

import os
import threading

from workers.engine.tp.handoff_link import PeerLinks, serve_handoff
from workers.engine.tp.rank_health import RankHealth

KEY = os.urandom(16)


def test_each_degraded_or_silent_rank_is_named_until_it_recovers() -> None:
    states = {1: ("ok", None), 2: ("degraded", "shm_not_mapped (-600)"), 3: ("ok", None)}
    release = threading.Event()
    release.set()

    def rank(r: int):
        def health() -> tuple[str, str | None]:
            release.wait()  # cleared: the rank hangs, as a stopped process does
            return states[r]

        return serve_handoff({"health": health}, KEY)

    addresses = [rank(1), rank(2), rank(3)]
    links = PeerLinks(addresses, KEY, timeout_s=30.0)
    ranks = RankHealth(links, interval_s=0.05)
    assert ranks.answer_s == 2.0
    assert ranks.poll_once() == "rank 2: shm_not_mapped (-600)"
    assert ranks.problem() == "rank 2: shm_not_mapped (-600)"
    states[2] = ("ok", None)
    assert ranks.poll_once() is None
    release.clear()
    ranks.answer_s = 0.2
    assert ranks.poll_once() == "; ".join(
        f"rank {r}: rank at {a} did not answer health in 0.2 s"
        for r, a in enumerate(addresses, start=1)
    )
    release.set()
    assert ranks.poll_once() is None
