"""Prepare the next weight bucket while the engine loads the current one.

A colocated sync alternates two kinds of work: the trainer packs, fingerprints and flattens a
bucket (GPU kernels and Python in this process), then waits while SGLang's scheduler process
loads it (``model.load_weights``: ~2 s of Python per 30B-A3B sync, measured on the H200). With
:func:`ahead` the next bucket is prepared in a thread during that wait; the requests stay in
order, in the calling thread. Exceptions of the producer are raised in the consumer at the
item where they happened; a consumer that stops early (an engine error) stops the producer.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()
_JOIN_S = 60.0


def ahead(items: Iterator[T], depth: int, init: Callable[[], None] | None = None) -> Iterator[T]:
    """Yield ``items`` while a thread computes up to ``depth`` more (``depth`` 0: inline).

    ``init`` runs first in the thread (e.g. ``torch.cuda.set_device``: the current device is
    per thread).
    """
    if depth <= 0:
        yield from items
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry) -> bool:
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            if init is not None:
                init()
            for x in items:
                if not put((None, x)):
                    return
            put((None, _DONE))
        except BaseException as exc:  # handed to the consumer, raised there
            put((exc, None))

    worker = threading.Thread(target=run, name="qrl-bucket-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            exc, x = q.get()
            if exc is not None:
                raise exc
            if x is _DONE:
                return
            yield x
    finally:  # the producer stops at its next item (a bucket: seconds at most)
        stop.set()
        worker.join(timeout=_JOIN_S)


def timed(items: Iterable[T], into: dict, key: str) -> Iterator[T]:
    """Yield ``items``, adding the seconds spent getting each one to ``into[key]`` (where a
    sync's time goes: preparing buckets, or waiting for them)."""
    it = iter(items)
    into.setdefault(key, 0.0)
    while True:
        t0 = time.perf_counter()
        try:
            x = next(it)
        except StopIteration:
            into[key] += time.perf_counter() - t0
            return
        into[key] += time.perf_counter() - t0
        yield x
