"""Shared plumbing: one-line user errors, atomic writes and output folders, progress, distributed helpers."""
