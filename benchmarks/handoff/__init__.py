"""The KV handoff through the pool, measured stage by stage (`python -m benchmarks.handoff`),
and the handoff left after a chunked prefill (`python -m benchmarks.handoff.chunked`)."""
