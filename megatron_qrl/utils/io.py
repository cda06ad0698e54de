"""Atomic file and directory writes (checkpoints, metrics tables, tools).

A reader never sees a half-written file: data goes to a temporary path in the SAME directory
(same filesystem), is flushed and fsync'ed, then ``os.replace`` swaps it in (atomic on POSIX).
Directories are built under a temporary name next to the target and renamed into place; an
existing target is first moved aside and deleted only after the swap, so a crash leaves
either the old or the new directory complete (plus, at worst, a stale ``.tmp-*``/``.old-*``
sibling that :func:`atomic_directory` never reads).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_directory",
    "atomic_torch_save",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "follow_umask",
]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()
"""The process umask (read once at import). ``mkstemp`` / ``mkdtemp`` create 0600 / 0700
entries; the renamed results get the modes a plain ``open`` / ``mkdir`` would give, so a
colleague on a shared cluster can read the run's checkpoints and metrics."""


def follow_umask(path: str | Path, directory: bool = False) -> None:
    """Give ``path`` the mode a plain ``open`` (``mkdir``) gives under the process umask:
    for a file made by a writer that creates it 0600 (``mkstemp``, safetensors'
    ``save_file``) so another account can read what the run wrote."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_UMASK)


@contextlib.contextmanager
def _temp_file(path: Path) -> Iterator[Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    follow_umask(tmp)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _fsync(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns ``path``."""
    path = Path(path)
    with _temp_file(path) as tmp:
        tmp.write_bytes(data)
        _fsync(tmp)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically; returns ``path``."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 2) -> Path:
    """Write ``obj`` as JSON (keys sorted) to ``path`` atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n")


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj)`` to ``path`` atomically."""
    import torch

    path = Path(path)
    with _temp_file(path) as tmp:
        torch.save(obj, tmp)
        _fsync(tmp)
    return path


@contextlib.contextmanager
def atomic_directory(path: str | Path, overwrite: bool = True) -> Iterator[Path]:
    """Build a directory atomically: ``with atomic_directory(d) as tmp: <write into tmp>``.

    On a clean exit ``tmp`` is renamed to ``path`` (replacing an existing ``path`` when
    ``overwrite``, else raising ``FileExistsError`` before anything is written); on an
    exception ``tmp`` is deleted and ``path`` is untouched.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists (pass overwrite=True to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    follow_umask(tmp, directory=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.replace(path, old / "d")
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
