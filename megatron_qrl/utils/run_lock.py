"""One run per output directory: a lock file naming its owner (pid, host, start time).

:func:`acquire_run_lock` creates ``<dir>/.qrl-train.lock`` with ``O_CREAT | O_EXCL`` (atomic on
POSIX filesystems) holding ``{"pid", "host", "started", "token"}``. A lock held by a live
process, or by a process on another host (whose liveness cannot be checked from here), refuses
the second run in one line naming the owner. A lock whose owner ran on this host and is gone
(its pid does not exist) is stale: it is moved aside (rename, then checked to be the same
lock it read: two runs breaking one stale lock cannot both win) and the lock is taken.
:meth:`RunLock.release` removes the file only while it is still this run's (same token).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LOCK_NAME", "RunLock", "RunLockError", "acquire_run_lock"]

LOCK_NAME = ".qrl-train.lock"
_FRESH_S = 10.0
"""A lock file still empty or half written this young is being created by its owner."""


class RunLockError(FileExistsError):
    """Another run holds the output directory; the message names it."""


@dataclass
class RunLock:
    """This run's hold on a directory (``release()`` at the end of the run)."""

    path: Path
    token: str

    def release(self) -> None:
        """Remove the lock file if it is still this run's."""
        held = _read(self.path)
        if held is not None and held.get("token") == self.token:
            self.path.unlink(missing_ok=True)


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _stale(held: dict | None, path: Path) -> bool:
    """The owner of ``held`` is gone (this host, pid absent), or the file is unreadable and
    older than a lock being written."""
    if held is None:
        try:
            return time.time() - path.stat().st_mtime > _FRESH_S
        except FileNotFoundError:
            return True
    if held.get("host") != socket.gethostname():
        return False
    pid = held.get("pid")
    return not (isinstance(pid, int) and pid > 0 and _alive(pid))


def _describe(held: dict | None) -> str:
    if held is None:
        return "a run whose lock file is being written"
    return (f"another qrl-train run (pid {held.get('pid')} on host {held.get('host')}, "
            f"started {held.get('started')})")


def _break_stale(path: Path, held: dict | None) -> bool:
    """Move the stale lock aside; False when another run replaced it meanwhile."""
    aside = path.with_name(f"{path.name}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return True  # someone else removed it: try to take it
    moved = _read(aside)
    if held is not None and (moved or {}).get("token") != held.get("token"):
        os.rename(aside, path)  # a fresh lock of another run: give it back
        return False
    aside.unlink(missing_ok=True)
    return True


def acquire_run_lock(directory: str | Path, flag: str = "--qrl-output-dir",
                     log: Callable[[str], None] = print) -> RunLock:
    """Take the lock of ``directory`` (created if absent); raise :class:`RunLockError`
    naming the other run when it is held (module docstring)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / LOCK_NAME
    token = uuid.uuid4().hex
    mine = {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "token": token}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            held = _read(path)
            if not _stale(held, path):
                raise RunLockError(
                    f"{flag} {d} is in use by {_describe(held)}; wait for it to end or choose "
                    f"another {flag} (if that run is gone, delete {path})") from None
            if _break_stale(path, held):
                log(f"[qrl-train] {flag} {d}: removed the stale lock of {_describe(held)}, "
                    "which is no longer running")
            continue
        try:
            os.write(fd, (json.dumps(mine) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return RunLock(path, token)
    raise RunLockError(f"{flag} {d}: could not take its lock {path} (other runs keep "
                       f"replacing it); choose another {flag}")
