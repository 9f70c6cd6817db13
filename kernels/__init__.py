"""swap_cache_layout: move KV blocks between the paged cache and a block-major host buffer."""
