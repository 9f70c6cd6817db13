"""The KV handoff through the pool, measured stage by stage (`python -m benchmarks.handoff`)
and the probes that explain its slowest stage (`python -m benchmarks.handoff.probes`)."""
