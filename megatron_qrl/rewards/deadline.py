"""A hard time limit on Python work in the calling thread, without signals, threads or processes.

:func:`time_limit` installs a trace function (``sys.settrace``) for the calling thread only;
it runs on every Python function call (and generator resumption) inside the block and
raises :class:`TimeLimitExceeded` once the limit has passed (no per-line tracing: that would
cost a few times the work it guards; the code it bounds calls functions all the time). That works in any thread (a Ray
actor's method, a torchrun rank, a helper thread), needs no ``SIGALRM`` (main thread only) and
no ``fork`` (unsafe with CUDA and Ray).

:class:`TimeLimitExceeded` derives from ``BaseException``, so library code that swallows
``Exception`` (sympy does, in many places) cannot catch it and carry on: the interpreter
removes the trace function when it raises, and the exception unwinds to the ``with`` block.
What it cannot interrupt is ONE long call into C (``int()`` of a million-digit decimal) or a
loop of plain bytecode that calls no Python function: the caller bounds the former lexically
before parsing (``rewards.math``: literal length, digit count
and exponent limits checked on the string).

The previous trace function (a debugger, coverage) is restored when the block ends.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

__all__ = ["TimeLimitExceeded", "time_limit"]


class TimeLimitExceeded(BaseException):  # noqa: N818 - a BaseException on purpose (module doc)
    """The work inside :func:`time_limit` ran past its limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`TimeLimitExceeded` from the Python code of this block after ``seconds``."""
    end = time.monotonic() + seconds

    def check(frame, event, arg):
        if time.monotonic() > end:
            raise TimeLimitExceeded(f"took longer than {seconds:g} s")
        return None  # no line events

    previous = sys.gettrace()
    sys.settrace(check)
    try:
        yield
    finally:
        sys.settrace(previous)
