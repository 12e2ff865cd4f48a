"""Items of an iterable made ahead in a background thread: image decoding overlaps the tower.

An embedding pass decodes and resizes a batch of images (PIL, numpy), then runs the tower on it
(ONNX Runtime). Both release the GIL for their heavy parts, so a thread that makes batch k + 1
while the tower runs on batch k keeps both cores of a small machine busy without the start-up
and copying of a DataLoader worker process. Where the tower can run single-threaded, :func:`ordered_map`
goes further: each of several threads decodes a batch and runs the tower on it. The items, their
order and any exception raised while making them are the plain iteration's (tests/model/test_prefetch.py).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, TypeVar

Item = TypeVar("Item")
Job = TypeVar("Job")


@dataclass(frozen=True)
class PrefetchConfig:
    """How far ahead the background thread works."""

    depth: int = 2  # items made and waiting at most (each an image batch: 64 x 0.6 MB)


class _End:
    """Marks the end of the items, or carries the exception that ended them."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


def prefetched(items: Iterable[Item], cfg: PrefetchConfig = PrefetchConfig()) -> Iterator[Item]:
    """Yield ``items`` in order, each made in a background thread while the caller uses the previous one.

    An exception raised by ``items`` is raised here, at the point the plain loop would have met it.
    Closing the generator early (``break``, an error in the caller) stops the thread once the item
    it is making is made; it is joined before this returns.
    """
    ready: queue.Queue = queue.Queue(maxsize=max(1, cfg.depth))
    stop = threading.Event()
    worker = threading.Thread(target=_fill, args=(iter(items), ready, stop), name="triclip-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            item = ready.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item
    finally:
        stop.set()
        _drain(ready)  # a thread blocked on a full queue gets its place, sees ``stop`` and ends
        worker.join()


def ordered_map(work: Callable[[Job], Item], jobs: Iterable[Job], threads: int, cfg: PrefetchConfig = PrefetchConfig()) -> Iterator[Item]:
    """Yield ``work(job)`` for each job, in order, computed by ``threads`` threads at once.

    At most ``threads + cfg.depth`` jobs are started and not yet yielded. An exception raised by
    ``work`` is raised here at its job's place in the order, after the results before it. Closing
    the generator early cancels the jobs not started and waits for the running ones.
    """
    threads = max(1, threads)
    pending: deque[Future] = deque()
    pool = ThreadPoolExecutor(threads, thread_name_prefix="triclip-pass")
    try:
        for job in jobs:
            pending.append(pool.submit(work, job))
            if len(pending) >= threads + cfg.depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True)


def _fill(items: Iterator, ready: queue.Queue, stop: threading.Event) -> None:
    """The background thread: make items until they end, an error, or ``stop``."""
    try:
        for item in items:
            if not _put(ready, item, stop):
                return
    except BaseException as err:  # noqa: BLE001  handed to the consumer, raised there
        _put(ready, _End(err), stop)
        return
    _put(ready, _End(), stop)


def _put(ready: queue.Queue, item, stop: threading.Event) -> bool:
    """Queue ``item`` unless ``stop`` is set first; False when stopped."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _drain(ready: queue.Queue) -> None:
    while True:
        try:
            ready.get_nowait()
        except queue.Empty:
            return
