"""open_clip's CSV/TSV: a header row, one (image path, caption) pair per row.

Columns default to open_clip's ``filepath`` and ``title`` (``--csv-img-key``,
``--csv-caption-key`` there); the separator defaults to ``,`` for ``.csv`` and a
tab for ``.tsv``, unless the header row has no such separator and another one
(tab, comma, semicolon, bar) splits it (``sniff_separator``); ``--sep`` decides.
Image paths are read relative to the file's folder (an absolute path as it is); one missing there but present
relative to the current folder, as open_clip reads them, is taken from there.
Rows naming the same image are merged into one record with all their captions
(COCO-style files list each image once per caption); a row with an empty caption
is counted as ``empty_caption`` even when other rows give its image captions.

Hostile rows are skipped, never fatal: a row with the wrong number of fields, a
field over :data:`MAX_FIELD_CHARS`, or malformed quoting is a ``bad_row``; a row
with bytes that are not UTF-8 is ``bad_encoding``. Rows are parsed strictly, so a
stray quote cannot silently glue rows together: a stray opening quote swallows the
lines after it into one field, and when such a multi-line row fails, only its
first line is skipped and the lines after it are read again as rows of their own.
A single line that fails only strictly (``a.png,"Quoted" title``) is read leniently,
as pandas (open_clip's reader) reads it.
"""

from __future__ import annotations

import csv
import os
from collections import deque
from typing import BinaryIO, Iterator

from triclip.data.images import FileImage
from triclip.data.reasons import BAD_ENCODING, BAD_ROW, EMPTY_CAPTION, BadRecord
from triclip.data.records import DataConfig, Record
from triclip.data.sources import clean_label, register_source, resolve_path
from triclip.data.text import Line, read_lines
from triclip.core.errors import UserError

DEFAULT_SEPARATORS = {".csv": ",", ".tsv": "\t"}  # extension -> separator
MAX_FIELD_CHARS = 128 * 1024  # a longer field makes its row a bad_row (csv's own default limit too)


class _Lines:
    """The text of a file's lines for ``csv.reader``, with push-back and a record of the lines taken."""

    def __init__(self, handle: BinaryIO):
        self._source = read_lines(handle)
        self._pending: deque[Line] = deque()  # lines pushed back, read again first
        self.taken: list[Line] = []  # lines handed out since the last take()

    def __iter__(self) -> "_Lines":
        return self

    def __next__(self) -> str:
        line = self._pending.popleft() if self._pending else next(self._source)
        self.taken.append(line)
        return line.text

    def take(self) -> list[Line]:
        """The lines of the row just read; starts the next row."""
        taken, self.taken = self.taken, []
        return taken

    def push_back(self, lines: list[Line]) -> None:
        self._pending.extendleft(reversed(lines))


def _is_table(path: str) -> bool:
    return os.path.isfile(path) and os.path.splitext(path)[1].lower() in DEFAULT_SEPARATORS


def _column(header: list[str], name: str, option: str, path: str) -> int:
    if name not in header:
        sep = " or give the separator with --sep (a tab: --sep '\\t')" if len(header) == 1 else ""
        raise UserError(f"{path}: no column {name!r} (columns: {_shown(header)}); choose one with {option}{sep}")
    if header.count(name) > 1:  # which one is meant? pandas would rename the second, csv would take the first
        raise UserError(f"{path}: the header names column {name!r} {header.count(name)} times; give each column its own name")
    return header.index(name)


def _shown(header: list[str], limit: int = 200) -> str:
    """The header for an error line: printable, and short even when the file is not a table at all."""
    text = ", ".join(name if name.isprintable() else repr(name) for name in header)
    return text if len(text) <= limit else text[:limit] + "..."


def _reader(lines: _Lines, sep: str):
    return csv.reader(lines, delimiter=sep, strict=True)  # strict: malformed quoting raises, the row is skipped


def _rows(path: str, sep: str) -> Iterator[tuple[list[str], list[Line]] | BadRecord]:
    """The header, then ``(fields, lines)`` for each row or a ``BadRecord`` for a row that cannot be read."""
    with open(path, "rb") as handle:
        lines = _Lines(handle)
        reader = _reader(lines, sep)
        try:
            header = next(reader, [])
        except csv.Error as err:
            raise UserError(f"{path}: cannot read the header row: {err}") from None
        yield header, lines.take()
        while True:
            try:
                row, error = next(reader), None
            except StopIteration:
                return
            except csv.Error as err:
                row, error = None, str(err)
            taken = lines.take()
            if not taken:
                return
            if error is not None:  # a fresh reader after an error; a line refused only by strict parsing: lenient
                reader = _reader(lines, sep)
                row = _lenient(taken[0].text, sep) if len(taken) == 1 else None
            problem = error if row is None else _shape_problem(row, len(header))
            if problem is None:
                if row and not all(line.valid for line in taken):
                    yield BadRecord(BAD_ENCODING, f"line {taken[0].number}: not valid UTF-8")
                elif row:
                    yield row, taken
                continue
            yield BadRecord(BAD_ROW, f"line {taken[0].number}: {problem}")
            if len(taken) > 1:  # the lines a stray quote swallowed are read again, as rows of their own
                lines.push_back(taken[1:])
                reader = _reader(lines, sep)


def _lenient(text: str, sep: str) -> list[str] | None:
    """One line that strict parsing refused, parsed as pandas and csv's default do (``"a" b`` -> ``a b``);
    ``None`` when that fails too or a quote stays open to the line's end."""
    try:
        row = next(csv.reader([text], delimiter=sep), [])
    except csv.Error:
        return None
    return None if any("\n" in field or "\r" in field for field in row) else row


def _shape_problem(row: list[str], columns: int) -> str | None:
    if not row:
        return None
    if len(row) != columns:
        return f"{len(row)} fields for {columns} columns"
    longest = max(len(field) for field in row)
    return f"a field of {longest} characters (over {MAX_FIELD_CHARS})" if longest > MAX_FIELD_CHARS else None


@register_source("csv", _is_table, "a .csv/.tsv file with a header row")
def read_table(path: str, config: DataConfig) -> Iterator[Record | BadRecord]:
    """Yield one record per distinct image path, and a ``BadRecord`` per malformed row."""
    sep = config.sep or sniff_separator(path)
    base = os.path.dirname(os.path.abspath(path))
    rows = _rows(path, sep)
    header = [name.strip() for name in next(rows)[0]]
    image_col = _column(header, config.image_key or "filepath", "--image-key", path)
    caption_col = _column(header, config.caption_key or "title", "--caption-key", path)
    label_col = _label_column(header, config.label_key, path)
    groups: dict[str, tuple[list[str], object]] = {}  # image as written -> (captions, label)
    empty_rows: dict[str, list[int]] = {}  # image as written -> lines whose caption is empty
    for item in rows:
        if isinstance(item, BadRecord):
            yield item
            continue
        row, taken = item
        image = row[image_col].strip()
        if not image:
            yield BadRecord(BAD_ROW, f"line {taken[0].number}: no image path")
            continue
        captions, _ = groups.setdefault(image, ([], row[label_col] if label_col is not None else None))
        caption = " ".join(row[caption_col].split())
        if not caption:
            empty_rows.setdefault(image, []).append(taken[0].number)
        elif caption not in captions:
            captions.append(caption)
    for image, (captions, label) in groups.items():
        if not captions:
            yield BadRecord(EMPTY_CAPTION, image)
            continue
        for number in empty_rows.get(image, ()):  # an empty row beside captioned ones: counted, not silently dropped
            yield BadRecord(EMPTY_CAPTION, f"line {number}: {image} (its other rows have captions)")
        yield Record(key=image, captions=captions, label=clean_label(label), image=FileImage(resolve_path(base, image)))


SNIFFED = ("\t", ",", ";", "|")  # separators a header row is tried with when --sep is not given


def sniff_separator(path: str) -> str:
    """The file's separator: its extension's (DEFAULT_SEPARATORS) unless the header row has a single
    column with it and more with another of SNIFFED (a tab-separated file named .csv)."""
    default = DEFAULT_SEPARATORS[os.path.splitext(path)[1].lower()]
    try:
        with open(path, "rb") as handle:
            first = handle.readline(MAX_FIELD_CHARS).decode("utf-8", errors="replace")
    except OSError:
        return default
    if default in first:
        return default
    counts = {sep: first.count(sep) for sep in SNIFFED}
    best = max(SNIFFED, key=lambda sep: counts[sep])
    return best if counts[best] > 0 else default


def _label_column(header: list[str], label_key: str | None, path: str) -> int | None:
    """The label column: the one named by ``label_key``, else ``label`` when present, else none."""
    if label_key is not None:
        return _column(header, label_key, "--label-key", path)
    return header.index("label") if "label" in header else None
