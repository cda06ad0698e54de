"""Copy a Megatron ``ModuleSpec`` tree before a spec hook edits it.

Used by every layer-spec hook (the aligned linears of ``te_quant``, the replay router of
``moe``), so it lives below both.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

__all__ = ["copy_spec"]


def copy_spec(obj: Any) -> Any:
    """Copy a ``ModuleSpec`` tree (specs and submodule dataclasses), sharing everything else.

    ``copy.deepcopy`` would also copy the state objects held in ``params`` (the aligned-forward
    state, the routing-replay context), silently detaching the built layers from them.
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(obj, ModuleSpec):
        return ModuleSpec(module=obj.module, params=dict(obj.params),
                          submodules=copy_spec(obj.submodules), metainfo=dict(obj.metainfo or {}))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            if isinstance(value, ModuleSpec) or (dataclasses.is_dataclass(value)
                                                 and not isinstance(value, type)):
                setattr(new, field.name, copy_spec(value))
        return new
    return obj
