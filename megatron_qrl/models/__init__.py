"""Qwen3 / Qwen3-MoE on megatron-core and the HF <-> Megatron mapping.

- :mod:`hf_config`: HF config.json -> :class:`ModelArch` (exact ``architectures`` dispatch);
- :mod:`builder`: ``TransformerConfig`` + layer spec (with a spec hook) and ``GPTModel``;
- :mod:`layout` / :mod:`mapping`: fused QKV / gate-up layouts and the parameter name table;
- :mod:`streaming`: ``iter_hf_tensors`` (sharded model -> HF pairs) and ``load_hf_weights``;
- :mod:`hf_io` / :mod:`checkpoint` / :mod:`runtime`: files, dist checkpoints, 1-rank jobs;
- :mod:`export`: an HF checkpoint quantized with a QuantSpec (the directory SGLang loads);
- :mod:`spec_tree`: copy a ``ModuleSpec`` tree for spec hooks;
- :mod:`grouped_gemm` / :mod:`stacked_experts`: one grouped GEMM over all local experts, and
  the routed experts as one stacked weight per GEMM (``--qrl-train-moe-experts stacked``).

Megatron and torch.distributed are imported lazily inside functions (``stacked_experts``,
whose classes subclass megatron-core's, imports megatron-core when it is imported).
"""

from pathlib import Path

from megatron_qrl.models.hf_config import (
    ARCHITECTURES,
    ModelArch,
    UnsupportedModelError,
    arch_from_dict,
    load_hf_config,
)
from megatron_qrl.models.mapping import ParamRule, count_parameters, expected_hf_shapes, rule_for

CONFIG_DIR = Path(__file__).resolve().parent.parent / "data" / "configs"
"""Shipped config.json files: tiny_qwen3.json, tiny_qwen3_moe.json, qwen3_30b_a3b.json."""

__all__ = [
    "ARCHITECTURES",
    "CONFIG_DIR",
    "ModelArch",
    "ParamRule",
    "UnsupportedModelError",
    "arch_from_dict",
    "count_parameters",
    "expected_hf_shapes",
    "load_hf_config",
    "rule_for",
]
