"""Stop a run at the next safe point on SIGINT / SIGTERM (Ctrl-C, a scheduler's preemption).

:class:`StopRequest` (a context manager around the step loop) replaces the SIGINT and SIGTERM
handlers of the main thread with one that only records the signal and prints one line; the
driver ends the current step, writes a checkpoint and raises :class:`RunStopped`, which
``qrl-train`` turns into one line and the shell's exit status of a signal (``128 + signum``:
130 for SIGINT, 143 for SIGTERM). A second signal of the same kind acts at once (the
previous handler is back in place after the first). Multi-rank: rank 0's request decides,
broadcast to every rank at the end of each step, so all ranks stop after the same step.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["RunStopped", "StopRequest"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunStopped(Exception):
    """The run stopped on a signal after writing a checkpoint; ``code`` = 128 + signum."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.code = 128 + signum


class StopRequest:
    """Records SIGINT / SIGTERM while the steps run (module docstring)."""

    def __init__(self, log: Callable[[str], None] = print) -> None:
        self.log = log
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
            name = signal.Signals(signum).name
            print(f"[qrl-train] {name}: stopping after the current step with a checkpoint "
                  f"(send {name} again to stop at once)", file=sys.stderr, flush=True)
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._previous.items():
            signal.signal(s, old)
        self._previous.clear()

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name
