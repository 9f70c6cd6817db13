"""Who a client is and what it may use: API keys from a file with per-key limits, request
priorities, and the priority queue in front of --max-in-flight (tenancy.gate ties them)."""
