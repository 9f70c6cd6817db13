"""The skew and scale workload of the cache benchmark (make bench-cache-skew)."""
