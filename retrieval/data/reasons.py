"""Why a record is skipped. Users see these names in reports: keep them short and stable."""

from __future__ import annotations

MISSING_FILE = "missing_file"  # the image file (or tar member, or dataset cell) is not there
CORRUPT_IMAGE = "corrupt_image"  # the bytes are not a decodable image (truncated, garbage)
EMPTY_CAPTION = "empty_caption"  # no non-empty caption
DECOMPRESSION_BOMB = "decompression_bomb"  # more pixels than the configured limit
BAD_ROW = "bad_row"  # wrong columns, bad JSON, wrong types
REASONS = (MISSING_FILE, CORRUPT_IMAGE, EMPTY_CAPTION, DECOMPRESSION_BOMB, BAD_ROW)


class BadRecord(Exception):
    """A record that cannot be used; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str = ""):
        if reason not in REASONS:
            raise ValueError(f"unknown skip reason {reason!r}; expected one of {REASONS}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
