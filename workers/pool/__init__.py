"""The Mooncake KV pool: key scheme, master lifecycle, pool owner and pool client."""
