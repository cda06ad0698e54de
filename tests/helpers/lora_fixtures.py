"""A tiny LoRA model with a frozen base and non-zero B, and its square-logit loss / gradients
(tests/models/test_lora_memory.py, test_lora_recompute.py). Call inside a megatron job."""

from __future__ import annotations

import torch

from tests.helpers.te_quant_fixtures import build, hf_state, ids, tiny_hf


def frozen_lora_model(kind: str = "dense", fmt: str | None = "bf16", **overrides):
    """Tiny Qwen3 (``kind`` dense / moe, expert adapters on for moe), r=4, alpha=8, local spec
    (as qrl-train pins for LoRA), base frozen into ``fmt`` (None: left trainable), every B
    random (seed 5, x 0.05: both factors get gradients), train mode."""
    from megatron_qrl.models.lora import LoraState, freeze_base, lora_linears, lora_spec_hook
    from megatron_qrl.models.lora_base import make_base_storage
    from megatron_qrl.models.lora_config import LoraConfig

    hf, arch = tiny_hf(kind, 0)
    state = LoraState(LoraConfig(rank=4, alpha=8.0, experts=kind == "moe"))
    torch.manual_seed(0)
    model = build(arch, hf_state(hf), lora_spec_hook(state), use_te=False, **overrides)
    if fmt is not None:
        freeze_base(model, make_base_storage(fmt))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, lin in lora_linears(model):
            for b in lin.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    model.train()
    return model


def square_loss(model) -> torch.Tensor:
    """Mean squared logits of the fixed ``ids()`` batch (fp32)."""
    x = ids()
    return model(x, torch.arange(x.shape[1])[None].expand_as(x), None).float().pow(2).mean()


def loss_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter gradient of one :func:`square_loss` backward (cloned)."""
    model.zero_grad(set_to_none=True)
    square_loss(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def tp_sp_lora_model(world: int, fmt: str = "bf16", **overrides):
    """Inside a ``world``-rank TP job (gloo, ``cpu_device_mode``): a tiny dense Qwen3 (4 heads,
    2 KV groups) at TP = ``world`` with sequence parallelism, r=4 adapters (seed 0), base
    frozen into ``fmt``, every B random and equal on all ranks (seed 5, x 0.05), train mode."""
    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.lora import LoraState, freeze_base, lora_spec_hook
    from megatron_qrl.models.lora_base import make_base_storage
    from megatron_qrl.models.lora_config import LoraConfig
    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.streaming import groups_from_parallel_state, load_hf_weights

    hf, arch = tiny_hf("dense", 0, num_attention_heads=4, num_key_value_heads=2)
    state = LoraState(LoraConfig(rank=4, alpha=8.0, base_format=fmt))
    torch.manual_seed(0)
    model = build_model(arch, ParallelLayout(tp=world, sequence_parallel=True),
                        spec_hook=lora_spec_hook(state), use_te=False, **overrides)
    load_hf_weights(model, arch, hf_state(hf).__getitem__, groups_from_parallel_state())
    freeze_base(model, make_base_storage(fmt))
    torch.manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape) * 0.05)
    model.train()
    return model
