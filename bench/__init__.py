"""Benchmarks: scripts that print what they measured."""
