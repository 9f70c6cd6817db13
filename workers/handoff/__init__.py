"""The KV handoff between the engine's blocks and the pool, in one room: what P writes, what
D reads, the pool as a prefix cache and D's write-back all run through here.

    pipeline.py     put_blocks / get_blocks: copies and pool calls overlapped group by group
    writer.py       write_blocks, ChunkedWrite: engine blocks -> pool (P, and write-back)
    reader.py       load_blocks: pool -> engine blocks, up to the first miss (D, prefix read)
    follow.py       follow_blocks: D reads keys as P's writes make them readable
    follower.py     Follower: one thread following every reservation of a D
    pool_prefix.py  PoolPrefixReader: a prompt's pool prefix read into a lease (P)
    writeback.py    WriteBack: D puts a finished request's blocks the pool lacks
    slots.py        the staging-slot wait, HandoffPool (the part of the client used here)
    timings.py      WriteTimings, ReadTimings: what each direction waited on
    tasks.py        waits that outlive a cancelled caller (a copy still reads the blocks)

Each takes what it uses (the pool, the cache tensors, the keys, the bounds) and returns a
frozen outcome with its timings. The prefill and decode rooms import this one, never each
other.
"""
