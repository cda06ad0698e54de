"""UAQ: update-aware quantization by invariant rescaling (QuRL, eq. 10-12).

QuRL (seed 000, section "UAQ") observes that one RL step changes a weight by about
``alpha * G`` (eq. 10; ~1e-7..1e-6 at lr 1e-6) while INT8/FP8 rounding moves it by about
``|W| / 2^b``: the quantized rollout actor never sees the update. UAQ uses the invariance of
a linear layer under a scale ``s`` moved into its input (eq. 11)::

    W X = (W / s) (s X)

and absorbs ``s`` into the RMSNorm gain that produces ``X``. Chosen with ``s > 1`` (eq. 12)
the per-channel quantization error of ``W / s`` shrinks by ``s`` and, under SGD, the update
grows by ``s`` (``grad_W = grad_Y X^T`` and ``X`` grew by ``s``): a net ``s^2`` gain of
update over rounding step. **With Adam the update is scale-free** (Adam normalises the
gradient), so the update keeps its size while the rounding step shrinks by ``s``: the net
gain is about ``s``, not ``s^2``. QuRL uses ``s = 1.5`` and turns UAQ off at lr >= 1e-5
(the update is then already large enough); :func:`default_uaq_scale` encodes that default.

In a Qwen3 / Qwen3-MoE decoder layer (HF names, ``model.layers.{i}.``):

* ``input_layernorm.weight *= s``; ``self_attn.{q,k,v}_proj.weight /= s`` (``q_norm`` and
  ``k_norm`` act after the projections and RMS-normalise away any scale: unchanged);
* ``post_attention_layernorm.weight *= s``; every consumer of its output ``/= s``: dense
  ``mlp.{gate,up}_proj``, EVERY expert's gate/up (``mlp.experts.{e}.{gate,up}_proj`` in
  checkpoints, the fused ``mlp.experts.gate_up_proj`` of transformers >= 5 in memory), a
  shared expert's gate/up and its ``shared_expert_gate`` (Qwen2-MoE style), and the ROUTER
  ``mlp.gate.weight``. An unscaled router sees logits ``s * z``: the top-k experts are the
  same (a positive scale keeps the order) but the softmax routing weights sharpen, so the
  output changes.

Biases, ``o_proj``, ``down_proj``, embeddings, the final norm and ``lm_head`` are
unchanged, so the logits are identical up to fp rounding. Applying ``1 / s`` undoes UAQ.
A checkpoint records ``{"uaq_scale": s}`` (:func:`uaq_metadata`) so that
:func:`check_not_already_scaled` can refuse to scale it twice.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_UAQ_SCALE",
    "UAQ_MAX_LR",
    "UAQ_METADATA_KEY",
    "AlreadyScaledError",
    "apply_uaq",
    "apply_uaq_to_model",
    "check_not_already_scaled",
    "default_uaq_scale",
    "read_uaq_scale",
    "uaq_metadata",
    "uaq_plan",
    "validate_uaq_scale",
]

DEFAULT_UAQ_SCALE = 1.5
"""QuRL's scale (ablation: 1.5 beats 1 and 2 on AIME24 at lr 1e-6)."""

UAQ_MAX_LR = 1e-5
"""QuRL turns UAQ off at this learning rate and above."""

UAQ_METADATA_KEY = "uaq_scale"
"""Checkpoint metadata key recording the UAQ scale already applied to the weights."""

_MUL, _DIV, _KEEP = "mul", "div", "keep"


@dataclass(frozen=True)
class _ArchRules:
    """What a decoder layer of one HF architecture holds."""

    qk_norm: bool
    moe: bool


# exact HF `architectures` names (no substring dispatch)
_ARCHITECTURES: dict[str, _ArchRules] = {
    "Qwen3ForCausalLM": _ArchRules(qk_norm=True, moe=False),
    "Qwen3MoeForCausalLM": _ArchRules(qk_norm=True, moe=True),
    "Qwen2ForCausalLM": _ArchRules(qk_norm=False, moe=False),
    "Qwen2MoeForCausalLM": _ArchRules(qk_norm=False, moe=True),
}


class AlreadyScaledError(ValueError):
    """The checkpoint's metadata says UAQ was already applied to it."""


def validate_uaq_scale(scale: float) -> float:
    """Return ``scale`` as a float, or raise if it is not a finite number > 0."""
    ok = isinstance(scale, numbers.Real) and not isinstance(scale, bool)
    if not ok or not math.isfinite(float(scale)) or float(scale) <= 0.0:
        raise ValueError(
            f"UAQ scale (--qrl-uaq-scale / --uaq-scale) must be a finite number > 0, got "
            f"{scale!r}; QuRL uses {DEFAULT_UAQ_SCALE}, and 1 disables UAQ"
        )
    return float(scale)


def default_uaq_scale(lr: float) -> float:
    """QuRL's default: ``s = 1.5`` when ``lr < 1e-5``, else 1 (UAQ off; paper, GSM8K runs)."""
    if not isinstance(lr, numbers.Real) or not math.isfinite(float(lr)) or lr <= 0:
        raise ValueError(f"learning rate must be a finite number > 0, got {lr!r}")
    return DEFAULT_UAQ_SCALE if lr < UAQ_MAX_LR else 1.0


def uaq_metadata(scale: float) -> dict[str, float]:
    """The metadata a converted checkpoint records: ``{"uaq_scale": s}``.

    safetensors metadata holds strings only: store ``str(s)``; :func:`read_uaq_scale`
    parses a number or a string.
    """
    return {UAQ_METADATA_KEY: validate_uaq_scale(scale)}


def read_uaq_scale(meta: Mapping[str, object] | None) -> float:
    """The UAQ scale recorded in checkpoint metadata; 1.0 when none is recorded.

    ``None`` (the converter writes ``"uaq_scale": null`` for an unscaled checkpoint) counts
    as not recorded.
    """
    if not meta or meta.get(UAQ_METADATA_KEY) is None:
        return 1.0
    raw = meta[UAQ_METADATA_KEY]
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(
            f"checkpoint metadata {UAQ_METADATA_KEY!r} must be a number, got {raw!r}"
        ) from None
    return validate_uaq_scale(value)


def check_not_already_scaled(meta: Mapping[str, object] | None, source: str = "checkpoint") -> None:
    """Raise :class:`AlreadyScaledError` if ``meta`` records a UAQ scale other than 1.

    Applying UAQ twice compounds the scale (``s * s'``) silently; ``source`` names the
    checkpoint in the message.
    """
    scale = read_uaq_scale(meta)
    if scale != 1.0:
        raise AlreadyScaledError(
            f"{source} is already UAQ-scaled ({UAQ_METADATA_KEY}={scale}); applying UAQ again "
            f"would compound the scale. Convert from the unscaled HF checkpoint, or drop "
            f"--uaq-scale / --qrl-uaq-scale for this one"
        )


def _cfg(config: Mapping[str, object], key: str) -> object:
    if key not in config:
        raise ValueError(f"UAQ: config.json lacks {key!r}; pass the model's HF config dict")
    return config[key]


def _num_experts(config: Mapping[str, object]) -> int:
    # Qwen3-30B-A3B's config.json says num_experts; transformers 5 writes num_local_experts
    for key in ("num_experts", "num_local_experts"):
        if config.get(key) is not None:
            return int(config[key])  # type: ignore[arg-type]
    raise ValueError("UAQ: MoE config.json lacks 'num_experts' (or 'num_local_experts')")


def _is_sparse(layer: int, config: Mapping[str, object], rules: _ArchRules) -> bool:
    """HF Qwen2/3-MoE rule: a layer is MoE unless listed in mlp_only_layers."""
    if not rules.moe or _num_experts(config) <= 0:
        return False
    mlp_only = config.get("mlp_only_layers") or []
    step = int(config.get("decoder_sparse_step") or 1)  # type: ignore[arg-type]
    return layer not in mlp_only and (layer + 1) % step == 0


def _moe_plan(p: str, config: Mapping[str, object], names: set[str]) -> dict[str, str]:
    plan = {p + "gate.weight": _DIV}  # the router reads post_attention_layernorm too
    if p + "experts.gate_up_proj" in names:  # transformers >= 5 in-memory fused experts
        plan.update({p + "experts.gate_up_proj": _DIV, p + "experts.down_proj": _KEEP})
    else:  # checkpoint layout: one module per expert
        for e in range(_num_experts(config)):
            q = f"{p}experts.{e}."
            plan.update({q + "gate_proj.weight": _DIV, q + "up_proj.weight": _DIV})
            plan[q + "down_proj.weight"] = _KEEP
    if int(config.get("shared_expert_intermediate_size") or 0) > 0:  # type: ignore[arg-type]
        q = p + "shared_expert."
        plan.update({q + "gate_proj.weight": _DIV, q + "up_proj.weight": _DIV})
        plan[q + "down_proj.weight"] = _KEEP
        plan[p + "shared_expert_gate.weight"] = _DIV  # sigmoid(gate . x) reads x as well
    return plan


def _layer_plan(
    i: int, config: Mapping[str, object], rules: _ArchRules, names: set[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """(required, optional) tensor name -> action for decoder layer ``i``."""
    p = f"model.layers.{i}."
    req = {p + "input_layernorm.weight": _MUL, p + "post_attention_layernorm.weight": _MUL}
    for proj in ("q", "k", "v"):
        req[f"{p}self_attn.{proj}_proj.weight"] = _DIV
    req[p + "self_attn.o_proj.weight"] = _KEEP
    if rules.qk_norm:
        req.update({p + "self_attn.q_norm.weight": _KEEP, p + "self_attn.k_norm.weight": _KEEP})
    opt = {f"{p}self_attn.{proj}_proj.bias": _KEEP for proj in ("q", "k", "v", "o")}
    if _is_sparse(i, config, rules):
        req.update(_moe_plan(p + "mlp.", config, names))
    else:
        req.update({p + "mlp.gate_proj.weight": _DIV, p + "mlp.up_proj.weight": _DIV})
        req[p + "mlp.down_proj.weight"] = _KEEP
    return req, opt


def uaq_plan(names: Iterable[str], config: Mapping[str, object]) -> dict[str, str]:
    """Map every tensor name to ``"mul"``, ``"div"`` or ``"keep"`` for UAQ.

    Raises ``ValueError`` naming the tensor when one the config implies is missing or one
    is not part of the architecture (a wrong config or a foreign state dict would otherwise
    break the invariance silently), and naming ``architectures`` when it is unsupported.
    """
    names = set(names)
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, (list, tuple)) and archs else None
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"UAQ: config.json 'architectures'={archs!r} is not supported; supported: "
            f"{sorted(_ARCHITECTURES)}"
        )
    rules = _ARCHITECTURES[arch]
    req = {"model.embed_tokens.weight": _KEEP, "model.norm.weight": _KEEP}
    opt: dict[str, str] = {}
    (opt if config.get("tie_word_embeddings") else req)["lm_head.weight"] = _KEEP
    for i in range(int(_cfg(config, "num_hidden_layers"))):  # type: ignore[arg-type]
        layer_req, layer_opt = _layer_plan(i, config, rules, names)
        req.update(layer_req)
        opt.update(layer_opt)
    missing = sorted(set(req) - names)
    if missing:
        raise ValueError(
            f"UAQ: state dict lacks tensor {missing[0]!r} ({len(missing)} missing) that the "
            f"{arch} config implies; check that config.json matches the checkpoint"
        )
    unknown = sorted(names - set(req) - set(opt))
    if unknown:
        raise ValueError(
            f"UAQ: unknown tensor {unknown[0]!r} ({len(unknown)} unknown) for {arch} with "
            f"{config.get('num_hidden_layers')} layers; UAQ only knows HF Qwen names"
        )
    return {name: req.get(name, opt.get(name, _KEEP)) for name in names}


@torch.no_grad()
def _scaled(name: str, tensor: torch.Tensor, action: str, scale: float) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise ValueError(f"UAQ: tensor {name!r} has dtype {tensor.dtype}, expected floating")
    wide = tensor.to(torch.float32)  # one rounding back to the storage dtype
    out = wide * scale if action == _MUL else wide / scale
    return out.to(tensor.dtype)


def apply_uaq(
    state_dict: Mapping[str, torch.Tensor], config: Mapping[str, object], scale: float
) -> dict[str, torch.Tensor]:
    """UAQ (QuRL eq. 11-12) on an HF-named state dict; returns a NEW dict.

    ``config`` is the HF ``config.json`` dict (``architectures`` picks the layout: Qwen3,
    Qwen3-MoE, Qwen2, Qwen2-MoE with a shared expert). Norm gains feeding linears are
    multiplied by ``scale`` and those linears (q/k/v, gate/up of the dense MLP, of every
    expert and of the shared expert, the shared-expert gate and the router) are divided by
    it, computed in fp32 and rounded once to each tensor's dtype. The input is never
    modified; tensors UAQ leaves alone are shared with it, not copied. Both the per-expert
    checkpoint layout and transformers' fused ``experts.gate_up_proj`` are accepted.
    """
    scale = validate_uaq_scale(scale)
    plan = uaq_plan(state_dict.keys(), config)
    return {
        name: t if plan[name] == _KEEP else _scaled(name, t, plan[name], scale)
        for name, t in state_dict.items()
    }


def apply_uaq_to_model(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """UAQ in place on a transformers model (``Qwen3ForCausalLM`` etc.); returns it.

    The architecture is the model's class name; the rest comes from ``model.config``.
    """
    scale = validate_uaq_scale(scale)
    config = dict(model.config.to_dict())
    config["architectures"] = [type(model).__name__]
    tensors = model.state_dict()  # shares storage with the parameters
    plan = uaq_plan(tensors.keys(), config)
    with torch.no_grad():
        for name, tensor in tensors.items():
            if plan[name] != _KEEP:
                tensor.copy_(_scaled(name, tensor, plan[name], scale))
    return model
