"""SGLang rollout engines (GPU only; ``pip install -e .[gpu]``; SGLang is imported when an
engine starts): :mod:`.engine` (lifecycle, generation), :mod:`.options` (the one options
object and the sync-path rules), :mod:`.launch` (the job's engine), :mod:`.factory` (which
engine a job gets), :mod:`.sync` (the weight sync, split at the process boundary),
:mod:`.kernels` (fused-MoE configurations), :mod:`.crash` (dead children)."""

from .engine import SGLangEngine, engine_args_for
from .options import SGLangOptions

__all__ = ["SGLangEngine", "SGLangOptions", "engine_args_for"]
