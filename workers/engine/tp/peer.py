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
        try:
            runner.run(batch)
        except ValueError as exc:  # a malformed chunk: rank 0 raised the same before computing
            log.warning("step refused: %s", exc)


if __name__ == "__main__":
    sys.exit(main())
