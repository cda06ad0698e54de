"""The in-place loader on a LoRA-serving SGLang engine: its base layers, unwrapped while loading.

Runs inside SGLang's scheduler. Shim for SGLang 0.5.17 (``srt/lora/lora_manager.py``
``set_lora_module`` -> ``replace_submodule``; ``srt/lora/layers.py`` ``BaseLayerWithLoRA``):
with ``enable_lora`` every targeted layer is replaced by a ``*WithLoRA`` module holding the
original as ``base_layer``, so the model's parameter names gain ``.base_layer.``
(``...qkv_proj.base_layer.weight_scale``) and ``model.load_weights`` / our module lookups no
longer find them by their checkpoint names. :func:`base_layers_in_place` puts every
``base_layer`` back at its wrapper's place for the duration of one load and restores the
wrappers after: the live tensors (which the wrappers' forward and the CUDA graphs read) are
the base layers' own and keep their storage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["base_layers_in_place", "is_lora_wrapper"]


def is_lora_wrapper(module: torch.nn.Module) -> bool:
    """True for SGLang's ``BaseLayerWithLoRA`` (and subclasses): a layer with ``base_layer``."""
    return isinstance(getattr(module, "base_layer", None), torch.nn.Module) and any(
        c.__name__ == "BaseLayerWithLoRA" for c in type(module).__mro__)


def _wrappers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    out = []
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if is_lora_wrapper(child):
                out.append((parent, child_name, child))
    return out


@contextlib.contextmanager
def base_layers_in_place(model: torch.nn.Module) -> Iterator[int]:
    """Within: every LoRA wrapper of ``model`` replaced by its ``base_layer`` (yields how
    many); after (also on error): the wrappers back."""
    found = _wrappers(model)
    for parent, name, wrapper in found:
        setattr(parent, name, wrapper.base_layer)
    try:
        yield len(found)
    finally:
        for parent, name, wrapper in found:
            setattr(parent, name, wrapper)
