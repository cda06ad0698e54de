"""SGLang rollout engines (GPU only; ``pip install -e .[gpu]``; SGLang is imported when an
engine starts): :mod:`.engine` (lifecycle, generation), :mod:`.options` (the one options
object and the sync-path rules), :mod:`.launch` (the job's engine), :mod:`.factory` (which
engine a job gets), :mod:`.sync` (the weight sync, split at the process boundary),
:mod:`.kernels` (fused-MoE configurations), :mod:`.crash` (dead children).

The names below are resolved on first use, not when the package is imported: SGLang's
scheduler imports this package on its way to the weight loader (:mod:`.sync.loader`), which
must not load the trainer's side of the sync (the engine, its sender, the supervisor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["SGLangEngine", "SGLangOptions", "engine_args_for"]

if TYPE_CHECKING:
    from .engine import SGLangEngine, engine_args_for
    from .options import SGLangOptions


def __getattr__(name: str):
    """``SGLangEngine`` / ``engine_args_for`` / ``SGLangOptions``, imported on first access."""
    if name in ("SGLangEngine", "engine_args_for"):
        from . import engine
        return getattr(engine, name)
    if name == "SGLangOptions":
        from .options import SGLangOptions
        return SGLangOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
