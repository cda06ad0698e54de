"""LoRA at TP=1 vs TP=2 on gloo: same loss, same adapter gradients, same merged weights.

Column-parallel adapters keep A whole and shard B by output rows; row-parallel adapters shard A
by input columns and keep B whole (models/lora.py). The replicated factor's gradient is a
partial sum per rank: without its all-reduce the TP=2 gradients differ from TP=1's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.mp_utils import run_distributed

OVERRIDES = {"num_attention_heads": 4, "num_key_value_heads": 2}


def _set_adapters(model, arch) -> None:
    """Every adapter (A and B) from full tensors drawn per name: identical at any TP."""
    from megatron_qrl.models.lora_io import adapter_tensors, load_adapter_tensors

    full = {}
    for i, (name, t) in enumerate(sorted(adapter_tensors(model, arch, _groups()))):
        g = torch.Generator().manual_seed(100 + i)
        full[name] = torch.randn(t.shape, generator=g) * 0.05
    load_adapter_tensors(model, arch, full, _groups())


def _groups():
    from megatron_qrl.models.streaming import groups_from_parallel_state

    return groups_from_parallel_state()


def _grads_as_adapters(model, arch) -> dict:
    from megatron_qrl.models.lora_io import adapter_tensors

    params = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    saved = {n: p.data for n, p in params.items()}
    for p in params.values():
        p.data = p.grad
    try:
        return dict(adapter_tensors(model, arch, _groups()))
    finally:
        for n, p in params.items():
            p.data = saved[n]


def _body(rank, world, port, fmt, sp):
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.lora import LoraState, freeze_base, lora_spec_hook
    from megatron_qrl.models.lora_base import make_base_storage
    from megatron_qrl.models.lora_config import LoraConfig
    from megatron_qrl.models.lora_io import adapter_tensors, base_hf_tensors, merge_into
    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.streaming import load_hf_weights
    from tests.helpers.te_quant_fixtures import hf_state, ids, tiny_hf

    init_cpu_distributed(rank, world, port, tp=world)
    try:
        with cpu_device_mode():
            hf, arch = tiny_hf("dense", 0, **OVERRIDES)
            cfg = LoraConfig(rank=4, alpha=8.0, base_format=fmt)
            state = LoraState(cfg)
            layout = ParallelLayout(tp=world, sequence_parallel=sp and world > 1)
            model = build_model(arch, layout, spec_hook=lora_spec_hook(state))
            load_hf_weights(model, arch, hf_state(hf).__getitem__, _groups())
            freeze_base(model, make_base_storage(fmt))
            _set_adapters(model, arch)
            model.train()
            x = ids(2, 8)
            logits = model(x, torch.arange(8)[None].expand_as(x), None).float()
            loss = logits.pow(2).sum() / (logits.numel() * world)
            loss.backward()
            total = loss.detach().clone()
            if world > 1:
                dist.all_reduce(total)
            grads = _grads_as_adapters(model, arch)
            with torch.no_grad():  # one SGD step on the adapters, then the merged weights
                for p in model.parameters():
                    if p.grad is not None:
                        p -= 0.5 * p.grad
            adapters = dict(adapter_tensors(model, arch, _groups()))
            merged = dict(merge_into(base_hf_tensors(model, arch, _groups()), adapters,
                                     cfg.scaling))
            return {"loss": float(total), "grads": grads, "merged": merged}
    finally:
        destroy_cpu_distributed()


@pytest.mark.slow
@pytest.mark.parametrize("fmt,sp", [("bf16", True), ("nvfp4", False)])
def test_tp1_equals_tp2(fmt, sp):
    one = run_distributed(_body, 1, fmt, sp)[0]
    two = run_distributed(_body, 2, fmt, sp)
    assert two[0]["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert sorted(two[0]["grads"]) == sorted(one["grads"]) and len(one["grads"]) == 28
    for name, g in one["grads"].items():
        assert float(g.abs().max()) > 0, name
        assert torch.allclose(two[0]["grads"][name], g, atol=1e-6, rtol=1e-4), name
        assert torch.equal(two[1]["grads"][name], two[0]["grads"][name]), name
    for name, w in one["merged"].items():
        assert torch.allclose(two[0]["merged"][name], w, atol=1e-6, rtol=0), name
