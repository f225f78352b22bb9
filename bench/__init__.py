"""Benchmarks: scripts that print what they measured."""

from pathlib import Path

# The public Mooncake traces that replay tests, examples and benchmarks read (bench/traces).
TRACES_DIR = Path(__file__).resolve().parent / "traces"
CONVERSATION_TRACE = TRACES_DIR / "conversation_trace.jsonl"
SYNTHETIC_TRACE = TRACES_DIR / "synthetic_trace.jsonl"
