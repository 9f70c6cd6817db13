"""The Mooncake KV pool: key scheme, master lifecycle, pool owner and pool client.

    keys.py        block keys (chained sha256, model fingerprint, partial tails)
    client.py      KVPoolClient, PoolClientConfig: batch put/get of staging slots by key
    staging.py     StagingBuffer (registered host memory) and SlotAllocator
    errors.py      KeyStatus, BatchResult and the typed PoolError family
    connect.py     preflight probes, Mooncake setup, failure diagnosis
    bounded_call.py  time bound on every native call
    master.py      MooncakeMaster: mooncake_master on free loopback ports
    owner.py       `pdworker pool`: owns the pool memory (mooncake_client child), /health
    local_pool.py  LocalPool: master + owner as one unit (launcher, tests, benchmark)
    bench.py       `make bench-storage`: our client vs raw Mooncake calls

Submodules are imported explicitly (Mooncake itself only when a client connects).
"""
