"""HF Qwen3 / Qwen3-MoE tensor names: the one parser (layer, module, expert, projection, leaf).

Every name the package reads or writes is an HF checkpoint name such as::

    model.layers.3.self_attn.q_proj.weight          attention projection
    model.layers.3.mlp.gate_proj.weight             dense MLP projection
    model.layers.3.mlp.experts.17.up_proj.weight    one expert's projection
    model.layers.3.mlp.experts.*.up_proj.weight     all experts of a layer, stacked [E, ...]
    model.layers.3.mlp.shared_expert.down_proj.weight
    model.layers.3.self_attn.q_proj.weight_scale    a packed tensor (the leaf varies)

:func:`parse` splits a projection's name into those parts; :func:`layer_prefix`,
:func:`stacked_name`, :func:`expert_name` and :func:`fusion_group` are built on it. The serving
engines (SGLang, vLLM) fuse q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``
(:data:`FUSED`; an expert's gate/up/down load into the layer's one ``experts`` module), as
Megatron fuses them into ``linear_qkv`` / ``linear_fc1``.

This module sits in ``utils`` (below every package that reads names: quantization targets,
the pack stream, ``models``, the rollout engines and the sync) and imports nothing of the
package, so the weight sync's protocol (:mod:`megatron_qrl.sync.protocol`) parses names
without loading the quantization registry.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = [
    "FUSED",
    "FUSION_MEMBERS",
    "HFName",
    "STACKED",
    "expert_name",
    "expert_names",
    "fusion_group",
    "is_projection_weight",
    "layer_prefix",
    "parse",
    "stacked_name",
]

FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
"""Projection -> the fused module the serving engine loads it into."""
FUSION_MEMBERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                  "gate_up_proj": ("gate_proj", "up_proj")}
"""Fused module -> its members, in the engine's (and Megatron's) order."""
STACKED = "*"
"""The expert index of a stacked name: all experts of the layer, ``[E, ...]``."""

_ATTN = "q_proj|k_proj|v_proj|o_proj"
_MLP = "gate_proj|up_proj|down_proj"


def _grammar(expert: str, leaf: str) -> re.Pattern:
    """The one grammar of a projection tensor's name; the module group that matched tells the
    alternatives apart. ``expert`` / ``leaf``: what an expert index / the leaf may be."""
    return re.compile(
        r"^(?P<prefix>.*\.)(?:"
        rf"(?P<attn>self_attn)\.(?P<attn_proj>{_ATTN})"
        rf"|(?P<mlp>mlp)\.(?P<mlp_proj>{_MLP})"
        rf"|(?P<experts>mlp\.experts)\.(?P<expert>{expert})\.(?P<experts_proj>{_MLP})"
        rf"|(?P<shared>mlp\.shared_expert)\.(?P<shared_proj>{_MLP})"
        rf")\.(?P<leaf>{leaf})$"
    )


_PROJECTION = _grammar(r"\d+|\*", r"[^.]+")
_PROJECTION_WEIGHT = re.compile(re.sub(r"\(\?P<\w+>", "(?:", _grammar(r"\d+", "weight").pattern))
"""The grammar with one expert and the ``weight`` leaf, without capturing groups: one match per
tensor (the per-tensor hot paths of the pack stream and the sync)."""
_EXPERT_INDEX = re.compile(rf"^(?P<head>.*\.mlp\.experts\.)\d+(?P<tail>\.(?:{_MLP})\.[^.]+)$")
"""An expert projection name around its index (:func:`stacked_name`, per tensor)."""
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_KINDS = {"self_attn": "attention", "mlp": "mlp", "mlp.experts": "experts",
          "mlp.shared_expert": "shared_expert"}


class HFName(NamedTuple):
    """The parts of a projection tensor's HF name.

    ``model.layers.3.mlp.experts.17.up_proj.weight`` ->
    ``HFName(prefix="model.layers.3.", module="mlp.experts", expert=17, proj="up_proj",
    leaf="weight")``; ``expert`` is None outside experts and :data:`STACKED` for a stack.
    ``str()`` gives the name back; ``_replace(expert=3)`` another tensor of the same family.
    """

    prefix: str
    """Everything before the module, with its trailing dot (``model.layers.3.``)."""
    module: str
    """``self_attn`` | ``mlp`` | ``mlp.experts`` | ``mlp.shared_expert``."""
    expert: int | str | None
    proj: str
    """``q_proj`` ... ``o_proj``, ``gate_proj`` | ``up_proj`` | ``down_proj``."""
    leaf: str
    """``weight``, or a packed tensor's suffix (``weight_scale``, ``input_scale``, ...)."""

    @property
    def layer(self) -> int | None:
        """The decoder layer index, or None."""
        m = _LAYER.search(self.prefix)
        return int(m[1]) if m else None

    @property
    def kind(self) -> str:
        """``attention`` / ``mlp`` / ``experts`` / ``shared_expert`` (``targets.LAYER_KINDS``)."""
        return _KINDS[self.module]

    @property
    def is_stacked(self) -> bool:
        return self.expert == STACKED

    @property
    def owner(self) -> str:
        """The module holding the projection (``model.layers.3.mlp.experts.17``)."""
        base = f"{self.prefix}{self.module}"
        return base if self.expert is None else f"{base}.{self.expert}"

    @property
    def experts_module(self) -> str | None:
        """The layer's experts module (``model.layers.3.mlp.experts``), or None."""
        return f"{self.prefix}{self.module}" if self.expert is not None else None

    @property
    def engine_module(self) -> str:
        """The serving engine's module this tensor loads into: q/k/v -> ``...qkv_proj``,
        gate/up -> ``...gate_up_proj``, any expert tensor -> the layer's ``...mlp.experts``."""
        if self.expert is not None:
            return f"{self.prefix}{self.module}"
        return f"{self.owner}.{FUSED.get(self.proj, self.proj)}"

    def __str__(self) -> str:
        return f"{self.owner}.{self.proj}.{self.leaf}"


def parse(name: str) -> HFName | None:
    """The parts of a projection tensor's name (any leaf); None for any other tensor
    (embeddings, norms, the MoE router, ``lm_head``)."""
    m = _PROJECTION.match(name)
    if m is None:
        return None
    module = "attn" if m["attn"] else "mlp" if m["mlp"] else "experts" if m["experts"] \
        else "shared"
    expert = m["expert"]
    if expert is not None and expert != STACKED:
        expert = int(expert)
    return HFName(m["prefix"], m[module], expert, m[f"{module}_proj"], m["leaf"])


def is_projection_weight(name: str) -> bool:
    """True for the ``weight`` of one projection (not a stack, not a packed tensor): what
    :func:`parse` accepts with ``leaf == "weight"`` and a numeric expert index, if any."""
    return _PROJECTION_WEIGHT.match(name) is not None


def layer_prefix(name: str) -> str | None:
    """``model.layers.3.mlp.gate.weight`` -> ``model.layers.3.``; None outside decoder layers."""
    m = _LAYER.search(name)
    return name[: m.end()] if m else None


def stacked_name(name: str) -> str:
    """The name with the expert index starred (every expert's ``gate_proj`` is one kind);
    any other name unchanged."""
    m = _EXPERT_INDEX.match(name)
    return name if m is None else f"{m['head']}{STACKED}{m['tail']}"


def expert_name(name: str, expert: int) -> str:
    """The name of expert ``expert``'s tensor of an expert (or stacked) name."""
    return expert_names(name, expert + 1)[expert]


def expert_names(name: str, experts: int) -> list[str]:
    """The names of experts ``0 .. experts-1``'s tensors of an expert (or stacked) name
    (parsed once: the rows of a stack)."""
    p = parse(name)
    if p is None or p.expert is None:
        raise ValueError(f"{name!r} is not an expert tensor (...mlp.experts.<i|*>.<proj>.<leaf>)")
    head, tail = f"{p.prefix}{p.module}.", f".{p.proj}.{p.leaf}"
    return [f"{head}{e}{tail}" for e in range(experts)]


def fusion_group(name: str, weights_only: bool = False
                 ) -> tuple[str, tuple[str, ...]] | None:
    """``(owner prefix, member names)`` of the fused module a q/k/v or gate/up tensor belongs
    to, members in :data:`FUSION_MEMBERS` order with ``name``'s leaf; None otherwise
    (``...experts.3.up_proj.weight`` -> ``("...experts.3.", ("...experts.3.gate_proj.weight",
    "...experts.3.up_proj.weight"))``). ``weights_only``: None unless
    :func:`is_projection_weight` (the quantized weights of ``quant.targets``)."""
    m = _PROJECTION.match(name)
    if m is None or (weights_only and (m["leaf"] != "weight" or m["expert"] == STACKED)):
        return None
    proj = m["attn_proj"] or m["mlp_proj"] or m["experts_proj"] or m["shared_proj"]
    fused = FUSED.get(proj)
    if fused is None:
        return None
    leaf = m["leaf"]
    base = name[: m.start("leaf") - 1 - len(proj)]
    return base, tuple(f"{base}{member}.{leaf}" for member in FUSION_MEMBERS[fused])
