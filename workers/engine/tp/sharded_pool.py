"""ShardedPool: the handoff's pool on every P and D worker, whatever its TP size.

The handoff (workers/handoff/) names blocks by logical keys (workers.pool.keys.block_keys);
this object turns them into shards and spreads the copies over the ranks:

    exists(keys)      a block is there when some writer layout (TP size) has every shard of
                      it: one exists() of the worker's own layout's shards, a second for the
                      keys it lacks (LayoutProbe: every such key in the layouts this worker
                      has found blocks in, only the first in the others). This is the
                      minimum over ranks: a prefix hit or a follow's "present" needs every
                      shard (a P skips writing a block that is there in any layout)
    put_sharded       rank 0 writes its heads, every other rank its own, at once; a key is
                      written when every rank's put of it succeeded
    get_sharded       the layout holding the longest run from the first key, then each rank
                      reads the shards covering its heads; loaded = the minimum over ranks

workers/handoff/pipeline.py hands put_blocks / get_blocks to put_sharded / get_sharded (the
pool's `sharded` capability: workers/handoff/slots.py HandoffPool), with the caller's slot
bound (slots_by_s) and stop (stop_at_s): every rank waits for staging slots until the
caller's instant, never a bound of its own. health() is the wrapped pool's and every other
rank's (RankHealth); everything else (slots, buffer...) is the wrapped pool's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from workers.engine.tp.handoff_link import PeerCallError, PeerLinks
from workers.engine.tp.layout_probe import LayoutProbe
from workers.engine.tp.rank_health import RankHealth
from workers.engine.tp.rank_io import read_rank, write_rank
from workers.engine.tp.shards import layouts, rank_heads
from workers.handoff.pipeline import GetOutcome, PutOutcome
from workers.handoff.timings import ReadTimings
from workers.pool.errors import BatchResult, PoolError
from workers.pool.keys import logical_key, shard_key
from workers.pool.pool_health import PoolHealth

log = logging.getLogger(__name__)
# Mooncake's code for a key a rank could not put (transfer failed): the put counts as failed.
_FAILED = -800
# A rank's copy of a request's blocks: past this it counts as failed (and is logged).
PEER_CALL_TIMEOUT_S = 60.0


class ShardedPool:
    def __init__(
        self,
        inner: Any,
        tp_size: int,
        num_kv_heads: int,
        peers: PeerLinks | None,
        ranks: RankHealth | None = None,
    ) -> None:
        self.inner, self.tp_size, self.num_kv_heads = inner, tp_size, num_kv_heads
        self.own = rank_heads(num_kv_heads, tp_size, 0)
        self.peers, self.ranks = peers, ranks
        self._layouts = layouts(num_kv_heads, tp_size)
        self._probe = LayoutProbe(self._layouts[1:], self._complete)

    # put_blocks over this pool hands each rank's write to put_sharded, whose own put_blocks
    # (over a HeadsView of the inner pool) runs a checked pool's late headers, not this one.
    headers_later = None

    @property
    def sharded(self) -> ShardedPool:
        """The pipeline hands every put_blocks / get_blocks to put_sharded / get_sharded."""
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _shards(self, key: str, writer_tp: int) -> list[str]:
        h = self.num_kv_heads
        return [
            shard_key(key, r.start, r.end, h)
            for r in (rank_heads(h, writer_tp, i) for i in range(writer_tp))
        ]

    def health(self) -> PoolHealth:
        """The wrapped pool's health, degraded too while another rank's pool client is (or
        that rank does not answer): a rank that cannot move its heads fails every handoff."""
        own = self.inner.health()
        problem = self.ranks.problem() if self.ranks is not None and own.ok else None
        return own if problem is None else PoolHealth("degraded", problem, own.generation)

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.stop()
        self.inner.close()

    def layout_runs(self, keys: Sequence[str]) -> dict[int, list[bool]]:
        """For each candidate writer TP size, which keys have every shard in the pool. The
        worker's own size is asked first; the others only for the keys it lacks (one TP size
        per cluster, the common case, costs one exists() of its own shards on a hit)."""
        own = self.tp_size
        have = self._complete([(own, k) for k in keys])
        runs = {t: [False] * len(keys) for t in self._layouts}
        runs[own] = [have[(own, k)] for k in keys]
        lacking = [i for i, here in enumerate(runs[own]) if not here]
        if not lacking:
            return runs
        # The probe answers for every other size (none: an empty answer, no pool call).
        for t, holds in self._probe.runs([keys[i] for i in lacking]).items():
            for i, here in zip(lacking, holds, strict=True):
                runs[t][i] = here
        return runs

    def _complete(self, asked: Sequence[tuple[int, str]]) -> dict[tuple[int, str], bool]:
        """For each (writer TP size, logical key), whether every shard is there: one exists()."""
        shards = [(t, k, s) for t, k in asked for s in self._shards(k, t)]
        present = self.inner.exists([s for _, _, s in shards]) if shards else []
        have = dict.fromkeys(asked, True)
        for (t, k, _), here in zip(shards, present, strict=True):
            have[(t, k)] = have[(t, k)] and here
        return have

    def exists(self, keys: Sequence[str]) -> list[bool]:
        runs = self.layout_runs(keys)
        return [any(runs[t][i] for t in self._layouts) for i in range(len(keys))]

    def put_sharded(
        self,
        tensors: Sequence[object],
        block_ids: Sequence[int],
        keys: Sequence[str],
        group: int,
        overlap: bool,
        slots_by_s: float,
    ) -> PutOutcome:
        """slots_by_s (time.monotonic, one clock for the ranks of a host): the caller's bound
        on the staging-slot wait, the same for every rank."""
        args = dict(
            block_ids=list(block_ids),
            keys=list(keys),
            group=group,
            overlap=overlap,
            slots_by_s=slots_by_s,
        )
        pending = self.peers.submit("write", **args) if self.peers else []
        try:
            local = write_rank(self.inner, tensors, self.own, **args)
        finally:  # the other ranks' copies read their blocks: they end before the caller frees
            others = _answers(pending, [_FAILED] * len(keys))
        mine = [c for r in local.results for c in r.codes]
        codes = [min(cs) for cs in zip(mine, *others, strict=True)]
        results, first = [], 0
        for result in local.results:
            n = len(result.keys)
            results.append(
                BatchResult.from_codes(keys[first : first + n], codes[first : first + n])
            )
            first += n
        return PutOutcome(tuple(results), local.timings)

    def get_sharded(
        self,
        tensors: Sequence[object],
        block_ids: Sequence[int],
        keys: Sequence[str],
        group: int,
        overlap: bool,
        stop_at_s: float | None,
        slots_by_s: float,
    ) -> GetOutcome:
        """Run by run: the layout holding the longest run from the first key left, read by
        every rank; then the next run (a prompt whose prefix a worker of another TP size
        wrote has its blocks in two layouts), until a block no layout holds whole."""
        done, missing, timings = 0, (), ReadTimings()
        while done < len(keys):
            outcome = self._read_run(
                tensors, block_ids[done:], keys[done:], group, overlap, stop_at_s, slots_by_s
            )
            done, missing = done + outcome.num_loaded, outcome.missing_keys
            timings = timings + outcome.timings
            if not outcome.num_loaded or not missing:
                break
        return GetOutcome(done, tuple(logical_key(k) for k in missing), timings)

    def _read_run(
        self,
        tensors: Sequence[object],
        block_ids: Sequence[int],
        keys: Sequence[str],
        group: int,
        overlap: bool,
        stop_at_s: float | None,
        slots_by_s: float,
    ) -> GetOutcome:
        try:
            writer_tp = self.best_layout(keys)
        except PoolError:  # a sick pool: the gets say what is missing (D recomputes it)
            writer_tp = self.tp_size
        args = dict(
            writer_tp=writer_tp,
            block_ids=list(block_ids),
            keys=list(keys),
            group=group,
            overlap=overlap,
            stop_at_s=stop_at_s,
            slots_by_s=slots_by_s,
        )
        pending = self.peers.submit("read", **args) if self.peers else []
        try:
            local = read_rank(self.inner, tensors, self.own, **args)
        finally:  # the blocks are the request's only once every rank's copy has ended
            failed = (0, (shard_key(keys[0], self.own.start, self.own.end, self.own.total),))
            others = _answers(pending, failed)
        loaded, missing = local.num_loaded, local.missing_keys
        for num_loaded, their_missing in others:
            if num_loaded < loaded:
                loaded, missing = num_loaded, tuple(their_missing)
        return GetOutcome(loaded, missing, local.timings)

    def best_layout(self, keys: Sequence[str]) -> int:
        """The writer TP size whose shards hold the longest run from the first key (own
        size first on a tie)."""
        runs = self.layout_runs(keys)

        def run(t: int) -> int:
            return next((i for i, here in enumerate(runs[t]) if not here), len(keys))

        return max(self._layouts, key=lambda t: (run(t), t == self.tp_size))


def _answers(pending: list[Any], failed: Any) -> list[Any]:
    """Every rank's answer, each waited for; `failed` for a rank that gave none."""
    out = []
    for future in pending:
        try:
            out.append(future.result())
        except PeerCallError as exc:
            log.error("%s: counted as not moved", exc)
            out.append(failed)
    return out


def sharded_pool(
    engine: Any, inner: Any, client_config: Any, handoff_path: str = "host"
) -> ShardedPool:
    """The handoff pool of a P or D worker over its connected pool client (and, on a
    tensor-parallel worker, every other rank's, connected here with the same settings; each
    tries the device-pointer path where rank 0's handoff_path is "device": peer.rank_pool)."""
    tp = engine.engine_config.tensor_parallel_size
    heads = engine.model_config.num_kv_heads
    if tp == 1:
        return ShardedPool(inner, tp, heads, None)
    group = engine.runner.group
    message = {
        "client": dataclasses.asdict(client_config),
        "num_kv_heads": heads,
        "handoff_path": handoff_path,
    }
    peers = PeerLinks(group.connect_pools(message), group.authkey, PEER_CALL_TIMEOUT_S)
    # Polled as often as the clients probe the pool; 0 (no probing) polls nothing either.
    interval_s = client_config.probe_interval_s
    ranks = RankHealth(peers, interval_s).start() if interval_s > 0 else None
    return ShardedPool(inner, tp, heads, peers, ranks)
