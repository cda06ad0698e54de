"""Rollout-aligned forward (te_quant) on CPU: Megatron == transformers reference, STE, cache.

Reference: ``quant.hf_reference.quantized_copy`` = a transformers model holding
``spec.dequantize(spec.unpack(spec.pack(W)))`` (what weight sync ships to the engine) with
activation fake-quant hooks for W8A8 — built independently of te_quant.

Trainer and reference agree within 1e-4 except where a rounding-boundary flip moves one
sequence (``tests.helpers.te_quant_fixtures.flips``): the checks count the flipped sequences and
allow at most half of a batch, on any token batch (the one used holds flips); a wrong scale,
layout or missing hook moves every sequence by >= 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.quant import get_spec, list_specs
from megatron_qrl.quant.hf_reference import quantized_copy
from tests.helpers.te_quant_fixtures import (
    FLIP_BATCH,
    assert_close_up_to_flips,
    build,
    flips,
    grads_as_hf,
    hf_state,
    ids,
    tiny_hf,
)

TOL = 1e-4


def _aligned(kind: str, fmt: str, **overrides):
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook

    hf, arch = tiny_hf(kind)
    state = AlignedForwardState(fmt)
    model = build(arch, hf_state(hf), aligned_spec_hook(state), **overrides)
    return hf, arch, state, model


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_aligned_forward_matches_reference(megatron, kind):
    from megatron_qrl.te_quant.attribution import megatron_logits

    hf, arch, state, model = _aligned(kind, "bf16")
    x = ids(**FLIP_BATCH)
    found = {}
    for fmt in list_specs():
        state.spec = get_spec(fmt)
        state.mark_weights_updated()
        with torch.no_grad():
            ref = quantized_copy(hf, state.spec)(input_ids=x).logits
        got = megatron_logits(model, x)
        with state.only(()):
            plain = megatron_logits(model, x)
        found[fmt] = assert_close_up_to_flips(got, ref, f"{kind} {fmt}", TOL)
        if fmt != "bf16":  # the check can fail: the plain forward is far from the reference
            assert len(flips(plain, ref, 100 * TOL)) == x.shape[0], fmt
    print(f"{kind} rounding-boundary flips (sequence: first token) vs reference:", found)
    assert not found["bf16"] and not found["w4a16"] and not found["nvfp4"], found  # weight-only


@pytest.mark.parametrize("fmt", ["int8", "fp8_block", "nvfp4"])
def test_ste_gradient_equals_plain_gradient_at_quantized_weights(megatron, fmt):
    """dL/dW of the aligned forward == dL/dW_q of the reference holding W_q = Q(W) (STE)."""
    # no load-balancing loss: transformers adds none to this loss either
    hf, arch, state, model = _aligned("moe", fmt, moe_aux_loss_coeff=0.0)
    x = ids(**FLIP_BATCH)
    pos = torch.arange(x.shape[1])[None].expand_as(x)
    model.train()
    out = model(x, pos, attention_mask=None).float()
    ref_model = quantized_copy(hf, get_spec(fmt)).train()
    ref_out = ref_model(input_ids=x).logits.float()
    # the loss of the sequences without a rounding-boundary flip (a flip stays in its sequence)
    clean = [b for b in range(x.shape[0])
             if b not in assert_close_up_to_flips(out, ref_out, fmt, TOL)]
    out.log_softmax(-1)[clean, :, 0].sum().backward()
    got = grads_as_hf(model, arch)
    ref_out.log_softmax(-1)[clean, :, 0].sum().backward()
    for p in ref_model.parameters():
        p.data = p.grad
    want = hf_state(ref_model)
    assert set(got) == set(want)
    rel = {n: ((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)).item()
           for n in want}
    bad = {n: r for n, r in rel.items() if r > 1e-4}
    assert not bad, "\n".join(f"{n} {r:.2e}" for n, r in sorted(bad.items()))
    quantized = [n for n in got if get_spec(fmt).is_quantized(n)]
    assert all(got[n].abs().max() > 0 for n in quantized if ".experts." not in n)
    assert sum(bool(got[n].abs().max() > 0) for n in quantized if ".experts." in n) >= 8


def test_quantized_weight_cached_between_steps(megatron):
    from megatron_qrl.te_quant.linears import AlignedLinearMixin

    _, _, state, model = _aligned("moe", "nvfp4")
    linears = [m for m in model.modules() if isinstance(m, AlignedLinearMixin)]
    assert len(linears) == 2 * (2 + 2 * 8)  # 2 layers x (qkv, proj, 8 experts x (fc1, fc2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    state.attach_to_optimizer(opt)
    x = ids()
    pos = torch.arange(x.shape[1])[None].expand_as(x)
    model.train()
    for _ in range(3):  # three micro-batches: one quantization per linear
        model(x, pos, attention_mask=None).float().pow(2).mean().backward()
    assert all(m.qrl_recomputes == 1 for m in linears)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    before = qkv.quantized_weight().clone()
    opt.step()
    model(x, pos, attention_mask=None).float().pow(2).mean().backward()
    assert all(m.qrl_recomputes == 2 for m in linears if m.weight.grad is not None)
    assert not torch.equal(before, qkv.quantized_weight())
    # a weight written through .data (as Megatron's optimizers do) is seen after the hook only
    with torch.no_grad():
        qkv.weight.data.mul_(2.0)
    stale = qkv.quantized_weight().clone()
    assert qkv.qrl_recomputes == 2 and torch.equal(stale, qkv._qrl_cache[1])
    state.mark_weights_updated()
    assert not torch.equal(stale, qkv.quantized_weight()) and qkv.qrl_recomputes == 3


def test_layer_kinds_switch_and_router_stays_bf16(megatron):
    from megatron_qrl.te_quant.attribution import megatron_logits

    hf, arch, state, model = _aligned("moe", "w4a16")
    x = ids()
    with state.only(()):
        plain = megatron_logits(model, x)
    ref_plain = hf(input_ids=x).logits.detach()
    assert (plain - ref_plain).abs().max().item() <= TOL
    with state.only(("attention",)):
        attn_only = megatron_logits(model, x)
    assert (attn_only - plain).abs().max().item() > 100 * TOL
    layer = model.decoder.layers[0]
    assert type(layer.mlp.router).__name__ == "TopKRouter"
    with pytest.raises(ValueError, match="unknown layer kinds"):
        state.only(("lm_head",)).__enter__()


def test_cache_refreshed_by_megatron_optimizer_step(megatron):
    """The hook finds the torch optimizer inside megatron-core's optimizer (DDP main grads)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_qrl.compat import cpu_device_mode

    _, _, state, model = _aligned("dense", "int8")
    with cpu_device_mode():
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [ddp])
        state.attach_to_optimizer(opt)
        qkv = model.decoder.layers[0].self_attention.linear_qkv
        x = ids()
        pos = torch.arange(x.shape[1])[None].expand_as(x)
        ddp.zero_grad_buffer()
        for _ in range(2):
            ddp(x, pos, attention_mask=None).float().pow(2).mean().backward()
        before = qkv.quantized_weight().clone()
        assert qkv.qrl_recomputes == 1 and qkv.weight.main_grad.abs().max() > 0
        ok, _, _ = opt.step()
        assert ok and state.version == 1
        assert not torch.equal(before, qkv.quantized_weight()) and qkv.qrl_recomputes == 2


def test_chained_optimizer_members_each_bump_the_weight_version():
    """EP > 1: megatron's ChainedOptimizer holds a dense and an expert optimizer and its
    ``.optimizer`` asserts; each member's step must invalidate the quantized-weight cache."""
    from megatron_qrl.te_quant.state import AlignedForwardState

    class Chained:  # the two attributes of megatron.core.optimizer.ChainedOptimizer we read
        def __init__(self, *opts):
            self.chained_optimizers = list(opts)

        @property
        def optimizer(self):
            raise AssertionError("ChainedOptimizer.optimizer with more than one optimizer")

    w1, w2 = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    dense, expert = torch.optim.SGD([w1], lr=0.1), torch.optim.SGD([w2], lr=0.1)
    state = AlignedForwardState("int8")
    state.attach_to_optimizer(Chained(dense, expert))
    v0 = state.version
    dense.step()
    expert.step()
    assert state.version == v0 + 2


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_meta_parameter_counts_equal_the_built_model(megatron, kind):
    """The bench's size check builds on the meta device with the local spec (TE's linears
    cannot initialise there); its count equals the real model's."""
    from megatron_qrl.models.runtime import build_model, meta_parameter_counts

    _, arch = tiny_hf(kind)
    total, active = meta_parameter_counts(arch)
    assert total == sum(p.numel() for p in build_model(arch).parameters())
    assert (active < total) == arch.is_moe


def _expert_mlps(model):
    from megatron_qrl.te_quant.linears import AlignedSequentialMLP

    return [m for m in model.modules() if isinstance(m, AlignedSequentialMLP)]


@pytest.mark.parametrize("fmt", ["int8", "fp8_block", "w4a16", "nvfp4"])
def test_stacked_experts_equal_per_expert_path(megatron, fmt, monkeypatch):
    """All experts' weights (and W8A8 inputs) quantized in stacked calls == one call per
    expert, bit for bit: logits and every gradient; far fewer quantizer calls."""
    spec = get_spec(fmt)
    calls = []
    real = type(spec).quantize_dequantize  # the aligned forward's fake-quant entry point
    monkeypatch.setattr(type(spec), "quantize_dequantize",
                        lambda self, w, **kw: calls.append(tuple(w.shape)) or real(self, w, **kw))
    _, arch, state, model = _aligned("moe", fmt, moe_aux_loss_coeff=0.0)
    x = ids()
    pos = torch.arange(x.shape[1])[None].expand_as(x)
    model.train()
    results = {}
    for batched in (False, True):
        for mlp in _expert_mlps(model):
            mlp.batched = batched
        state.mark_weights_updated()
        model.zero_grad()
        calls.clear()
        out = model(x, pos, attention_mask=None).float()
        out.log_softmax(-1)[..., 0].sum().backward()
        results[batched] = (out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                           if p.grad is not None}, len(calls))
    (ref, ref_grads, n_ref), (got, grads, n_got) = results[False], results[True]
    assert torch.equal(got, ref)
    assert set(grads) == set(ref_grads)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    # per expert: 2 layers x 8 experts x (gate, up, down) + attention q, k, v, o
    assert n_ref == 2 * (8 * 3 + 4)
    assert n_got == 2 * (2 + 4), n_got  # every format stacks (NVFP4 with per-row global amax)
    experts = [lin for mlp in _expert_mlps(model) for e in mlp.local_experts
               for lin in (e.linear_fc1, e.linear_fc2)]
    assert all(lin.qrl_recomputes == 2 and not lin.qrl_stale() for lin in experts)


@pytest.mark.parametrize("fmt,gemm", [("fp8", "fake"), ("fp8_block", "fake"),
                                      ("nvfp4", "fake"), ("fp8", "real")])
def test_nan_weight_stops_the_step_naming_it(megatron, fmt, gemm):
    """A NaN in one weight (layer 1's attention output projection) is read once per refresh,
    not in the forward: the forward and backward run, then the optimizer's pre-step hook
    raises NonFiniteError naming the parameter before the update is applied. Fails on the
    old code (the forward raised, naming only ``attention AlignedRowParallelLinear``) and on
    the pre-step hook left out of ``attach_to_optimizer`` (the NaN update is applied, no
    error)."""
    from megatron_qrl.utils.finite import NonFiniteError

    _, _, state, model = _aligned("moe", fmt)
    state.gemm = gemm  # real: the codes and scales the real GEMM caches (CPU: torch's)
    state.name_modules(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state.attach_to_optimizer(opt)
    with torch.no_grad():
        model.decoder.layers[1].self_attention.linear_proj.weight[3, 5] = float("nan")
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    before = qkv.detach().clone()
    x = ids()
    pos = torch.arange(x.shape[1])[None].expand_as(x)
    model.train()
    model(x, pos, attention_mask=None).float().pow(2).mean().backward()
    cached = model.decoder.layers[0].self_attention.linear_qkv._qrl_cache[1]
    assert type(cached).__name__ == ("RealWeight" if gemm == "real" else "Tensor")
    assert qkv.grad.isnan().any()  # a result computed from the NaN weight ...
    name = r"decoder\.layers\.1\.self_attention\.linear_proj\.weight holds NaN"
    with pytest.raises(NonFiniteError, match=name):
        opt.step()
    assert torch.equal(qkv.detach(), before)  # ... never applied
    state.check_finite()  # read once: nothing left


def test_nan_expert_weight_named_by_the_state_check(megatron):
    """An expert's NaN (the stacked experts' refresh) is named by the deferred check, and the
    next refresh reads an unread one first (``finite_checks``). Mutation caught: the version
    test in ``finite_checks`` left out (the unread refresh is dropped, no error)."""
    from megatron_qrl.utils.finite import NonFiniteError

    _, _, state, model = _aligned("moe", "int8")
    state.name_modules(model)
    fc1 = model.decoder.layers[0].mlp.experts.local_experts[2].linear_fc1
    with torch.no_grad():
        fc1.weight[0, 0] = float("inf")
    x = ids()
    pos = torch.arange(x.shape[1])[None].expand_as(x)
    with torch.no_grad():
        model(x, pos, attention_mask=None)
    state.version += 1  # weights "stepped" without the hook: the next refresh reads the last
    name = r"layers\.0\.mlp\.experts\.local_experts\.2\.linear_fc1\.weight holds NaN / Inf"
    with pytest.raises(NonFiniteError, match=name):
        state.finite_checks()
