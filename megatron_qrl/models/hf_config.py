"""Parse an HF ``config.json`` of a supported architecture into one validated description.

The HF ``architectures`` name selects the parser from :data:`ARCHITECTURES` by exact match
(no substring dispatch). Both the ``transformers`` 4.x spelling (``rope_theta``,
``num_experts``) and the 5.x spelling (``rope_parameters``, ``num_local_experts``) are read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class UnsupportedModelError(ValueError):
    """The HF config names an architecture or a feature this package cannot convert.

    ``fields``: the config.json keys at fault, so a caller that set them from other flags
    (e.g. Megatron's ``--moe-router-topk`` -> ``num_experts_per_tok``) can name its flags.
    """

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = tuple(fields)


_CONFIG_KEY = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads", "ffn_hidden_size": "intermediate_size",
               "num_experts": "num_experts", "moe_top_k": "num_experts_per_tok",
               "moe_ffn_hidden_size": "moe_intermediate_size"}
"""ModelArch field -> the config.json key it is read from (where the names differ)."""


@dataclass(frozen=True)
class ModelArch:
    """Shapes and options of a Qwen3-family decoder, independent of any parallel layout."""

    architecture: str
    """The exact HF ``architectures[0]`` name, e.g. ``Qwen3MoeForCausalLM``."""
    vocab_size: int
    """Rows of the embedding and of the output layer."""
    hidden_size: int
    """Residual stream width."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA query groups); must divide ``num_heads``."""
    head_dim: int
    """Width of one attention head (``kv_channels`` in Megatron)."""
    ffn_hidden_size: int
    """Dense MLP intermediate size (unused by MoE layers)."""
    rms_norm_eps: float
    """RMSNorm epsilon for every norm, QK-norms included."""
    rope_theta: float
    """RoPE base (non-interleaved rotate-half layout, as in HF Qwen3)."""
    tie_word_embeddings: bool
    """Whether the output layer reuses the embedding matrix."""
    max_position_embeddings: int
    """Longest sequence the RoPE tables are built for."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 means a dense model."""
    moe_top_k: int = 0
    """Experts chosen per token."""
    moe_ffn_hidden_size: int = 0
    """Intermediate size of one expert."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to one."""
    router_aux_loss_coef: float = 0.0
    """Load-balancing loss coefficient from the HF config."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "ffn_hidden_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                key = _CONFIG_KEY.get(name, name)
                raise UnsupportedModelError(
                    f"config.json: {key} must be > 0, got {getattr(self, name)}", (key,))
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"config.json: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}",
                ("num_attention_heads", "num_key_value_heads"))
        if self.num_experts and not (0 < self.moe_top_k <= self.num_experts):
            raise UnsupportedModelError(
                f"config.json: num_experts_per_tok={self.moe_top_k} must be in [1, num_experts="
                f"{self.num_experts}]", ("num_experts_per_tok", "num_experts"))
        if self.num_experts and self.moe_ffn_hidden_size <= 0:
            raise UnsupportedModelError("config.json: moe_intermediate_size must be > 0 for MoE",
                                        ("moe_intermediate_size",))

    @property
    def is_moe(self) -> bool:
        """True when every decoder layer is a routed-expert MoE layer."""
        return self.num_experts > 0


def _get(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is None:
        raise UnsupportedModelError(f"config.json: missing field {names[0]!r}", (names[0],))
    return default


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(
            f"config.json: rope type {rope_type!r} is not supported (only plain RoPE); drop "
            "rope_scaling / rope_parameters.rope_type or use a model without RoPE scaling")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise UnsupportedModelError("config.json: missing rope_theta (or rope_parameters.rope_theta)",
                                    ("rope_theta",))
    return float(theta)


def _common(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("attention_bias"):
        raise UnsupportedModelError("config.json: attention_bias=true is not supported for Qwen3")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"config.json: hidden_act={cfg['hidden_act']!r}, expected 'silu'")
    heads = int(_get(cfg, "num_attention_heads"))
    hidden = int(_get(cfg, "hidden_size"))
    return dict(
        architecture=cfg["architectures"][0],
        vocab_size=int(_get(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_get(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(_get(cfg, "head_dim", default=hidden // heads)),
        ffn_hidden_size=int(_get(cfg, "intermediate_size")),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", default=1e-6)),
        rope_theta=_rope_theta(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings")),
    )


def _parse_qwen3(cfg: dict[str, Any]) -> ModelArch:
    return ModelArch(**_common(cfg))


def _parse_qwen3_moe(cfg: dict[str, Any]) -> ModelArch:
    layers = int(_get(cfg, "num_hidden_layers"))
    step = int(cfg.get("decoder_sparse_step", 1))
    dense_layers = list(cfg.get("mlp_only_layers") or [])
    if step != 1 or dense_layers:
        raise UnsupportedModelError(
            f"config.json: mixed dense/MoE layers (decoder_sparse_step={step}, mlp_only_layers="
            f"{dense_layers}) are not supported; every layer of {layers} must be MoE")
    if cfg.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("config.json: Qwen3-MoE with a shared expert is not supported")
    return ModelArch(
        **_common(cfg),
        num_experts=int(_get(cfg, "num_experts", "num_local_experts")),
        moe_top_k=int(_get(cfg, "num_experts_per_tok")),
        moe_ffn_hidden_size=int(_get(cfg, "moe_intermediate_size")),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
    )


ARCHITECTURES: dict[str, Callable[[dict[str, Any]], ModelArch]] = {
    "Qwen3ForCausalLM": _parse_qwen3,
    "Qwen3MoeForCausalLM": _parse_qwen3_moe,
}
"""Exact HF ``architectures`` name -> parser of its config.json."""


def arch_from_dict(cfg: dict[str, Any], source: str = "config.json") -> ModelArch:
    """Return the :class:`ModelArch` of an HF config dict; the architecture name must match exactly."""
    names = cfg.get("architectures") or []
    if len(names) != 1:
        raise UnsupportedModelError(
            f"{source}: 'architectures' must list exactly one name, got {names!r}")
    if names[0] not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: unknown architecture {names[0]!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[names[0]](cfg)


def load_hf_config(hf_dir: str | Path) -> tuple[dict[str, Any], ModelArch]:
    """Read ``hf_dir/config.json`` (or ``hf_dir`` itself if it is a .json file)."""
    path = Path(hf_dir)
    path = path if path.suffix == ".json" else path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --hf-dir must be an HF model directory "
                                "containing config.json and *.safetensors")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as exc:
        raise UnsupportedModelError(f"{path}: not valid JSON ({exc}); fix or restore the file") from None
    if not isinstance(cfg, dict):
        raise UnsupportedModelError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg, arch_from_dict(cfg, str(path))
