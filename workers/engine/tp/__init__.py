"""Tensor parallelism inside one worker: N rank processes, one engine (rank 0's)."""
