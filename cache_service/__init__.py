"""A prefix-aware prompt cache of KV blocks for LLM inference fleets."""

__version__ = "0.1.0"
