"""The grouped-expert path (``TEGroupedMLP`` names, one grouped GEMM) equals the sequential one.

Both models are megatron's Transformer Engine spec tree built on the CPU
(``tests/helpers/te_spec_cpu.py``) with the aligned swap, loaded with the same weights; the only
difference is the experts: ``--moe-grouped-gemm`` (``AlignedTEGroupedMLP``: every expert's
GEMM in one ``te_quant.grouped_gemm.grouped_mm`` call, ``Q_w`` cached stacked) against
``SequentialMLP`` (one linear per expert). Logits, the loss and every gradient must agree for
the plain forward, for every weight format (W8A8 and weight-only), with routing replay.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.te_quant_fixtures import FLIP_BATCH, grads_as_hf, hf_state, ids, tiny_hf
from tests.helpers.te_spec_cpu import build_te_shaped

FORMATS = ("int8", "fp8", "fp8_block", "w4a16", "nvfp4")
GEMMS = {"mm", "addmm", "bmm", "_grouped_mm", "matmul", "linear"}


class _CountGemms(TorchDispatchMode):
    """Counts the aten GEMM calls dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in GEMMS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _model(arch, tensors, fmt, grouped, replay=None):
    from megatron_qrl.models.streaming import groups_from_parallel_state, load_hf_weights
    from megatron_qrl.moe import replay_spec_hook
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook, compose_hooks

    state = AlignedForwardState(fmt)
    hook = compose_hooks(aligned_spec_hook(state), replay and replay_spec_hook(replay))
    model = build_te_shaped(arch, hook, moe_grouped_gemm=grouped)
    load_hf_weights(model, arch, tensors.__getitem__, groups_from_parallel_state())
    return state, model


def _run(model, arch, x, plain=False, state=None):
    """(logits, loss, HF-named gradients) of one forward + backward."""
    import contextlib

    model.zero_grad()
    pos = torch.arange(x.shape[1])[None].expand_as(x)
    with state.only(()) if plain else contextlib.nullcontext():
        logits = model(x, pos, attention_mask=None).float()
        target = torch.roll(x, -1, dims=1)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        loss.backward()
    return logits.detach(), loss.detach(), grads_as_hf(model, arch)


def _assert_same(got, want, what):
    (lg, ls, gg), (lw, lsw, gw) = got, want
    assert (lg - lw).abs().max().item() <= 1e-5, what
    assert abs(ls.item() - lsw.item()) <= 1e-6, what
    assert sorted(gg) == sorted(gw), what
    worst = max(((gg[k] - gw[k]).abs().max().item(), k) for k in gw)
    assert worst[0] <= 1e-6, (what, worst)


@pytest.fixture(scope="module")
def pair(megatron):
    hf, arch = tiny_hf("moe")
    tensors = hf_state(hf)
    return arch, _model(arch, tensors, "int8", True), _model(arch, tensors, "int8", False)


@pytest.mark.parametrize("fmt", ("plain", *FORMATS))
def test_grouped_equals_sequential_logits_loss_and_every_gradient(pair, fmt):
    from megatron_qrl.quant import get_spec

    arch, (g_state, g_model), (s_state, s_model) = pair
    x = ids(**FLIP_BATCH)
    for state in (g_state, s_state):
        state.spec = get_spec("int8" if fmt == "plain" else fmt)
        state.mark_weights_updated()
    plain = fmt == "plain"
    got = _run(g_model, arch, x, plain, g_state)
    want = _run(s_model, arch, x, plain, s_state)
    _assert_same(got, want, fmt)
    if not plain:  # the comparison is of the quantized forward, not of two plain ones
        unq = _run(s_model, arch, x, True, s_state)
        assert (unq[0] - want[0]).abs().max().item() > 1e-3, fmt


def test_grouped_equals_sequential_with_routing_replay(megatron):
    """Replayed experts (``moe.RoutingReplay`` mode ``all``), W8A8: both paths route every
    token to the given experts and agree on logits, loss and gradients."""
    from megatron_qrl.moe import RoutingReplay

    hf, arch = tiny_hf("moe")
    tensors = hf_state(hf)
    x = ids(**FLIP_BATCH)
    tokens = x.numel()
    route = torch.rand(tokens, arch.num_layers, arch.num_experts,
                       generator=torch.Generator().manual_seed(5)).argsort(-1)[..., :arch.moe_top_k]
    out = []
    for grouped in (True, False):
        replay = RoutingReplay("all", arch.num_experts, arch.moe_top_k)
        state, model = _model(arch, tensors, "fp8", grouped, replay)
        with replay.use(route, "update"):
            out.append(_run(model, arch, x, state=state))
        own = _run(model, arch, x, state=state)[0]  # the model's own routing
        assert (own - out[-1][0]).abs().max().item() > 1e-3, grouped
    _assert_same(out[0], out[1], "replay")


def test_grouped_linear_is_one_gemm_and_caches_stacked_weights_once_per_step(pair):
    """One aligned grouped linear: one GEMM call per forward for all experts, ``Q_w`` of all
    experts cached as one ``[experts, out, in]`` tensor, recomputed only after a step."""
    from megatron_qrl.quant import get_spec

    arch, (state, model), _ = pair
    state.spec = get_spec("int8")
    state.mark_weights_updated()
    fc1 = model.decoder.layers[0].mlp.experts.linear_fc1
    counts = [3, 0, 5, 1, 2, 4, 0, 6]
    x = torch.randn(sum(counts), fc1.in_features, requires_grad=True)
    before = fc1.qrl_recomputes
    with _CountGemms() as mode:
        y, _ = fc1(x, counts)
    assert mode.calls in (["_grouped_mm"], ["bmm"]), mode.calls
    q = fc1.quantized_weights()
    assert torch.is_tensor(q) and q.shape == (arch.num_experts, fc1.out_features, fc1.in_features)
    fc1(x, counts)
    assert fc1.qrl_recomputes == before + 1
    state.mark_weights_updated()
    fc1(x, counts)
    assert fc1.qrl_recomputes == before + 2
    xq = state.spec.fake_quant_activation(x.detach())  # W8A8: Q_a of all rows in one call
    want = torch.cat([xe @ q[e].t() for e, xe in enumerate(torch.split(xq, counts))])
    assert torch.equal(y, want)


@pytest.mark.parametrize("impl", ["padded", "torch"])
@pytest.mark.parametrize("counts", [[3, 0, 7, 2], [0, 0, 4, 0], [1, 1, 1, 1]])
def test_grouped_mm_equals_one_matmul_per_expert(impl, counts):
    from megatron_qrl.te_quant import grouped_gemm

    fn = {"padded": grouped_gemm.padded_grouped_mm, "torch": grouped_gemm.torch_grouped_mm}[impl]
    if impl == "torch" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 12, generator=g, requires_grad=True)
    w = torch.randn(len(counts), 20, 12, generator=g, requires_grad=True)
    y = fn(x, w, counts)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    ref = torch.cat([a @ b.t() for a, b in zip(torch.split(xr, counts), wr.unbind(0))])
    ref.backward(dy)
    for a, b in ((y, ref), (x.grad, xr.grad), (w.grad, wr.grad)):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), impl


def test_grouped_mm_rejects_mismatched_groups():
    from megatron_qrl.te_quant.grouped_gemm import grouped_mm

    with pytest.raises(ValueError, match="groups hold 5 rows, the input 6"):
        grouped_mm(torch.zeros(6, 4), torch.zeros(2, 3, 4), [2, 3])
    with pytest.raises(ValueError, match=r"not \[3 experts"):
        grouped_mm(torch.zeros(6, 4), torch.zeros(2, 3, 4), [2, 3, 1])


def test_aligned_swap_refuses_sequential_experts_when_grouped_gemm_asked(megatron):
    """A spec whose experts are ``SequentialMLP`` although ``moe_grouped_gemm`` is set (a
    provider that fell back) would run one GEMM per expert: one error naming the flag."""
    from megatron_qrl.models.builder import config_and_spec
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook

    _, arch = tiny_hf("moe")
    config, block = config_and_spec(arch, use_te="local", use_cpu_initialization=True)
    config.moe_grouped_gemm = True
    with pytest.raises(ValueError, match="--moe-grouped-gemm"):
        aligned_spec_hook(AlignedForwardState("int8"))(block.layer_specs[0], config)
