"""Why a record is skipped. Users see these names in reports: keep them short and stable.

The order of :data:`REASONS` is stored (reason ``k`` as ``k + 1`` in caches and shared
counters): add new reasons at the end only.
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping

MISSING_FILE = "missing_file"  # the image file (or tar member, or dataset cell) is not there or cannot be opened
CORRUPT_IMAGE = "corrupt_image"  # the bytes are not a decodable image (truncated, garbage, empty, text)
EMPTY_CAPTION = "empty_caption"  # no non-empty caption
DECOMPRESSION_BOMB = "decompression_bomb"  # more pixels than the configured limit
BAD_ROW = "bad_row"  # wrong columns, bad JSON, wrong types, malformed CSV quoting, a field over 128 KiB
NOT_A_FILE = "not_a_file"  # the image path is a directory, FIFO, device or socket: never opened
BAD_ENCODING = "bad_encoding"  # a manifest/CSV/caption line that is not valid UTF-8
REASONS = (MISSING_FILE, CORRUPT_IMAGE, EMPTY_CAPTION, DECOMPRESSION_BOMB, BAD_ROW, NOT_A_FILE, BAD_ENCODING)
EXAMPLES = 5  # skipped records named per reason in reports (the first ones met), beside the counts


class BadRecord(Exception):
    """A record that cannot be used; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str = ""):
        if reason not in REASONS:
            raise ValueError(f"unknown skip reason {reason!r}; expected one of {REASONS}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def count_by_reason(*parts: Mapping[str, int]) -> dict[str, int]:
    """Add up skip counts (e.g. a source's read-time skips and its decode-time skips).

    Returns:
        ``{reason: n}`` with zero counts dropped, sorted by reason name: the one form
        that ``data inspect``, ``train``, ``eval`` and ``index build`` report.
    """
    total: Counter = Counter()
    for part in parts:
        total.update({reason: int(n) for reason, n in part.items()})
    return {reason: n for reason, n in sorted(total.items()) if n > 0}


def note_example(examples: dict[str, list[str]], bad: "BadRecord") -> None:
    """Keep ``bad``'s detail (e.g. the missing file's path, as tried) among the first :data:`EXAMPLES` of its reason."""
    named = examples.setdefault(bad.reason, [])
    if len(named) < EXAMPLES and bad.detail:
        named.append(bad.detail)


def merge_examples(*parts: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """The first :data:`EXAMPLES` details per reason across ``parts`` (in order), empty reasons dropped, sorted by reason."""
    merged: dict[str, list[str]] = {}
    for part in parts:
        for reason, details in part.items():
            merged.setdefault(reason, [])
            merged[reason] += details[: EXAMPLES - len(merged[reason])]
    return {reason: merged[reason] for reason in sorted(merged) if merged[reason]}
