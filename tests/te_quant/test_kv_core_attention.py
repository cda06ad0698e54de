"""The KV-aligned core attention in a megatron Qwen3 model (te_quant/kv_core_attention.py)
against a hand-built reference: the plain model (Megatron's own DotProductAttention, which
materialises the softmax) whose core attention is run a second time on K/V rounded by the
test's grid (tests/helpers/kv_grid.py), rows mixed by the engine's rule."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.kv_grid import positive_grid, round_half_even
from tests.helpers.te_quant_fixtures import build, hf_state, ids, tiny_hf

TOL = 1e-4


def _round(t: torch.Tensor) -> torch.Tensor:
    grid = positive_grid("fp8_e4m3")
    return torch.tensor([round_half_even(float(x), grid) for x in t.flatten()]).view_as(t)


def _dot_product_attention(layer_spec, config):
    """The reference's core attention: Megatron's own DotProductAttention (materialised
    softmax), whatever the builder's default is."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_qrl.models.spec_tree import copy_spec

    spec = copy_spec(layer_spec)
    spec.submodules.self_attention.submodules.core_attention = DotProductAttention
    return spec


def _reference_hooks(model, cache_from: torch.Tensor):
    """On every core attention: out[t, b] = attention on rounded K/V where t >= cache_from[b]."""

    def hook(module, args, kwargs, out):
        query, key, value, mask = args
        rounded = module.forward(query, _round(key), _round(value), mask, **kwargs)
        rows = torch.arange(query.shape[0])[:, None] >= cache_from[None, :]  # [s, b]
        return torch.where(rows[..., None], rounded, out)

    return [m.register_forward_hook(hook, with_kwargs=True)
            for n, m in model.named_modules() if n.endswith("self_attention.core_attention")]


def test_fp8_kv_forward_equals_hand_built_reference_and_differs_from_bf16(megatron):
    from megatron_qrl.te_quant.attribution import megatron_logits
    from megatron_qrl.te_quant.kv_core_attention import KVAlignState, kv_spec_hook

    hf, arch = tiny_hf("dense")
    tensors = hf_state(hf)
    state = KVAlignState("fp8_e4m3")
    model = build(arch, tensors, kv_spec_hook(state))
    plain = build(arch, tensors, _dot_product_attention)
    assert type(plain.decoder.layers[0].self_attention.core_attention).__name__ == "DotProductAttention"
    x = ids(batch=2, seq=10)
    cache_from = torch.tensor([4, 7])
    with state.for_batch(cache_from):
        got = megatron_logits(model, x)
        with state.enabled_as(False):
            off = megatron_logits(model, x)
    base = megatron_logits(plain, x)
    hooks = _reference_hooks(plain, cache_from)
    try:
        ref = megatron_logits(plain, x)
    finally:
        for h in hooks:
            h.remove()
    assert (got - ref).abs().max().item() <= TOL
    assert (off - base).abs().max().item() <= TOL  # rounding off: plain causal attention
    # the check can fail: decode rows move by far more than the tolerance, prefill rows not at all
    assert (got - base)[0, 4:].abs().amax(-1).min().item() > 100 * TOL
    assert (got - base)[1, 7:].abs().amax(-1).min().item() > 100 * TOL
    assert (got - base)[0, :4].abs().max().item() <= TOL and (got - base)[1, :7].abs().max() <= TOL


def test_without_prompt_lengths_every_position_reads_the_cache(megatron):
    from megatron_qrl.te_quant.attribution import megatron_logits
    from megatron_qrl.te_quant.kv_core_attention import KVAlignState, kv_spec_hook

    hf, arch = tiny_hf("dense")
    state = KVAlignState("fp8_e4m3")
    model = build(arch, hf_state(hf), kv_spec_hook(state))
    x = ids(batch=2, seq=6)
    with state.for_batch(torch.zeros(2, dtype=torch.long)):
        zero = megatron_logits(model, x)
    assert torch.equal(megatron_logits(model, x), zero)


def test_bad_state_is_refused():
    from megatron_qrl.te_quant.kv_core_attention import kv_spec_hook

    with pytest.raises(TypeError, match="KVAlignState"):
        kv_spec_hook("fp8_e4m3")


def test_trainer_forward_adds_the_kv_alignment(megatron):
    from megatron_qrl.config.run import RoutingReplayConfig, TrainForwardConfig
    from megatron_qrl.te_quant import trainer_forward
    from megatron_qrl.te_quant.kv_core_attention import KVAlignedCoreAttention

    hf, arch = tiny_hf("dense")
    off = RoutingReplayConfig("off")
    kv_only = trainer_forward(TrainForwardConfig("aligned"), "bf16", off, arch, kv_cache="fp8_e4m3")
    assert kv_only.aligned is None and kv_only.kv.fmt.name == "fp8_e4m3"
    both = trainer_forward(TrainForwardConfig("aligned"), "int8", off, arch, kv_cache="fp8_e5m2")
    assert both.aligned is not None and both.kv.fmt.name == "fp8_e5m2"
    assert trainer_forward(TrainForwardConfig("bf16"), "int8", off, arch, kv_cache="fp8_e4m3").kv is None
    assert trainer_forward(TrainForwardConfig("aligned"), "int8", off, arch).kv is None
    with pytest.raises(ValueError, match="--qrl-rollout-kv-cache"):
        trainer_forward(TrainForwardConfig("aligned"), "bf16", off, arch, kv_cache="bf16")
    model = build(arch, hf_state(hf), both.spec_hook)
    layer = model.decoder.layers[0].self_attention
    assert isinstance(layer.core_attention, KVAlignedCoreAttention)
    assert type(layer.linear_qkv).__name__ == "AlignedColumnParallelLinear"
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 1:] = True
    mask[1, 3:] = True
    both.kv.set_micro_batch(mask)
    assert both.kv.cache_from.tolist() == [2, 4]
