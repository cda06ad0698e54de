"""The one way tools/ scripts turn a user mistake into a one-line error and exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

# mistakes a user fixes by changing a flag or a file (a bug elsewhere keeps its traceback)
USER_ERRORS = (FileNotFoundError, FileExistsError, ValueError, KeyError, ImportError)


def run_tool(tool: str, fn: Callable[[], Path | None]) -> int:
    """Run ``fn``; print ``wrote PATH`` on success, ``TOOL: error: ...`` and return 2 on a user error."""
    try:
        out = fn()
    except USER_ERRORS as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"{tool}: error: {msg}", file=sys.stderr)
        return 2
    if out is not None:
        print(f"wrote {out}")
    return 0
