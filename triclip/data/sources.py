"""Read any accepted data source into a :class:`PairSet`, skipping bad records.

A source format is registered with :func:`register_source`: a ``detect`` test on
the path and a ``read`` generator that parses rows and yields a :class:`Record`
(image not checked yet) or a :class:`BadRecord` for a row it cannot use.
:func:`load_pairs` picks the format, checks each record's image header, makes
keys unique, counts skips by reason, and fails with one clear line when the
path is wrong or nothing usable is left.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from triclip.core.progress import progress

from triclip.data.images import probe_image
from triclip.data.reasons import MISSING_FILE, BadRecord, note_example
from triclip.data.records import DataConfig, PairSet, Record
from triclip.core.errors import UserError

Reader = Callable[[str, DataConfig], Iterator["Record | BadRecord"]]


@dataclass(frozen=True)
class Source:
    """One accepted data format."""

    name: str  # short name, shown in reports ("jsonl", "csv", "hf", "webdataset")
    detect: Callable[[str], bool]  # does this path look like this format?
    read: Reader  # parse rows; images are checked by load_pairs
    describe: str  # how a user recognises the format, for error messages


SOURCES: dict[str, Source] = {}


def register_source(name: str, detect: Callable[[str], bool], describe: str) -> Callable[[Reader], Reader]:
    """Decorator: register ``read`` as the reader of format ``name`` (checked in registration order)."""

    def wrap(read: Reader) -> Reader:
        if name in SOURCES:
            raise ValueError(f"data source {name!r} registered twice")
        SOURCES[name] = Source(name, detect, read, describe)
        return read

    return wrap


def check_source(path: str, option: str = "") -> None:
    """UserError (one true line) unless the local source ``path`` can be looked at: missing, or behind
    a folder this process may not search, are told apart (``hf:`` names and shard patterns pass)."""
    if path.startswith("hf:") or _is_pattern(path):
        return
    where = f"{option}: " if option else ""
    try:
        os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{where}data source not found: {path}") from None
    except OSError as err:  # EACCES on a folder on the way, ELOOP, ...
        raise UserError(f"{where}data source {path}: {err.strerror or err}") from None


def detect_source(path: str) -> Source:
    """The registered format that accepts ``path``.

    Raises:
        UserError: the path does not exist, or no format accepts it.
    """
    check_source(path)
    for source in SOURCES.values():
        if source.detect(path):
            return source
    accepted = "; ".join(s.describe for s in SOURCES.values())
    raise UserError(f"cannot tell the format of {path}: expected {accepted}")


def _is_pattern(path: str) -> bool:
    """A hub name (``hf:NAME``) or a brace pattern of shards: not a path that exists as such."""
    return path.startswith("hf:") or "{" in path


def load_pairs(path: str | os.PathLike, config: DataConfig | None = None) -> PairSet:
    """Read a data source: every usable record, and the skipped ones counted by reason.

    Images are not decoded here; only their header is read (existence, format,
    pixel count), so loading stays cheap. A record whose body turns out corrupt is
    caught later, by :class:`PairDataset` or :func:`inspect`.

    Args:
        path: a ``.jsonl`` manifest, a ``.csv``/``.tsv`` file, a directory written by
            ``datasets.save_to_disk`` or ``hf:NAME``, or WebDataset ``.tar`` shards
            (one file, a brace pattern, or a directory of shards).
        config: how to read the source; defaults to each format's defaults.

    Raises:
        UserError: bad path, unknown format, wrong settings, or no usable record.
    """
    path, config = os.fspath(path), config or DataConfig()
    source = detect_source(path)
    records: list[Record] = []
    skipped: Counter = Counter()
    examples: dict[str, list[str]] = {}  # reason -> the first skipped records' details (e.g. the resolved path tried)
    seen: Counter = Counter()
    bar = dict(desc=f"reading {os.path.basename(path)}", unit=" rec", leave=False, disable=None)
    for item in progress(source.read(path, config), **bar):
        bad = item if isinstance(item, BadRecord) else None
        if bad is None:
            try:
                probe_image(item.image, config.max_pixels)
            except BadRecord as err:
                bad = err
        if bad is not None:
            skipped[bad.reason] += 1
            note_example(examples, bad)
            continue
        records.append(with_unique_key(item, seen))
    if not records:
        raise UserError(f"no usable records in {path} ({source.name}); skipped: {_format_counts(skipped)}{_example(skipped, examples)}")
    return PairSet(records=records, skipped=skipped, source=f"{source.name}:{path}", max_pixels=config.max_pixels,
                   examples=examples)


def with_unique_key(record: Record, seen: Counter) -> Record:
    """Keys repeat when a source lists one image twice: the 2nd becomes ``key#2``, and so on."""
    seen[record.key] += 1
    if seen[record.key] == 1:
        return record
    key = f"{record.key}#{seen[record.key]}"
    return Record(key=key, captions=record.captions, label=record.label, image=record.image)


def _example(skipped: Counter, examples: dict[str, list[str]]) -> str:
    """One record of the commonest reason, as tried (a missing image: its path, resolved)."""
    if not skipped:
        return ""
    reason = skipped.most_common(1)[0][0]
    detail = (examples.get(reason) or [None])[0]
    if not detail:
        return ""
    where = (" (image paths are read relative to the source file's folder, else to the current folder)"
             if reason == MISSING_FILE else "")
    return f"; e.g. {reason}: {detail}{where}"


def _format_counts(counts: Counter) -> str:
    return ", ".join(f"{reason}={n}" for reason, n in sorted(counts.items())) or "nothing"


# ---------------------------------------------------------------------------- helpers for readers


def clean_captions(value: Any) -> list[str] | None:
    """Captions from a field: a string or a list of strings, stripped, empties dropped.

    Returns ``None`` when the value has the wrong type (a ``bad_row``); an empty
    list means the captions are all empty (an ``empty_caption``).
    """
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(c, str) for c in value):
        return None
    return [" ".join(c.split()) for c in value if c.strip()]


def resolve_path(base_dir: str, path: str) -> str:
    """An image path as written in a source: absolute, else relative to the source's folder.

    A relative path missing there but present relative to the working directory
    (how open_clip reads CSVs) is taken from the working directory.
    """
    if os.path.isabs(path):
        return path
    beside = os.path.normpath(os.path.join(base_dir, path))
    if not os.path.exists(beside) and os.path.exists(path):
        return os.path.abspath(path)
    return beside


def clean_label(value: Any) -> Any:
    """A label as stored: str/int kept, integral floats made int, anything else stringified."""
    if value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return str(value)
