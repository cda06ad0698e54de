"""SGLang rollout engines (GPU only; ``pip install -e .[gpu]``), imported lazily."""

from .engine import SGLangEngine, engine_args_for

__all__ = ["SGLangEngine", "engine_args_for"]
