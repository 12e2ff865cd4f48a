"""Benchmarks: commands that print numbers."""
