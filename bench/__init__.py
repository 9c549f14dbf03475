"""Benchmarks: each runs both sides of a comparison in one invocation."""
