"""Lines of a text source (manifest, CSV/TSV), decoded one at a time as UTF-8.

A line that is not valid UTF-8 is still yielded (decoded with replacement
characters, so CSV quoting stays in step) but marked, and its row is skipped as
``bad_encoding`` rather than read with mangled paths or captions. A UTF-8 byte
order mark at the start of the file is dropped, so header names match. Lines end
at ``\\n``, ``\\r\\n`` or a bare ``\\r``, as Python's universal newlines do.
"""

from __future__ import annotations

import re
from typing import BinaryIO, Iterator, NamedTuple

BOM = b"\xef\xbb\xbf"  # the UTF-8 byte order mark
_BARE_CR = re.compile(rb"(?<=\r)(?!\n)")  # a split point after a \r that does not start \r\n


class Line(NamedTuple):
    """One physical line of a text file (a tuple: millions are made)."""

    number: int  # 1-based line number
    text: str  # the decoded line, line ending kept
    valid: bool  # False when the bytes were not UTF-8 (``text`` then holds replacement characters)


def read_lines(handle: BinaryIO) -> Iterator[Line]:
    """Yield the lines of a binary file object, decoded as UTF-8 one by one."""
    number = 0
    for raw in handle:
        if number == 0 and raw.startswith(BOM):
            raw = raw[len(BOM) :]
        for piece in _BARE_CR.split(raw) if b"\r" in raw else (raw,):
            if not piece:
                continue
            number += 1
            try:
                yield Line(number, piece.decode("utf-8"), True)
            except UnicodeDecodeError:
                yield Line(number, piece.decode("utf-8", errors="replace"), False)
