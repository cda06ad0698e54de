"""Calibrated post-training quantization with ModelOpt: AWQ for ``w4a16``, SmoothQuant for ``int8``.

Both methods rescale the input channels of each linear, ``y = (x / s) (W diag(s))^T``, so that
the quantized format loses less; the format's layout on disk stays exactly what the
uncalibrated export writes (the format's own packer rounds the rescaled weights), because the
inverse scale is folded into the tensor that produces ``x``:

* q/k/v (and a dense MLP's gate/up) read a RMSNorm output: one scale shared by the group
  (ModelOpt ``preprocess_linear_fusion``: the mean of the members' scales, each weight
  re-scaled to it), folded into the norm's gain (``fuse_prequant_layernorm``);
* o_proj reads the attention output, a mix of v_proj's rows: its scale (averaged over the
  query heads of one KV head) folds into v_proj's output rows (a dense MLP's down_proj into
  up_proj's rows; ModelOpt ``fuse_prequant_to_linear``).

A scale that cannot be folded is an error, never silently dropped. ModelOpt's calibration runs
on a transformers model built from the checkpoint's config (:mod:`..quant.hf_reference`) with a
forward loop over the given token-id sequences.

* AWQ (Lin et al. 2024, "AWQ: Activation-aware Weight Quantization", eq. 4-5): per linear,
  ``s = s_x^alpha`` with ``s_x`` the mean input magnitude per channel, alpha searched on a grid
  to minimise ``|| Q(W diag(s)) (diag(s)^-1 x) - W x ||`` (ModelOpt ``awq_lite``,
  ``INT4_AWQ_CFG``: INT4 blocks of 128 = our w4a16 groups).
* SmoothQuant (Xiao et al. 2023, "SmoothQuant", eq. 4): ``s_j = max|X_j|^alpha /
  max|W_j|^(1 - alpha)``, alpha = 0.5 (the paper's default), ModelOpt ``smoothquant`` with
  ``INT8_SMOOTHQUANT_CFG`` (ModelOpt's scale is the inverse, ``x * s^-1``). SGLang's
  ``w8a8_int8`` quantizes activations dynamically per token; smoothing moves the per-channel
  outliers that a per-token scale cannot follow into the weights.

There is no ``max`` calibration: no format here loads a static activation scale (the FP8
formats quantize activations dynamically per token / per token group, ``nvfp4`` is W4A16 on
Hopper with ``input_scale`` 1), and max-calibrated weight scales are the round-to-nearest ones.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..quant import get_spec
from ..quant.hf_reference import build_hf_model, hf_tensor_names, hf_tensors, load_packed_weights

__all__ = ["METHODS", "CalibrationError", "calibrate_tensors", "check_method"]


class CalibrationError(ValueError):
    """A calibration method that does not apply (format, model or data)."""


@dataclass(frozen=True)
class _Method:
    formats: tuple[str, ...]
    why: str

    def modelopt_config(self, name: str) -> dict:
        import modelopt.torch.quantization as mtq

        if name == "awq":
            return copy.deepcopy(mtq.INT4_AWQ_CFG)
        cfg = copy.deepcopy(mtq.INT8_SMOOTHQUANT_CFG)
        cfg["algorithm"] = {"method": "smoothquant", "alpha": 0.5}
        return cfg


_METHODS = {
    "awq": _Method(("w4a16",), "AWQ protects 4-bit weight groups (ModelOpt INT4_AWQ_CFG)"),
    "smoothquant": _Method(("int8",), "SmoothQuant needs 8-bit weights and activations "
                                      "(ModelOpt INT8_SMOOTHQUANT_CFG)"),
}
METHODS = ("none", *_METHODS)
"""``--calibrate`` values; ``none`` = round-to-nearest, today's export."""


def check_method(method: str, fmt: str) -> None:
    """Raise :class:`CalibrationError` (one line naming both flags) unless ``method`` applies
    to format ``fmt``."""
    if method == "none":
        return
    m = _METHODS.get(method)
    if m is None:
        raise CalibrationError(f"--calibrate {method!r} is unknown; choose from "
                               f"{', '.join(METHODS)}")
    if fmt not in m.formats:
        raise CalibrationError(
            f"--calibrate {method} does not combine with --format {fmt}: {m.why}; use "
            f"--format {' or '.join(m.formats)}, or --calibrate none")


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers)


def _fold_into_norms(model: torch.nn.Module) -> None:
    """Fold the input pre-quant scales of norm-fed groups into the norms' gains (ModelOpt's
    export helpers); then the linear-fed ones into the producing linear's rows."""
    from modelopt.torch.export.quant_utils import (
        fuse_prequant_layernorm,
        fuse_prequant_to_linear,
        preprocess_linear_fusion,
    )

    for layer in _decoder_layers(model):
        att, mlp = layer.self_attn, layer.mlp
        groups = [(layer.input_layernorm, [att.q_proj, att.k_proj, att.v_proj])]
        if hasattr(mlp, "gate_proj"):  # dense MLP (MoE experts get no scale, checked below)
            groups.append((layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj]))
        for norm, linears in groups:
            if getattr(linears[0].input_quantizer, "_pre_quant_scale", None) is None:
                continue
            preprocess_linear_fusion(linears, resmooth_only=True)
            fuse_prequant_layernorm(norm, linears)
    fuse_prequant_to_linear(model, fuse_grouped_heads=True)


def _unfolded(model: torch.nn.Module) -> list[str]:
    """Names of quantizers that still carry a pre-quant scale (an input scaling no format here
    can store)."""
    return [name for name, mod in model.named_modules()
            if getattr(mod, "_enable_pre_quant_scale", False)
            and getattr(mod, "_pre_quant_scale", None) is not None]


def calibrate_tensors(hf_config: dict, tensors: Iterable[tuple[str, torch.Tensor]], method: str,
                      fmt: str, calib: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """The HF tensors of a checkpoint after ``method``'s input-channel rescaling (see the module
    docstring), in their input dtypes, ready for ``get_spec(fmt).pack_state_dict``.

    ``calib``: the token-id sequences of the calibration forward loop (prompts of the task).
    """
    import modelopt.torch.quantization as mtq

    check_method(method, fmt)
    if method == "none":
        return dict(tensors)
    if not calib or not all(len(c) for c in calib):
        raise CalibrationError(f"--calibrate {method}: no calibration prompts (give --calib "
                               "a prompts jsonl with non-empty prompts)")
    state = dict(tensors)
    dtypes = {n: t.dtype for n, t in state.items()}
    model = build_hf_model(hf_config, torch.float32)
    names = hf_tensor_names(model)
    missing = sorted(set(names) - set(state) - {"lm_head.weight"})
    if missing:
        raise CalibrationError(f"checkpoint lacks {missing[0]} (and {len(missing) - 1} more) "
                               "of its config.json's model")
    load_packed_weights(model, get_spec("bf16"), state, [n for n in names if n in state])

    def forward_loop(m: torch.nn.Module) -> None:
        for ids in calib:
            m(input_ids=torch.tensor([list(ids)], dtype=torch.long), use_cache=False)

    with torch.no_grad():
        mtq.quantize(model, _METHODS[method].modelopt_config(method), forward_loop)
        _fold_into_norms(model)
        left = _unfolded(model)
        if left:
            raise CalibrationError(f"--calibrate {method}: the input scale of {left[0]} cannot "
                                   f"be folded into --format {fmt}'s checkpoint")
        out = {n: t.detach().clone() for n, t in hf_tensors(model) if n in state}
    return {n: out.get(n, state[n]).to(dtypes[n]) for n in state}
