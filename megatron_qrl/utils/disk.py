"""A full disk, said in one line: where, how much to free, which flag to change.

Writers report a full disk in many shapes: an ``OSError`` (``ENOSPC`` / ``EDQUOT``), an
``OSError`` hidden as the context of torch's ``RuntimeError("unexpected pos ...")``, the text
``[Errno 28] ...`` of a checkpoint writer's worker failure, or safetensors' Rust text
``No space left on device (os error 28)``. :func:`os_error_of` finds the ``OSError`` behind any
of them; :func:`disk_full_as_one_line` turns a full disk inside its block into
:class:`DiskFullError`, whose message names the output, the space to free and the flag. Where
a writer thread or process lost the ``OSError`` and only torch's short-write text
(``unexpected pos 704 vs 598``) arrives, the failure is a full disk when the output's
estimated size exceeded the free space at the start of the block.
"""

from __future__ import annotations

import contextlib
import errno
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = ["DISK_FULL", "DiskFullError", "disk_full_as_one_line", "human_bytes", "os_error_of",
           "tree_bytes"]

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
"""errno values of a full disk or an exhausted quota."""
_ERRNO_TEXT = re.compile(r"\[Errno (?P<errno>\d+)\] (?P<msg>[^:\n]+)(?:: '(?P<file>[^'\n]*)')?")
_RUST_TEXT = re.compile(r"(?P<msg>[A-Z][^:()\n]*) \(os error (?P<errno>\d+)\)")
_SHORT_WRITE = re.compile(r"unexpected pos \d+ vs \d+|file write failed|iostream error")
"""torch's zip writer on a short write, when the OSError behind it was lost (a writer thread
or process): taken for a full disk only when the output did not fit in the free space."""


def os_error_of(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc`` (itself, a CheckpointException's failures, the
    ``__cause__`` / ``__context__`` chain, or rebuilt from ``[Errno N] msg: 'file'`` / ``msg
    (os error N)`` text); None when there is none."""
    failures = getattr(exc, "failures", None)
    todo = [f[0] for f in failures.values()] if isinstance(failures, dict) else [exc]
    seen = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        found = _ERRNO_TEXT.search(str(e)) or _RUST_TEXT.search(str(e))
        if found:
            groups = found.groupdict()
            return OSError(int(groups["errno"]), groups["msg"], groups.get("file"))
        todo += [e.__cause__, e.__context__]
    return None


def human_bytes(n: float) -> str:
    """``n`` bytes as ``1.5 GB`` / ``20.0 MB`` / ``12 kB`` (powers of 1024)."""
    for unit, size in (("GB", 2**30), ("MB", 2**20)):
        if n >= size / 10:
            return f"{n / size:.1f} {unit}"
    return f"{max(n, 0) / 1024:.0f} kB"


def tree_bytes(*paths: str | Path) -> int:
    """Bytes of the files under ``paths`` (files or directories; missing ones count 0)."""
    total = 0
    for path in map(Path, paths):
        files = [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file())
        total += sum(p.stat().st_size for p in files)
    return total


def _free_bytes(path: Path) -> int:
    for d in (path, *path.parents):
        if d.exists():
            return shutil.disk_usage(d).free
    return 0


class DiskFullError(OSError):
    """The disk (or quota) of an output filled up; the message is the one line to show."""

    def __init__(self, out: str | Path, flag: str, need: int | None = None) -> None:
        free = _free_bytes(Path(out).absolute())
        if need:
            fix = (f"free {human_bytes(max(need - free, 0) or need)} or choose another {flag} "
                   f"(the output needs about {human_bytes(need)}, {human_bytes(free)} are free)")
        else:
            fix = f"free space or choose another {flag} ({human_bytes(free)} are free now)"
        self.message = f"no space left on {out}: {fix}"
        super().__init__(errno.ENOSPC, self.message)

    def __str__(self) -> str:
        return self.message


@contextlib.contextmanager
def disk_full_as_one_line(out: str | Path, flag: str, need: int | None = None) -> Iterator[None]:
    """Re-raise a full disk inside the block as :class:`DiskFullError` (``out``: the output
    being written; ``flag``: the option that chose it; ``need``: its estimated bytes)."""
    free = _free_bytes(Path(out).absolute()) if need else None
    try:
        yield
    except DiskFullError:
        raise
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        err = os_error_of(exc)
        full = err.errno in DISK_FULL if err is not None else (
            free is not None and need > free and _short_write(exc))
        if not full:
            raise
        raise DiskFullError(out, flag, need) from exc


def _short_write(exc: BaseException) -> bool:
    failures = getattr(exc, "failures", None)
    texts = [str(exc)] + ([str(f[0]) for f in failures.values()] if isinstance(failures, dict)
                          else [])
    return any(_SHORT_WRITE.search(t) for t in texts)

