"""Inference engines' view of their KV blocks: their hash schemes, their KV events, and which
blocks each engine holds (for routing scores)."""
