"""A transformers Qwen3 / Qwen3-MoE model that computes exactly what the quantized rollout does.

The reference side of the contract: weights come from ``spec.dequantize(spec.unpack(packed))``
— the very tensors weight sync ships to the engine — and, for W8A8 formats, the input of
every quantized linear goes through ``spec.fake_quant_activation`` (SGLang's dynamic
per-token / per-group numerics). Used by the quantization report, the reference rollout
engine and the aligned-forward tests. Works with transformers 4.x (experts as a ModuleList of
``nn.Linear``) and 5.x (experts fused into 3-D ``gate_up_proj`` / ``down_proj`` parameters).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from ..utils import hf_names
from .spec import QuantSpec
from .targets import is_quantized


def _expert_weight(name: str) -> hf_names.HFName | None:
    """The parts of one expert's projection weight name (``...mlp.experts.3.up_proj.weight``)."""
    p = hf_names.parse(name)
    return p if p is not None and p.module == "mlp.experts" and isinstance(p.expert, int) \
        and p.leaf == "weight" else None


def build_hf_model(hf_config: dict, dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    """A transformers model from an HF config dict, randomly initialised (no hub access)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hf_config)
    cfg.pop("architectures", None)
    cfg.pop("quantization_config", None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def load_packed_weights(
    model: nn.Module, spec: QuantSpec, packed: Mapping[str, torch.Tensor], names: Iterable[str]
) -> list[str]:
    """Set ``model``'s parameters for HF tensor ``names`` from the packed rollout tensors.

    Each tensor is dequantized once and read back after the copy; returns the names whose
    stored value differs from ``dequantize(unpack(packed))`` (empty when the load is exact).
    """
    params = dict(model.named_parameters())
    differ = []
    with torch.no_grad():
        for name in names:
            got = spec.unpack(name, packed, dtype=torch.float32)
            w = spec.dequantize(got) if spec.is_quantized(name) else got
            target = _assign(model, params, name, w)
            if target is not None and not torch.equal(target, w.to(target.dtype)):
                differ.append(name)
    return differ


def _assign(model: nn.Module, params: dict, name: str, w: torch.Tensor) -> torch.Tensor | None:
    """Copy ``w`` into the parameter (or fused-expert slice) of ``name``; return that view."""
    if name in params:
        params[name].copy_(w.to(params[name].dtype))
        return params[name]
    m = _expert_weight(name)
    if m is not None and f"{m.experts_module}.gate_up_proj" in params:  # transformers 5 fused
        if m.proj == "down_proj":
            target = params[f"{m.experts_module}.down_proj"][m.expert]
        else:
            fused = params[f"{m.experts_module}.gate_up_proj"][m.expert]
            half = fused.shape[0] // 2
            target = fused[:half] if m.proj == "gate_proj" else fused[half:]
        target.copy_(w.to(target.dtype))
        return target
    if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
        return None
    raise KeyError(f"the model has no parameter for packed tensor {name!r}")


class _ActQuantFusedExperts(nn.Module):
    """transformers-5 fused experts with activation fake-quant before each expert GEMM.

    Same maths as ``Qwen3MoeExperts.forward``; the two inputs SGLang quantizes (the token
    entering gate/up, the SiLU(gate)*up product entering down) go through the spec.
    """

    def __init__(self, experts: nn.Module, spec: QuantSpec):
        super().__init__()
        # the same Parameter objects under the same names: checkpoints and sync see no change
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.act_fn = experts.act_fn
        self.spec = spec

    def forward(self, hidden_states, top_k_index, top_k_weights):
        e = self
        q = self.spec.fake_quant_activation
        out = torch.zeros_like(hidden_states)
        for idx in torch.unique(top_k_index).tolist():
            token_idx, pos = torch.where(top_k_index == idx)
            x = q(hidden_states[token_idx])
            gate, up = nn.functional.linear(x, e.gate_up_proj[idx]).chunk(2, dim=-1)
            h = nn.functional.linear(q(e.act_fn(gate) * up), e.down_proj[idx])
            h = h * top_k_weights[token_idx, pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out


def attach_activation_quant(model: nn.Module, spec: QuantSpec) -> list:
    """Quantize the inputs of every quantized linear of ``model`` like the rollout engine.

    Returns the hook handles (and swaps fused expert modules in place). No-op for
    weight-only formats.
    """
    if not spec.quantizes_activations:
        return []
    handles = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and is_quantized(f"{name}.weight"):
            handles.append(module.register_forward_pre_hook(
                lambda _m, args: (spec.fake_quant_activation(args[0]), *args[1:])))
        elif name.endswith("mlp.experts") and hasattr(module, "gate_up_proj"):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, _ActQuantFusedExperts(module, spec))
    return handles


def hf_tensor_names(model: nn.Module) -> list[str]:
    """HF checkpoint names of ``model`` (per-expert names even when experts are fused)."""
    names = []
    for name, p in model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len(".gate_up_proj")]
            names += [f"{base}.{e}.{proj}.weight" for e in range(p.shape[0])
                      for proj in ("gate_proj", "up_proj")]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len(".down_proj")]
            names += [f"{base}.{e}.down_proj.weight" for e in range(p.shape[0])]
        else:
            names.append(name)
    return names


def hf_tensors(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, tensor)`` of ``model`` in checkpoint naming (splits fused experts)."""
    params = dict(model.named_parameters())
    for name in hf_tensor_names(model):
        if name in params:
            yield name, params[name].detach()
            continue
        m = _expert_weight(name)
        if m.proj == "down_proj":
            yield name, params[f"{m.experts_module}.down_proj"][m.expert].detach()
        else:
            fused = params[f"{m.experts_module}.gate_up_proj"][m.expert].detach()
            half = fused.shape[0] // 2
            yield name, fused[:half] if m.proj == "gate_proj" else fused[half:]


def quantized_copy(model: nn.Module, spec: QuantSpec) -> nn.Module:
    """A deep copy of ``model`` holding the rollout's weights (and activation quant) for ``spec``."""
    import copy

    clone = copy.deepcopy(model)
    packed = dict(spec.pack_state_dict(hf_tensors(model)))
    load_packed_weights(clone, spec, packed, hf_tensor_names(model))
    attach_activation_quant(clone, spec)
    return clone
