"""A tensor-parallel worker's rank 1..N-1: `python -m workers.engine.tp.peer`, started by
rank 0 (workers/engine/tp/group.py) with its RankSpec in the environment.

    join the collective group, connect to rank 0, load the rank's shard, report ready
    loop: receive a ScheduledBatch from rank 0, run it (the all-reduces meet rank 0's)
    EOF from rank 0, or rank 0's process gone: exit
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from workers.engine.engine_config import EngineConfig
from workers.engine.tp.group import (
    SPEC_ENV,
    RankSpec,
    connect_control,
    exit_with_parent,
    init_collectives,
)

log = logging.getLogger("workers.engine.tp.peer")


def main() -> int:
    spec = RankSpec.from_json(os.environ[SPEC_ENV])
    exit_with_parent()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp-rank{spec.rank} %(levelname)s %(message)s"
    )
    config = EngineConfig(**spec.engine)
    init_collectives(spec)
    conn = connect_control(spec)
    try:
        from workers.engine.tp.runner import rank_runner

        _, runner = rank_runner(config, spec.rank)
    except Exception as exc:  # reported to rank 0, which fails its start with it
        log.exception("rank %d could not load its shard", spec.rank)
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    conn.send({"rank": spec.rank, "pid": os.getpid()})
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return 0  # rank 0 closed: the worker is stopping
        if isinstance(batch, dict):  # before the first step: the pool (P and D workers)
            conn.send(_serve_pool(spec, runner, batch["pool"]))
            continue
        try:
            runner.run(batch)
        except ValueError as exc:  # a malformed chunk: rank 0 raised the same before computing
            log.warning("step refused: %s", exc)


def _serve_pool(spec: RankSpec, runner: Any, message: dict[str, Any]) -> dict[str, Any]:
    """This rank's pool client and handoff server (workers/engine/tp/handoff_link.py)."""
    from workers.engine.tp.handoff_link import serve_handoff
    from workers.engine.tp.rank_io import read_rank, write_rank
    from workers.engine.tp.shards import rank_heads
    from workers.pool.client import KVPoolClient
    from workers.pool.client_config import PoolClientConfig

    fields = dict(message["client"])
    if fields.get("cuda_device") is not None:  # rank r's cache is on the GPU after rank 0's + r
        fields["cuda_device"] += spec.rank
    try:
        client = KVPoolClient(PoolClientConfig(**fields)).connect()
    except Exception as exc:  # rank 0 fails its start with it
        log.exception("pool client")
        return {"error": f"{type(exc).__name__}: {exc}"}
    own = rank_heads(message["num_kv_heads"], spec.world_size, spec.rank)
    caches = runner.kv_caches
    pool = rank_pool(client, message.get("handoff_path", "host"), fields.get("cuda_device"))

    def write(**kwargs: Any) -> list[int]:
        outcome = write_rank(pool, caches, own, **kwargs)
        return [code for result in outcome.results for code in result.codes]

    def read(**kwargs: Any) -> tuple[int, tuple[str, ...]]:
        outcome = read_rank(pool, caches, own, **kwargs)
        return outcome.num_loaded, outcome.missing_keys

    def health() -> tuple[str, str | None]:
        state = pool.health()
        return state.state, state.reason

    handlers = {"write": write, "read": read, "health": health}
    address = serve_handoff(handlers, bytes.fromhex(spec.authkey_hex))
    return {"handoff": address}


def rank_pool(client: Any, rank0_path: str, cuda_device: int | None) -> Any:
    """The pool this rank's handoff goes through: where rank 0 moves KV by device pointers
    (its self-test passed), this rank tries the same for its own GPU (its own device staging
    and self-test: workers/pool/handoff_path.py) and keeps host staging if that fails;
    otherwise host staging, as rank 0."""
    if rank0_path != "device":
        return client
    from workers.pool.handoff_path import choose_handoff_path

    path = choose_handoff_path("auto", client, cuda_device)
    log.info("rank handoff path: %s (%s)", path.name, path.reason)
    return path.pool


if __name__ == "__main__":
    sys.exit(main())
