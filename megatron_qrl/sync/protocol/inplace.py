"""What the trainer's sender and the engine's loader agree on: the reserved tensor names of
an in-place bucket, the control message, and how HF tensor names map to SGLang modules and
to expert stacks. Imported on both sides of the process boundary; it runs nothing.

A bucket of an in-place sync is ``update_weights_from_tensor`` with ``load_format`` =
:data:`LOADER` and these tensors besides the HF-named weights:

* :data:`CONTROL` (every bucket): JSON ``{"begin", "final", "done": {module: n_tensors},
  "suffixes", "views", "direct_experts", "receipt"}`` written by
  :class:`~megatron_qrl.rollout_sglang.sync.sender.StreamTracker`;
* :data:`RECV` (flattened buckets): JSON ``{"meta": BucketMeta}`` — the bucket's tensors are
  views of :data:`FLAT` (one ``uint8`` buffer, one CUDA-IPC handle per bucket) or, with
  ``"group"``, arrive by broadcast on that weight-update group (``sync="distributed"``).

Expert stacks: a decoder layer's experts of one kind travel as ONE tensor named with the
expert index starred, ``<moe>.experts.*.<proj>.<leaf>`` (e.g.
``model.layers.3.mlp.experts.*.gate_proj.weight``), expert ``e`` at index ``e``.
"""

from __future__ import annotations

import torch

from ...utils import hf_names
from ...utils.hf_names import FUSED
from .wire import json_tensor, tensor_json

__all__ = ["CONTROL", "FLAT", "LOADER", "RECV", "InplaceSyncError", "decode_control",
           "encode_control", "expert_name", "expert_names", "expert_views", "module_key",
           "parse_stacked"]

CONTROL = "__qrl_inplace__"
RECV = "__qrl_recv__"
FLAT = "__qrl_flat__"
LOADER = "megatron_qrl.rollout_sglang.sync.loader.load_packed"
"""The ``load_format`` / ``custom_weight_loader`` entry (SGLang's ``dynamic_import`` splits
on the last dot)."""


class InplaceSyncError(RuntimeError):
    """A bucketed in-place sync that cannot be applied (names the module and the tensor)."""


def encode_control(msg: dict) -> torch.Tensor:
    return json_tensor(msg)


def decode_control(t: torch.Tensor) -> dict:
    return tensor_json(t)


def module_key(hf_name: str) -> str:
    """The SGLang module an HF checkpoint tensor loads into: ``...q_proj.weight_scale`` ->
    ``...qkv_proj``, ``...experts.3.up_proj.weight`` -> ``...experts`` (Qwen3 naming;
    :attr:`.hf_names.HFName.engine_module`); any other tensor's owner (``...input_layernorm``)."""
    p = hf_names.parse(hf_name)
    if p is not None:
        return p.engine_module
    head, _, leaf = hf_name.rpartition(".")[0].rpartition(".")
    leaf = FUSED.get(leaf, leaf)
    return f"{head}.{leaf}" if head else leaf


def parse_stacked(name: str) -> tuple[str, str, str] | None:
    """``(moe module, proj, leaf)`` of a stacked name
    (``model.layers.3.mlp.experts.*.up_proj.weight`` -> ``("model.layers.3.mlp.experts",
    "up_proj", "weight")``); None for any other name."""
    p = hf_names.parse(name)
    return (p.experts_module, p.proj, p.leaf) if p is not None and p.is_stacked else None


def expert_name(stacked: str, expert: int) -> str:
    """The per-expert name of index ``expert`` of a stacked name."""
    return expert_names(stacked, expert + 1)[expert]


def expert_names(stacked: str, experts: int) -> list[str]:
    """The per-expert names of indices ``0 .. experts-1`` of a stacked name (parsed once)."""
    if parse_stacked(stacked) is None:
        raise ValueError(f"{stacked!r} is not a stacked expert name "
                         "('<prefix>.experts.*.<gate_proj|up_proj|down_proj>.<leaf>')")
    return hf_names.expert_names(stacked, experts)


def expert_views(name: str, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``t[0], t[1], ...``: the experts of the stacked tensor ``name`` (views, no names)."""
    if t.dim() == 0:
        raise ValueError(f"stacked expert tensor {name!r} is a scalar; expected [E, ...]")
    return t.unbind(0)
