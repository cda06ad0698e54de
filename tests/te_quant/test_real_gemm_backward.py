"""The real-GEMM aligned backward does only the work its gradients need, on the CPU.

Per linear and micro batch the straight-through BF16 backward (Bengio et al. 2013) is two GEMMs,
``dx = g @ deq Q_w(W)`` and ``dW = g^T @ deq Q_a(x)``, bit-equal to the fake path's autograd
(tests/te_quant/test_real_gemm.py checks the values). Here: the grouped backward's GEMMs equal
autograd's on both grouped-GEMM paths (torch's ``_grouped_mm``: fp32 on the CPU; the padded
``bmm``: BF16 on the CPU), the backward runs exactly the GEMMs needed (counted with a
``TorchDispatchMode``: 2, or 1 when one gradient is not wanted), and with
``AlignedForwardState.keep_dequantized`` the weight is dequantized once per optimizer step, not
once per micro batch, with the same gradient bits.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_qrl.models.grouped_gemm import grouped_mm
from megatron_qrl.quant import get_spec
from megatron_qrl.te_quant.grouped_gemm import grouped_mm_grads
from megatron_qrl.te_quant.real_gemm import (
    RealWeight,
    grouped_real_linear,
    real_linear,
    weight_operand,
)

REAL = ("fp8", "int8")
GEMMS = {"mm", "bmm", "addmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm",
         "_int_mm"}
"""aten GEMMs (overload packet names)."""
COUNTS = [5, 0, 11, 8]


class _Ops(TorchDispatchMode):
    """Counts the aten ops run inside it, by overload packet name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def gemms(self) -> dict[str, int]:
        return {k: v for k, v in self.ops.items() if k in GEMMS}


@pytest.fixture
def dequantizations(monkeypatch):
    """How often a cached weight's codes are dequantized (``RealWeight.dequantize`` calls)."""
    calls = []
    original = RealWeight.dequantize

    def spy(self, spec, dtype):
        calls.append(tuple(self.codes.shape))
        return original(self, spec, dtype)

    monkeypatch.setattr(RealWeight, "dequantize", spy)
    return calls


def _experts(fmt, dtype, counts=COUNTS, keep=False):
    spec = get_spec(fmt)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(sum(counts), 64, generator=g) * 3).to(dtype)
    ws = (torch.randn(len(counts), 32, 64, generator=g) * 0.1).to(dtype)
    qs = [weight_operand(spec, w) for w in ws]
    qw = RealWeight(torch.stack([q.codes for q in qs]), torch.stack([q.scale for q in qs]), keep)
    return spec, x, ws, qw


@pytest.mark.parametrize("counts", [COUNTS, [0, 0, 0, 0], [64, 1, 30, 33]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["grouped_mm", "padded"])
def test_grouped_grads_equal_autograd(dtype, counts):
    """``grouped_mm_grads`` == autograd of ``grouped_mm``, bit for bit, each gradient alone too.
    Mutations caught: the padded ``dW`` without its final transpose, ``dx`` from ``W^T``."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), 64, generator=g).to(dtype).requires_grad_()
    w = torch.randn(len(counts), 32, 64, generator=g).to(dtype).requires_grad_()
    y = grouped_mm(x, w, counts)
    grad = torch.randn(y.shape, generator=g).to(dtype)
    want_x, want_w = torch.autograd.grad(y, (x, w), grad) if y.numel() else (
        torch.zeros_like(x), torch.zeros_like(w))
    dx, dw = grouped_mm_grads(x.detach(), w.detach(), grad, counts)
    assert torch.equal(dx, want_x) and torch.equal(dw, want_w)
    assert grouped_mm_grads(None, w.detach(), grad, counts)[1] is None
    assert torch.equal(grouped_mm_grads(None, w.detach(), grad, counts)[0], want_x)
    assert torch.equal(grouped_mm_grads(x.detach(), None, grad, counts)[1], want_w)


@pytest.mark.parametrize("need", ["both", "dx", "dW"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["grouped_mm", "padded"])
@pytest.mark.parametrize("fmt", REAL)
def test_grouped_backward_runs_only_the_gradient_gemms(dequantizations, fmt, dtype, need):
    """The experts' backward: one GEMM per wanted gradient (was 3: the forward grouped GEMM ran
    again inside ``autograd.grad``), the weight dequantized only for ``dx``. Mutation caught:
    the previous backward (3 GEMMs; weight dequantized when only ``dW`` is wanted)."""
    spec, x, ws, qw = _experts(fmt, dtype)
    x.requires_grad_(need != "dW")
    master = ws.clone().requires_grad_(need != "dx")
    y = grouped_real_linear(x, [master], qw, spec, COUNTS)
    with _Ops() as ops:
        y.backward(torch.ones_like(y))
    kind = "_grouped_mm" if dtype == torch.float32 else "bmm"
    assert ops.gemms() == {kind: 2 if need == "both" else 1}
    assert len(dequantizations) == (0 if need == "dW" else 1)
    assert (x.grad is None) == (need == "dW") and (master.grad is None) == (need == "dx")


@pytest.mark.parametrize("fmt", REAL)
def test_dense_backward_runs_two_gemms(dequantizations, fmt):
    spec, x, ws, _ = _experts(fmt, torch.bfloat16, counts=[24])
    w = ws[0].clone().requires_grad_()
    x.requires_grad_()
    y = real_linear(x, w, weight_operand(spec, ws[0]), spec)
    with _Ops() as ops:
        y.backward(torch.ones_like(y))
    assert sum(ops.gemms().values()) == 2 and len(dequantizations) == 1


@pytest.mark.parametrize("grouped", [True, False], ids=["experts", "dense"])
@pytest.mark.parametrize("fmt", REAL)
def test_kept_dequantized_weight_once_per_step_same_bits(dequantizations, fmt, grouped):
    """``keep_dequantized``: two micro batches dequantize the weight once (else twice), the
    gradients are the same bits. Mutation caught: ``grad_weight`` ignoring the flag (2 calls)."""
    grads = {}
    for keep in (False, True):
        dequantizations.clear()
        spec, x, ws, qw = _experts(fmt, torch.bfloat16, counts=COUNTS if grouped else [24],
                                   keep=keep)
        if not grouped:
            ws, qw = ws[0], RealWeight(qw.codes[0], qw.scale[0], keep)
        out = []
        for mb in range(2):
            xi = (x * (mb + 1)).requires_grad_()
            master = ws.clone().requires_grad_()
            y = (grouped_real_linear(xi, [master], qw, spec, COUNTS) if grouped
                 else real_linear(xi, master, qw, spec))
            y.backward(torch.linspace(-1, 1, y.numel()).view_as(y).to(y.dtype))
            out += [xi.grad, master.grad]
        grads[keep] = out
        assert len(dequantizations) == (1 if keep else 2)
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))


def _moe_model(keep):
    from megatron_qrl.models.stacked_experts import stacked_experts_spec_hook
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook, compose_hooks
    from tests.helpers.te_quant_fixtures import build, hf_state, tiny_hf

    hf, arch = tiny_hf("moe")
    state = AlignedForwardState("fp8", gemm="real")
    state.keep_dequantized = keep
    return state, build(arch, hf_state(hf), compose_hooks(stacked_experts_spec_hook,
                                                          aligned_spec_hook(state)))


def _micro_batch(model, seed):
    from tests.helpers.te_quant_fixtures import ids

    x = ids(seed=seed)
    out = model(x, torch.arange(x.shape[1])[None].expand_as(x), attention_mask=None)
    out.float().square().mean().backward()


def test_model_keeps_dequantized_weights_per_step(megatron, dequantizations):
    """Tiny Qwen3-MoE (stacked experts, local spec), fp8 real GEMM, two micro batches then an
    optimizer step's cache refresh: with ``keep_dequantized`` each real linear dequantizes once
    per step (else once per micro batch), gradients bit-equal. Mutation caught: the stacked
    experts' cache built without the state's flag (``te_grouped.real_weights``)."""
    grads, calls = {}, {}
    for keep in (False, True):
        state, model = _moe_model(keep)
        dequantizations.clear()
        for seed in (3, 4):
            _micro_batch(model, seed)
        calls[keep] = Counter(dequantizations)
        grads[keep] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        if keep:
            state.mark_weights_updated()
            dequantizations.clear()
            _micro_batch(model, 5)
            assert Counter(dequantizations) == calls[True]  # refreshed with the step
    assert calls[True] and {k: 2 * v for k, v in calls[True].items()} == calls[False]
    assert any(len(shape) == 3 for shape in calls[True])  # the stacked experts are in it
    assert len(grads[True]) == len(grads[False]) and all(
        torch.equal(a, b) for a, b in zip(grads[False], grads[True]))


def test_keep_dequantized_flag_reaches_the_state_and_is_refused_without_the_real_gemm():
    """--qrl-train-aligned-keep-dequantized: parsed, set on the aligned state only where the GEMM
    resolved to real, refused without the aligned real GEMM (mutation: forward.py not setting
    the state -> the first assert fails)."""
    from megatron_qrl.config.run import RoutingReplayConfig, TrainForwardConfig
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.te_quant import trainer_forward
    from tests.helpers.te_quant_fixtures import tiny_hf

    flag = "--qrl-train-aligned-keep-dequantized"
    configs = parse_configs(["--qrl-preset", "tiny-cpu", "--qrl-train-forward", "aligned",
                             "--qrl-train-aligned-gemm", "real", flag])[0]
    assert configs["train"].aligned_keep_dequantized is True
    _, dense = tiny_hf("dense")
    off = RoutingReplayConfig("off")
    fwd = trainer_forward(configs["train"], "fp8", off, dense)
    assert fwd.aligned.keep_dequantized is True
    plain = trainer_forward(TrainForwardConfig("aligned", aligned_gemm="real"), "fp8", off, dense)
    assert plain.aligned.keep_dequantized is False
    for bad in ({"aligned_keep_dequantized": True},
                {"forward": "aligned", "aligned_gemm": "fake", "aligned_keep_dequantized": True}):
        with pytest.raises(ValueError, match=flag):
            TrainForwardConfig(**bad)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_stacked_operand_reads_the_stack_in_place(fmt):
    """The stacked experts' Q(W) (once per optimizer step) quantizes the ``[E, N, K]``
    parameter's rows where they lie: the same codes and scales as the per-expert list's
    concatenation, without its copy of every expert weight (no ``cat``). Mutation caught:
    ``torch.cat`` of the unbound experts put back for a stacked tensor."""
    from megatron_qrl.quant import get_spec
    from megatron_qrl.te_quant.real_gemm import stacked_weight_operand
    from megatron_qrl.utils.op_census import OpCensus

    spec = get_spec(fmt)
    w = torch.randn(4, 24, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = stacked_weight_operand(spec, list(w.unbind(0)), 0, None, "w")
    census = OpCensus()
    with census.phase("q"):
        got = stacked_weight_operand(spec, w, 0, None, "w")
    assert census.phases["q"].ops["cat"] == 0
    assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
    assert torch.equal(got.scale, want.scale) and got.codes.shape == (4, 24, 32)
