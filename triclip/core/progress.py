"""Progress for long loops: a tqdm bar on a terminal, a few plain lines in a log.

tqdm redraws its bar with carriage returns; written to a file or a pipe (a log, CI,
``nohup``) that is hundreds of ``\\r``-joined fragments on one line. :func:`progress`
takes tqdm's arguments and returns tqdm when the stream is a terminal, otherwise a
:class:`PlainProgress` that prints a whole line at every tenth of the total (at most
one a second) or every 30 seconds, and one summary line at the end (unless the last line said it all)::

    caching locked text tower: 12/40 batch (30%), 4.1 s, 2.9 batch/s
    caching locked text tower: 40/40 batch (100%), 13.2 s, 3.0 batch/s

``disable=True`` shows nothing. tqdm itself is imported only for a terminal.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Iterable, Iterator

EVERY_FRACTION = 0.1  # plain lines: one per this share of the total
EVERY_SECONDS = 30.0  # plain lines: at least this often while work goes on
MIN_GAP = 1.0  # plain lines: never two within this many seconds (but the last)


def progress(
    iterable: Iterable | None = None,
    desc: str | None = None,
    total: float | None = None,
    unit: str = "it",
    disable: bool | None = False,
    leave: bool | None = True,
    initial: float = 0,
    file=None,
    **tqdm_options: Any,
):
    """A tqdm bar on a terminal, :class:`PlainProgress` lines otherwise; same use as ``tqdm``.

    Args:
        iterable: what to iterate (None: call ``update`` by hand, as with tqdm).
        desc, total, unit, initial: as tqdm.
        disable: True shows nothing (``None`` is tqdm's "not a terminal": then plain lines).
        leave: False: no summary line at the end (inner loops), as tqdm clears its bar.
        file: the stream (default stderr).
        tqdm_options: passed to tqdm on a terminal (``position``, ``mininterval``...).
    """
    stream = file if file is not None else sys.stderr
    if disable:
        return PlainProgress(iterable, desc, total, unit, initial, leave, stream, silent=True)
    if _is_terminal(stream):
        from tqdm.auto import tqdm

        options = dict(desc=desc, total=total, unit=unit, leave=leave, initial=initial, file=stream)
        return tqdm(iterable, **options, **tqdm_options)
    return PlainProgress(iterable, desc, total, unit, initial, leave, stream)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class PlainProgress:
    """tqdm's interface (iterate, ``update``, ``set_postfix``, ``close``, ``with``) as whole lines."""

    def __init__(self, iterable, desc, total, unit, initial, leave, stream, silent: bool = False):
        self.iterable = iterable
        self.desc = desc or ""
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.total = total
        self.unit = (unit or "it").strip()
        self.n = self.initial = initial  # initial: done before this bar (a resumed job): not in its rate
        self.leave = leave
        self.stream = stream
        self.silent = silent
        self.postfix = ""
        self.start = self.last = time.monotonic()
        self.step = 0  # tenths of the total already reported
        self.printed = False
        self.reported = None  # (count, postfix) of the last line printed
        self.closed = False

    def __iter__(self) -> Iterator:
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __len__(self) -> int:
        return int(self.total) if self.total is not None else len(self.iterable)

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        if self.silent:
            return
        now = time.monotonic()
        due = now - self.last >= EVERY_SECONDS
        if self.total:
            if self.leave and self.n >= self.total:  # the end: the summary line says it, with the last postfix
                return
            step = int(self.n / self.total / EVERY_FRACTION)
            if step > self.step and now - self.last >= MIN_GAP:
                due = True
        if due:
            self._line(now)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.silent and self.leave and self.reported != (self.n, self.postfix):  # said already: not twice
            self._line(time.monotonic())

    def _line(self, now: float) -> None:
        elapsed = now - self.start
        count = f"{self.n:g}/{self.total:g}" if self.total else f"{self.n:g}"
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        done = self.n - self.initial
        rate = f", {done / elapsed:.3g} {self.unit}/s" if elapsed > 0 and done > 0 else ""
        eta = f", ETA {_duration((self.total - self.n) * elapsed / done)}" if rate and self.total and self.n < self.total else ""
        post = f", {self.postfix}" if self.postfix else ""
        head = f"{self.desc}: " if self.desc else ""
        print(f"{head}{count} {self.unit}{share}, {elapsed:.1f} s{rate}{eta}{post}", file=self.stream, flush=True)
        self.last = now
        if self.total:
            self.step = int(self.n / self.total / EVERY_FRACTION)
        self.printed = True
        self.reported = (self.n, self.postfix)


@contextlib.contextmanager
def quiet_library_bars():
    """Silence the progress bars of Hugging Face libraries within the block (e.g. transformers'
    "Loading weights", a bar over 100 tensors that takes milliseconds)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _duration(seconds: float) -> str:
    """``42 s``, ``7 min 5 s``, ``3 h 12 min``: the time left, as a line shows it."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"
