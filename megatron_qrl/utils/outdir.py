"""Where a tool may write its output directory: the one check every tools/ script uses.

A tool's ``--out`` is refused when it equals, contains or lies inside one of the tool's inputs
(symlinks resolved), when something other than a directory is there, and when it is an
existing directory that is not recognisably an earlier output of the same tool. Every output
carries a marker file (:data:`MARKER_NAME`, ``{"tool", "version"}``) so ``--overwrite`` can
tell an earlier output from a directory a user cares about. The output is built under a
temporary sibling name and renamed into place (:func:`~megatron_qrl.utils.io.atomic_directory`);
the checks run again just before the rename.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from .disk import disk_full_as_one_line
from .io import atomic_directory, atomic_write_json

__all__ = ["MARKER_NAME", "OutputDirError", "check_output_dir", "check_output_file",
           "path_overlap", "read_marker", "safe_output_dir"]

MARKER_NAME = ".megatron_qrl-output.json"
"""The file every tool output directory carries: ``{"tool": NAME, "version": VERSION}``."""


class OutputDirError(ValueError):
    """``--out`` names a place the tool must not write (it would destroy something)."""


def read_marker(path: str | Path) -> dict | None:
    """The marker of directory ``path`` (None when absent or unreadable)."""
    try:
        marker = json.loads((Path(path) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def path_overlap(out: Path, inp: Path) -> str | None:
    """How resolved path ``out`` overlaps ``inp``: ``is``, ``contains``, ``lies inside`` or
    None."""
    if out == inp:
        return "is"
    if out in inp.parents:
        return "contains"
    if inp in out.parents:
        return "lies inside"
    return None


def check_output_dir(out: str | Path, inputs: Iterable[str | Path], *, tool: str,
                     overwrite: bool = False, flag: str = "--out") -> Path:
    """Return the resolved ``out`` if ``tool`` may build its output directory there.

    Raises :class:`OutputDirError` when ``out`` equals, contains or lies inside an input
    (after resolving symlinks), is not a directory, or exists and is neither empty nor marked
    as ``tool``'s output (an empty or marked directory is replaced only with ``overwrite``).
    """
    given = Path(out)
    real = given.resolve()
    for inp in inputs:
        how = path_overlap(real, Path(inp).resolve())
        if how is not None:
            raise OutputDirError(
                f"{flag} {given} {how} the input {inp}; writing there would destroy the input. "
                f"Choose an {flag} outside it")
    if not os.path.lexists(given):
        return real
    if not real.is_dir():
        what = "a broken symbolic link" if not real.exists() else "not a directory"
        raise OutputDirError(f"{flag} {given} exists and is {what}; {tool} writes a directory "
                             f"there. Remove it or choose another {flag}")
    if not overwrite:
        raise OutputDirError(f"{flag} {given} already exists; choose a new {flag}, or pass "
                             f"--overwrite to replace an earlier output of {tool}")
    marker = read_marker(real)
    if marker is None and any(real.iterdir()):
        raise OutputDirError(
            f"{flag} {given} is not an output of {tool} (no {MARKER_NAME} in it), so --overwrite "
            f"will not replace it; remove it yourself or choose a new {flag}")
    if marker is not None and marker.get("tool") != tool:
        raise OutputDirError(
            f"{flag} {given} was written by {marker.get('tool')!r}, not {tool}, so --overwrite "
            f"will not replace it; choose a new {flag}")
    return real


def _version() -> str:
    from megatron_qrl import __version__

    return __version__


@contextlib.contextmanager
def safe_output_dir(out: str | Path, inputs: Iterable[str | Path], *, tool: str,
                    overwrite: bool = False, flag: str = "--out",
                    need_bytes: int | None = None) -> Iterator[Path]:
    """``with safe_output_dir(out, [inp], tool=T) as tmp: <write into tmp>``.

    Checks ``out`` (:func:`check_output_dir`) before anything is written and again before
    the temporary directory is renamed to ``out``; writes the marker last. On an error the
    temporary directory is removed and ``out`` is untouched; a full disk is then one
    :class:`~megatron_qrl.utils.disk.DiskFullError` naming ``out``, ``flag`` and the space to
    free (``need_bytes``: the output's estimated size).
    """
    inputs = list(inputs)
    real = check_output_dir(out, inputs, tool=tool, overwrite=overwrite, flag=flag)
    with disk_full_as_one_line(out, flag, need_bytes), atomic_directory(real, overwrite=True) as tmp:
        yield tmp
        atomic_write_json(tmp / MARKER_NAME, {"tool": tool, "version": _version()})
        check_output_dir(out, inputs, tool=tool, overwrite=overwrite, flag=flag)


def check_output_file(out: str | Path, inputs: Iterable[str | Path | None], *,
                      flag: str = "--out", overwrite: bool = False) -> Path:
    """Return ``out`` if a tool may write a FILE there: not a directory, not one of the
    ``inputs`` (files or directories; None entries skipped), not an existing file inside one
    of them (a new file next to a model's files is fine), and not an existing file at all
    unless ``overwrite`` (the tool's ``--overwrite``)."""
    given = Path(out)
    real = given.resolve()
    for inp in inputs:
        if inp is None:
            continue
        how = path_overlap(real, Path(inp).resolve())
        if how is not None and (how != "lies inside" or os.path.lexists(given)):
            raise OutputDirError(f"{flag} {given} {how} the input {inp}; writing there would "
                                 f"change the input. Choose an {flag} outside it")
    if real.is_dir():
        raise OutputDirError(f"{flag} {given} is a directory; give a file name (e.g. "
                             f"{given / 'report.png'})")
    if os.path.lexists(given) and not overwrite:
        raise OutputDirError(f"{flag} {given} already exists; choose a new {flag}, or pass "
                             "--overwrite to replace it")
    return given
