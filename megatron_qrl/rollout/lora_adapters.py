"""LoRA adapters served on top of a rollout engine's (quantized) base: the reference engine.

What SGLang 0.5.17 computes for a dense LoRA target (``sglang/srt/lora/layers.py``: the base
layer's own quant method, then the adapter in 16 bit on the unquantized input)::

    y = base(x) + (alpha / r) * (x A^T) B^T

The reference engine reproduces it with a forward hook per adapted ``nn.Linear`` (q/k/v/o,
dense gate/up/down). Routed experts (transformers' fused 3-D expert parameters) are not served
here: :meth:`AdapterSet.install` raises naming the tensor. SGLang's own API takes a new
adapter as a new name (no upsert: unload + load), which :class:`AdapterSet` mirrors with
``version``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import WeightSyncError, tensor_checksum

__all__ = ["AdapterSet", "PEFT_PREFIX", "peft_adapter_shapes"]

PEFT_PREFIX = "base_model.model."


def peft_adapter_shapes(hf_config: dict, experts: bool) -> dict[str, tuple[int, int]]:
    """PEFT module name -> ``(out, in)`` of every adapted projection of a Qwen3(-MoE) HF config:
    attention q/k/v/o, and with ``experts`` every routed expert's gate/up/down."""
    c = hf_config
    h, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    one = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
           "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q)}
    if experts:
        f = c["moe_intermediate_size"]
        for e in range(c["num_experts"]):
            one |= {f"mlp.experts.{e}.gate_proj": (f, h), f"mlp.experts.{e}.up_proj": (f, h),
                    f"mlp.experts.{e}.down_proj": (h, f)}
    return {f"{PEFT_PREFIX}model.layers.{i}.{k}": s
            for i in range(c["num_hidden_layers"]) for k, s in one.items()}


def _module_of(peft: str) -> tuple[str, str]:
    """``base_model.model.<module>.lora_<A|B>.weight`` -> ``(<module>, A|B)``."""
    if not peft.startswith(PEFT_PREFIX) or not peft.endswith(("lora_A.weight", "lora_B.weight")):
        raise WeightSyncError(f"adapter tensor {peft!r} is not a PEFT LoRA name "
                              f"({PEFT_PREFIX}<module>.lora_A.weight / lora_B.weight)")
    body = peft[len(PEFT_PREFIX):]
    return body[: -len(".lora_A.weight")], body[-len("A.weight")]


@dataclass
class AdapterSet:
    """The adapter an engine serves: tensors by PEFT name, scaling, and the installed hooks."""

    name: str = ""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    scaling: float = 1.0
    hooks: list = field(default_factory=list)

    def checksums(self) -> dict[str, str]:
        return {k: tensor_checksum(v) for k, v in self.tensors.items()}

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks, self.tensors, self.name = [], {}, ""

    def install(self, model: torch.nn.Module, name: str, tensors: Mapping[str, torch.Tensor],
                config: Mapping[str, Any], device: torch.device) -> None:
        """Replace the served adapter by ``tensors`` (PEFT names) with ``config`` (PEFT dict)."""
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            module, factor = _module_of(key)
            pairs.setdefault(module, {})[factor] = t.detach().to(device, copy=True)
        modules = dict(model.named_modules())
        for module, ab in pairs.items():
            if set(ab) != {"A", "B"}:
                raise WeightSyncError(f"adapter for {module!r} lacks lora_{'AB'[len(ab) % 2]}")
            lin = modules.get(module)
            if not isinstance(lin, torch.nn.Linear):
                raise WeightSyncError(f"adapter target {module!r} is not a linear layer of the "
                                      "reference engine (routed-expert adapters are not served "
                                      "by it; use --no-qrl-lora-experts)")
            a, b = ab["A"], ab["B"]
            if a.shape != (rank, lin.in_features) or b.shape != (lin.out_features, rank):
                raise WeightSyncError(f"adapter {module!r}: A {tuple(a.shape)} / B "
                                      f"{tuple(b.shape)} do not fit [{rank}, {lin.in_features}]"
                                      f" / [{lin.out_features}, {rank}]")
        self.remove()
        self.scaling = alpha / rank
        for module, ab in pairs.items():
            self.hooks += _adapter_hooks(modules[module], ab["A"], ab["B"], self.scaling)
        self.name = name
        self.tensors = {k: v.detach().to(device, copy=True) for k, v in tensors.items()}


def _adapter_hooks(lin: torch.nn.Module, a: torch.Tensor, b: torch.Tensor,
                   scaling: float) -> list:
    """``out + scaling * (x A^T) B^T`` on the layer's UNQUANTIZED input ``x``: a pre-hook
    registered first (``prepend``) keeps ``x`` before the W8A8 activation fake quant's pre-hook
    (``quant.hf_reference.attach_activation_quant``) replaces it, as SGLang's LoRA layers add
    the adapter to the base layer's quant method on the raw input."""
    seen: list[torch.Tensor] = []

    def keep(_module, args):
        seen[:] = [args[0]]

    def add(_module, _args, out):
        x = seen.pop()
        delta = torch.nn.functional.linear(torch.nn.functional.linear(x, a.to(x.dtype)),
                                           b.to(x.dtype)) * scaling
        return out + delta.to(out.dtype)

    return [lin.register_forward_pre_hook(keep, prepend=True), lin.register_forward_hook(add)]
