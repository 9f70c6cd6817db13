"""`make bench-cache`: the pool as a shared prefix cache through the router (2 P + 2 D)."""
