"""Replay request logs through the cache: hit rates, capacity curves, cost and plots."""
