"""The QuantSpec: one frozen object per format, from which every consumer is derived.

One spec gives (docs/DESIGN.md, "One spec per format"):
1. the exact reference quantizer (pure torch, CPU): :meth:`QuantSpec.quantize_weight`,
   :meth:`QuantSpec.dequantize`, :meth:`QuantSpec.fake_quant_weight`,
   :meth:`QuantSpec.fake_quant_activation`; :meth:`QuantSpec.quantize_dequantize` is
   ``dequantize(quantize_weight(w))`` through the format's fake-quant fast path (same bits);
2. the rollout side: the SGLang ``--quantization`` method, :meth:`QuantSpec.pack` (the tensors
   SGLang's loader expects, names and dtypes) and :meth:`QuantSpec.hf_quantization_config`;
3. the training side (``te_quant``) uses 1. with a straight-through gradient;
4. :meth:`QuantSpec.modelopt_config` for PTQ/export and numerics cross-checks;
5. :attr:`QuantSpec.engine`: what the engines do with it (SGLang sync paths, TE recipe, MoE
   kernel flags, LoRA serving; :mod:`.engine_facts`), declared on the format.
One weight's numerics live in :class:`~megatron_qrl.quant.spec_core.SpecCore`, the stream
packing in :mod:`.pack_stream`; this module adds the registry.
The contract held by the tests: ``dequantize(unpack(pack(w))) == fake_quant_weight(w)`` bit
for bit, for every format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from .engine_facts import EngineFacts
from .pack_stream import pack_state_dict
from .spec_core import SpecCore
from .weight import QuantizedWeight

__all__ = ["QuantSpec", "QuantizedWeight", "get_spec", "list_specs", "register_spec"]


@dataclass(frozen=True)
class QuantSpec(SpecCore):
    """A quantization format, identical for the rollout engine and the trainer.

    Each format is a frozen dataclass subclass that sets the fields' defaults and implements
    the hooks of :class:`~megatron_qrl.quant.spec_core.SpecCore` (its numerics of one weight);
    this class adds the packing of a whole stream (:mod:`.pack_stream`). Instances are created
    once by :func:`register_spec`; obtain them with ``get_spec(name)``.
    """

    engine: ClassVar[EngineFacts | None] = None
    """What the engines do with this format (:mod:`.engine_facts`); every registered format
    declares it."""

    def pack_state_dict(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        window_bytes: int = 1 << 30,
        stacked: bool = True,
        stack_experts: bool = False,
        quantized: Callable[[str], QuantizedWeight | None] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream-pack ``(hf_name, tensor)`` pairs (weight sync, export):
        :func:`megatron_qrl.quant.pack_stream.pack_state_dict` of this format (``quantized``:
        the weights' quantizations where computed already)."""
        return pack_state_dict(self, named_tensors, window_bytes=window_bytes, stacked=stacked,
                               stack_experts=stack_experts, quantized=quantized)


_REGISTRY: dict[str, QuantSpec] = {}


def register_spec(cls: type[QuantSpec]) -> type[QuantSpec]:
    """Class decorator: instantiate the format once and add it to the registry (a format
    registered twice, or without its engine facts, is refused)."""
    name = cls.name
    if name in _REGISTRY:
        raise ValueError(f"quantization format {name!r} is already registered")
    _check_engine_facts(cls)
    _REGISTRY[name] = cls()
    return cls


def _check_engine_facts(cls: type[QuantSpec]) -> None:
    facts = cls.engine
    where = f"quantization format {cls.name!r} ({cls.__module__}.{cls.__qualname__})"
    if not isinstance(facts, EngineFacts):
        raise ValueError(
            f"{where} declares no engine facts: set `engine = EngineFacts(sglang_syncs=..., "
            "te_recipe=..., moe_kernel=..., lora_experts=...)` on the class (which SGLang sync "
            "paths work, the TE recipe, the fused-MoE kernel flags, routed-expert LoRA "
            "serving; megatron_qrl/quant/engine_facts.py)")
    if facts.te_recipe is not None and facts.te_recipe.format != cls.name:
        raise ValueError(f"{where}: its engine facts' TE recipe is for format "
                         f"{facts.te_recipe.format!r}; set TERecipe(format={cls.name!r}, ...)")


def get_spec(name: str) -> QuantSpec:
    """The registered format ``name`` (``--qrl-rollout-format``)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown quantization format {name!r}; choose one of {sorted(_REGISTRY)}"
        ) from None


def list_specs() -> list[str]:
    """Names of all registered formats, in registration order."""
    return list(_REGISTRY)
