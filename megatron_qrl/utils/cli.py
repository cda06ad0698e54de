"""The one way tools/ scripts turn a user mistake into a one-line error and exit code 2.

:func:`run_tool` prints ``TOOL: error: MESSAGE`` (one line) for a mistake the user fixes by
changing a flag or a file — a missing or malformed input, an output place that would destroy
something, a read-only or full output disk — and returns 2; ``--debug`` (or the environment
variable ``QRL_DEBUG=1``) prints the traceback above it. Anything else is a bug and keeps its
traceback. :func:`tool_parser` is an ``argparse`` parser that takes negative numbers as
values (``--x -1e-3``) and has ``--debug``; :func:`positive_float` / :func:`positive_int`
are ``type=`` checkers that reject NaN, inf, zero and negatives with the flag's name.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from .argparse_negative import allow_negative_numbers
from .disk import DiskFullError, os_error_of

__all__ = ["USER_ERRORS", "allow_negative_numbers", "debug_enabled", "disk_error", "one_line_error",
           "positive_float", "positive_int", "run_tool", "tool_parser"]

# mistakes a user fixes by changing a flag or a file (a bug elsewhere keeps its traceback)
USER_ERRORS = (FileNotFoundError, FileExistsError, ValueError, KeyError, ImportError)

_DISK_HINTS = {
    errno.ENOSPC: "the file system is full; free space or write elsewhere",
    errno.EDQUOT: "the disk quota is exceeded; free space or write elsewhere",
    errno.EROFS: "the file system is read-only; write to a writable location",
    errno.EACCES: "permission denied; check the permissions or write elsewhere",
    errno.EPERM: "operation not permitted; check the permissions or write elsewhere",
    errno.EISDIR: "a directory is in the way of a file",
    errno.ENOTDIR: "a file is in the way of a directory",
}
"""OS errors a user fixes (disk full, read-only or forbidden output): errno -> hint."""

DEBUG_ENV = "QRL_DEBUG"
"""Environment variable that, set to a non-empty value other than 0, shows tracebacks."""


def debug_enabled(debug: bool | None = None) -> bool:
    """``--debug`` given, or ``QRL_DEBUG`` set (to anything but "" / "0")."""
    return bool(debug) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def disk_error(exc: BaseException) -> OSError | None:
    """The OSError of a full, read-only or forbidden disk behind ``exc`` (itself or wrapped by
    a writer: :func:`~megatron_qrl.utils.disk.os_error_of`), or None."""
    err = os_error_of(exc)
    return err if err is not None and err.errno in _DISK_HINTS else None


def one_line_error(exc: BaseException) -> str | None:
    """The one-line message for a user error, or None when ``exc`` is a bug."""
    if isinstance(exc, DiskFullError):
        msg = str(exc)
    elif (err := disk_error(exc)) is not None:
        where = f"{err.filename}: " if err.filename else ""
        msg = f"{where}{err.strerror or err} ({_DISK_HINTS[err.errno]})"
    elif isinstance(exc, KeyError) and exc.args:
        msg = str(exc.args[0])
    elif isinstance(exc, USER_ERRORS):
        msg = str(exc)
    else:
        return None
    return " ".join(line.strip() for line in msg.splitlines() if line.strip())


def run_tool(tool: str, fn: Callable[[], Path | None], debug: bool | None = None) -> int:
    """Run ``fn``; print ``wrote PATH`` on success, ``TOOL: error: ...`` and return 2 on a user error.

    ``debug`` (or ``QRL_DEBUG=1``) prints the traceback before the one-line error.
    """
    try:
        out = fn()
    except Exception as exc:
        msg = one_line_error(exc)
        if msg is None:
            raise
        if debug_enabled(debug):
            traceback.print_exc()
        print(f"{tool}: error: {msg}", file=sys.stderr)
        return 2
    if out is not None:
        print(f"wrote {out}")
    return 0


def tool_parser(description: str | None = None, **kwargs) -> argparse.ArgumentParser:
    """A tool's argument parser: negative numbers as values, ``--debug`` for tracebacks."""
    kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    parser = allow_negative_numbers(argparse.ArgumentParser(description=description, **kwargs))
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of an error (also: env {DEBUG_ENV}=1)")
    return parser


def positive_float(text: str) -> float:
    """``type=`` for a finite float > 0 (NaN, inf, 0 and negatives rejected)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """``type=`` for an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value
