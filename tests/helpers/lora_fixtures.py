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
