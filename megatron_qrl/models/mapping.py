"""Megatron-core parameter names <-> HF Qwen3 / Qwen3-MoE tensor names.

One table serves the conversion tools and weight sync. Names are those of the local spec
(``SequentialMLP`` experts: ``mlp.experts.local_experts.{j}``); Transformer Engine spec names
(fused layer norms, ``TEGroupedMLP`` ``weight{j}``) are first mapped to the local ones by
:func:`canonical_name` — the same aliasing as Megatron's ``sharded_state_dict_keys_map``. Stacked expert weights
(``models.stacked_experts``: one ``[experts, out, in]`` parameter per GEMM) are named per expert
by :func:`per_expert_named` before they meet this table.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_qrl.models.hf_config import ModelArch
from megatron_qrl.models.layout import global_expert_index
from megatron_qrl.utils.hf_names import fusion_group

if TYPE_CHECKING:
    import torch

KINDS = ("replicated", "column", "row", "qkv", "gate_up")


@dataclass(frozen=True)
class ParamRule:
    """How one Megatron parameter is made of HF tensors."""

    kind: str
    """One of :data:`KINDS`: how the tensor is fused and split across tensor-parallel ranks."""
    hf_names: tuple[str, ...]
    """HF tensors fused into it (qkv: q, k, v; gate_up: gate, up; otherwise one)."""
    expert: bool = False
    """Expert weights are sharded over the expert-parallel and expert-TP groups, not TP."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ParamRule.kind={self.kind!r} not in {KINDS}")


_TE_ALIASES = (
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
    (re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)$"),
     r"mlp.experts.local_experts.\2.\1.weight"),
)
_STACKED = re.compile(r"(^|\.)mlp\.experts\.linear_fc[12]\.weight$")
_LAYER = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def canonical_name(name: str) -> str:
    """Map a Transformer Engine spec parameter name to the local spec name (idempotent)."""
    for pattern, repl in _TE_ALIASES:
        name = pattern.sub(repl, name)
    return name


def per_expert_named(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` with every stacked expert weight ``...mlp.experts.linear_fc{1,2}.weight``
    ``[E, out, in]`` replaced by its experts ``(...weight{i}, stacked[i])`` (views: reading
    or writing them reads or writes the stack); everything else passes unchanged."""
    for name, tensor in named:
        if tensor.dim() == 3 and _STACKED.search(name):
            for i, view in enumerate(tensor.unbind(0)):
                yield f"{name}{i}", view
        else:
            yield name, tensor


def _members(hf_name: str) -> tuple[str, ...]:
    """The HF tensors Megatron fuses with ``hf_name`` (q/k/v; gate/up), in Megatron's order."""
    return fusion_group(hf_name)[1]


def _layer_rule(arch: ModelArch, layer: int, rest: str, ep_rank: int,
                num_local_experts: int) -> ParamRule:
    p = f"model.layers.{layer}."
    table = {
        "input_layernorm.weight": ("replicated", (p + "input_layernorm.weight",)),
        "self_attention.linear_qkv.weight": ("qkv", _members(p + "self_attn.q_proj.weight")),
        "self_attention.q_layernorm.weight": ("replicated", (p + "self_attn.q_norm.weight",)),
        "self_attention.k_layernorm.weight": ("replicated", (p + "self_attn.k_norm.weight",)),
        "self_attention.linear_proj.weight": ("row", (p + "self_attn.o_proj.weight",)),
        "pre_mlp_layernorm.weight": ("replicated", (p + "post_attention_layernorm.weight",)),
    }
    if arch.is_moe:
        table["mlp.router.weight"] = ("replicated", (p + "mlp.gate.weight",))
    else:
        table["mlp.linear_fc1.weight"] = ("gate_up", _members(p + "mlp.gate_proj.weight"))
        table["mlp.linear_fc2.weight"] = ("row", (p + "mlp.down_proj.weight",))
    if rest in table:
        kind, names = table[rest]
        return ParamRule(kind, names)
    match = _EXPERT.match(rest)
    if match and arch.is_moe:
        e = global_expert_index(int(match.group(1)), ep_rank, num_local_experts)
        q = f"{p}mlp.experts.{e}."
        if match.group(2) == "linear_fc1":
            return ParamRule("gate_up", _members(q + "gate_proj.weight"), True)
        return ParamRule("row", (q + "down_proj.weight",), True)
    raise KeyError(f"no HF mapping for Megatron parameter decoder.layers.{layer}.{rest} "
                   f"of {arch.architecture}")


def rule_for(name: str, arch: ModelArch, ep_rank: int = 0,
             num_local_experts: int | None = None) -> ParamRule:
    """The :class:`ParamRule` of Megatron parameter ``name`` held by expert-parallel rank ``ep_rank``."""
    name = canonical_name(name)
    n_local = arch.num_experts if num_local_experts is None else num_local_experts
    layer = _LAYER.match(name)
    if layer:
        return _layer_rule(arch, int(layer.group(1)), layer.group(2), ep_rank, n_local)
    name = re.sub(r"^(?:module\.)+", "", name)
    if name == "embedding.word_embeddings.weight":
        return ParamRule("column", ("model.embed_tokens.weight",))
    if name == "decoder.final_layernorm.weight":
        return ParamRule("replicated", ("model.norm.weight",))
    if name == "output_layer.weight" and not arch.tie_word_embeddings:
        return ParamRule("column", ("lm_head.weight",))
    raise KeyError(f"no HF mapping for Megatron parameter {name} of {arch.architecture}")


def expected_hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of ``arch`` with its shape, in checkpoint order (lm_head only if untied)."""
    h, d = arch.hidden_size, arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (arch.num_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (arch.num_kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (arch.num_kv_heads * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, arch.num_heads * d)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if arch.is_moe:
            f = arch.moe_ffn_hidden_size
            shapes[p + "mlp.gate.weight"] = (arch.num_experts, h)
            for e in range(arch.num_experts):
                q = f"{p}mlp.experts.{e}."
                shapes[q + "gate_proj.weight"] = (f, h)
                shapes[q + "up_proj.weight"] = (f, h)
                shapes[q + "down_proj.weight"] = (h, f)
        else:
            f = arch.ffn_hidden_size
            shapes[p + "mlp.gate_proj.weight"] = (f, h)
            shapes[p + "mlp.up_proj.weight"] = (f, h)
            shapes[p + "mlp.down_proj.weight"] = (h, f)
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


def count_parameters(arch: ModelArch) -> tuple[int, int]:
    """``(total, active)`` parameters; active counts only ``moe_top_k`` experts per layer."""
    total = 0
    for shape in expected_hf_shapes(arch).values():
        numel = 1
        for s in shape:
            numel *= s
        total += numel
    inactive = 0
    if arch.is_moe:
        per_expert = 3 * arch.hidden_size * arch.moe_ffn_hidden_size
        inactive = arch.num_layers * (arch.num_experts - arch.moe_top_k) * per_expert
    return total, total - inactive
