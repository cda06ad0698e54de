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


def _get(cfg: dict[str, Any], *names: str, default: Any = None, kind: type = object) -> Any:
    """The first of ``names`` present in ``cfg`` (else ``default``), checked to be a JSON value
    of ``kind``: ``int`` (not a bool, not a string), ``float`` (an int or float) or ``bool``."""
    for name in names:
        if cfg.get(name) is not None:
            value = cfg[name]
            break
    else:
        if default is None:
            raise UnsupportedModelError(f"config.json: missing field {names[0]!r}", (names[0],))
        return default
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          bool: lambda v: isinstance(v, bool), object: lambda v: True}[kind](value)
    if not ok:
        what = {int: "an integer", float: "a number", bool: "true or false"}[kind]
        raise UnsupportedModelError(
            f"config.json: {name} must be {what}, got {value!r} ({type(value).__name__}); write "
            f"it without quotes", (name,))
    return value


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
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise UnsupportedModelError(f"config.json: rope_theta must be a number, got {theta!r} "
                                    f"({type(theta).__name__}); write it without quotes",
                                    ("rope_theta",))
    return float(theta)


def _common(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("attention_bias"):
        raise UnsupportedModelError("config.json: attention_bias=true is not supported for Qwen3")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"config.json: hidden_act={cfg['hidden_act']!r}, expected 'silu'")
    heads = _get(cfg, "num_attention_heads", kind=int)
    hidden = _get(cfg, "hidden_size", kind=int)
    return dict(
        architecture=cfg["architectures"][0],
        vocab_size=_get(cfg, "vocab_size", kind=int),
        hidden_size=hidden,
        num_layers=_get(cfg, "num_hidden_layers", kind=int),
        num_heads=heads,
        num_kv_heads=_get(cfg, "num_key_value_heads", default=heads, kind=int),
        head_dim=_get(cfg, "head_dim", default=hidden // heads if heads > 0 else 1, kind=int),
        ffn_hidden_size=_get(cfg, "intermediate_size", kind=int),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", default=1e-6, kind=float)),
        rope_theta=_rope_theta(cfg),
        tie_word_embeddings=_get(cfg, "tie_word_embeddings", default=False, kind=bool),
        max_position_embeddings=_get(cfg, "max_position_embeddings", kind=int),
    )


def _parse_qwen3(cfg: dict[str, Any]) -> ModelArch:
    experts = [k for k in ("num_experts", "num_local_experts") if cfg.get(k)]
    if experts:
        raise UnsupportedModelError(
            f"config.json: {cfg['architectures'][0]} is a dense model but {experts[0]}="
            f"{cfg[experts[0]]!r}; set architectures to Qwen3MoeForCausalLM for an MoE model, or "
            f"drop {experts[0]}", (experts[0],))
    return ModelArch(**_common(cfg))


def _parse_qwen3_moe(cfg: dict[str, Any]) -> ModelArch:
    layers = _get(cfg, "num_hidden_layers", kind=int)
    step = _get(cfg, "decoder_sparse_step", default=1, kind=int)
    dense_layers = list(cfg.get("mlp_only_layers") or [])
    if step != 1 or dense_layers:
        raise UnsupportedModelError(
            f"config.json: mixed dense/MoE layers (decoder_sparse_step={step}, mlp_only_layers="
            f"{dense_layers}) are not supported; every layer of {layers} must be MoE")
    if cfg.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("config.json: Qwen3-MoE with a shared expert is not supported")
    return ModelArch(
        **_common(cfg),
        num_experts=_get(cfg, "num_experts", "num_local_experts", kind=int),
        moe_top_k=_get(cfg, "num_experts_per_tok", kind=int),
        moe_ffn_hidden_size=_get(cfg, "moe_intermediate_size", kind=int),
        norm_topk_prob=_get(cfg, "norm_topk_prob", default=False, kind=bool),
        router_aux_loss_coef=float(_get(cfg, "router_aux_loss_coef", default=0.0, kind=float)),
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
