"""Benchmarks: each prints a side-by-side table and writes JSON (see docs/benchmarks.md)."""
