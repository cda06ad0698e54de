"""Lazy imports of optional dependencies with one clear error naming the pip extra.

Transformer Engine and SGLang neither install nor import on a CPU machine; Ray is only
needed for multi-process runs. Code that needs one calls :func:`require` at the point of
use, never at module import time.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# import name -> (what it is, the pip extra of megatron_qrl that installs it)
_EXTRAS: dict[str, tuple[str, str]] = {
    "transformer_engine": ("Transformer Engine", "gpu"),
    "transformer_engine.pytorch": ("Transformer Engine", "gpu"),
    "sglang": ("SGLang", "gpu"),
    "ray": ("Ray", "ray"),
}


class MissingDependencyError(ImportError):
    """An optional dependency is not importable here."""


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingDependencyError` saying what needs it.

    ``feature`` names what the caller was about to do (e.g. ``"--qrl-rollout-engine sglang"``)
    so the message tells the user which flag to drop or which extra to install.
    """
    try:
        return importlib.import_module(module)
    except Exception as exc:  # ImportError, or a CUDA-less import failure inside the lib
        what, extra = _EXTRAS.get(module.split(".")[0], (module, None))
        hint = (
            f"install it with `pip install -e .[{extra}]` on a machine where it is supported"
            if extra
            else f"install `{module}`"
        )
        raise MissingDependencyError(
            f"{feature} needs {what} (`import {module}` failed: {exc}); {hint}."
        ) from exc


def available(module: str) -> tuple[bool, str]:
    """Return ``(importable, reason)`` without raising; used by tests to skip with a reason."""
    try:
        importlib.import_module(module)
        return True, ""
    except Exception as exc:
        return False, f"`import {module}` failed: {type(exc).__name__}: {exc}"
