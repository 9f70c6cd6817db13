"""Worker HTTP servers (roles mixed, prefill, decode)."""
