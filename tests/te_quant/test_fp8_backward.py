"""``--qrl-train-aligned-backward``: the FP8 input-gradient GEMM of the real aligned linears.

Closed form (``megatron_qrl/te_quant/fp8_backward.py``): ``dx = Q_row(g sw^T) @ qw`` with the
weight's per-channel scale ``sw`` folded into the gradient's columns before the per-row FP8
quantization (``amax / MAX`` per row), written out here independently of the module. The CPU
runs ``torch._scaled_mm`` on the CPU, so the same code path as the GPU is checked (the CUDA
kernel itself: ``tests/gpu/test_real_gemm.py``).

Mutations caught (each checked by hand: mutate, run, restore):
- default path no longer the BF16 backward (``real_linear``'s default ``grad_fp8="e4m3"``, or
  ``AlignedForwardState.grad_fp8`` ignoring ``backward``) ->
  ``test_default_backward_is_the_bf16_straight_through``;
- the weight scale not folded / applied as an output column scale instead, the codes not
  transposed (``codes`` for ``codes_t``), E4M3 / E5M2 swapped in ``GRAD_DTYPES``, per-tensor
  instead of per-row gradient scale -> ``test_fp8_dgrad_equals_the_closed_form``;
- each expert's rows taking expert 0's weight scale -> ``test_grouped_fp8_dgrad_per_expert``;
- ``GRAD_FORMAT = "e5m2"`` (min cosine 0.9954 < bound) -> ``test_model_gradients_cosine_bound``;
- a missing refusal -> ``test_refusals_name_the_flag``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.te_quant import fp8_backward
from megatron_qrl.te_quant.real_gemm import (
    RealWeight,
    grouped_real_linear,
    real_linear,
    weight_operand,
)

FP8 = get_spec("fp8")
MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def _operands(seed: int, m: int = 24, k: int = 96, n: int = 40):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).bfloat16()
    # per-channel magnitudes spread over 2^-6..2^2: a scale not folded shows at once
    w = (torch.randn(n, k, generator=g) * 2.0 ** torch.randint(-6, 3, (n, 1), generator=g)).bfloat16()
    grad = torch.randn(m, n, generator=g).bfloat16()
    grad[5] = 0  # an all-zero gradient row (scale 1, no NaN)
    return x, w, grad


def _closed_form(grad: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, fmt: str
                 ) -> torch.Tensor:
    """``Q_row(g sw^T) @ qw``: the quantization in fp32 (the module's arithmetic), the GEMM in
    fp64 (exact sums of FP8 products), per the module doc."""
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    gs = grad.float() * scale.float().reshape(1, -1)
    sg = gs.abs().amax(dim=1, keepdim=True) / MAX[fmt]
    sg = torch.where(sg > 0, sg, torch.ones_like(sg))
    q = (gs / sg).clamp(-MAX[fmt], MAX[fmt]).to(dtype)
    return (q.double() @ codes.double()) * sg.double()


def _grads(x, w, grad, grad_fp8):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    real_linear(xr, wr, weight_operand(FP8, w), FP8, grad_fp8=grad_fp8).backward(grad)
    return xr.grad, wr.grad


def test_default_backward_is_the_bf16_straight_through():
    """The default (no ``grad_fp8``; ``AlignedForwardState``'s default) gives the fake path's
    STE gradients bit for bit: today's backward, unchanged."""
    from megatron_qrl.config.run import TrainForwardConfig
    from megatron_qrl.te_quant import AlignedForwardState

    assert TrainForwardConfig().aligned_backward == "bf16"
    assert AlignedForwardState("fp8", gemm="real").grad_fp8() is None
    x, w, grad = _operands(0)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    real_linear(xr, wr, weight_operand(FP8, w), FP8).backward(grad)  # the default arguments
    dx, dw = xr.grad, wr.grad
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    (FP8.fake_quant_activation(xf) @ FP8.fake_quant_weight(wf).t()).backward(grad)
    assert torch.equal(dx, xf.grad) and torch.equal(dw, wf.grad)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_dgrad_equals_the_closed_form(fmt):
    """dx equals the closed form up to fp32 summation order and one BF16 rounding; dW stays the
    BF16 backward's bit for bit; the reference the GPU test and the bench use agrees too."""
    x, w, grad = _operands(1)
    qw = weight_operand(FP8, w)
    dx, dw = _grads(x, w, grad, fmt)
    want = _closed_form(grad, qw.codes, qw.scale, fmt)
    assert dx.dtype == torch.bfloat16 and dx.shape == x.shape
    # one bf16 rounding of the output (2^-8 relative) + fp32 sums over N terms
    bound = 2.0 ** -8 * want.abs() + grad.shape[1] * 2.0 ** -24 * want.abs().amax()
    assert ((dx.double() - want).abs() <= bound).all()
    assert dx[5].eq(0).all()
    ref = fp8_backward.dgrad_fp8_reference(grad, qw.codes, qw.scale, torch.float64, fmt)
    assert torch.allclose(ref, want, rtol=0, atol=0)
    assert torch.equal(dw, _grads(x, w, grad, None)[1])
    # and it is not the BF16 backward: an FP8 rounding apart, within its size
    bf16 = _grads(x, w, grad, None)[0].double()
    rel = ((dx.double() - bf16).norm() / bf16.norm()).item()
    assert 2.0 ** -8 < rel < {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}[fmt]


def experts_case(counts, weight_base=1.0, grad_base=1.0):
    """Stacked fp8 experts with ``counts`` tokens each (expert e's weights scaled by
    ``weight_base ** e``, its tokens' output gradient by ``grad_base ** e``): ``(x, ws, qws, qw,
    grad)``."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(counts), 64, generator=g).bfloat16()
    ws = [(torch.randn(32, 64, generator=g) * weight_base ** e).bfloat16()
          for e in range(len(counts))]
    qws = [weight_operand(FP8, w) for w in ws]
    qw = RealWeight(torch.stack([q.codes for q in qws]), torch.stack([q.scale for q in qws]))
    rows = torch.tensor([grad_base ** e for e, c in enumerate(counts) for _ in range(c)])
    grad = (torch.randn(sum(counts), 32, generator=g) * rows[:, None]).bfloat16()
    return x, ws, qws, qw, grad


def grouped_grads(case, counts, key):
    """``{None: (dx, dW), "e4m3": (dx, dW)}`` of the stacked experts' backward with the FP8
    option ``key`` (``grad_fp8`` / ``wgrad_fp8``) off and on."""
    x, ws, _, qw, grad = case
    out = {}
    for fp8 in (None, "e4m3"):
        xr, master = x.clone().requires_grad_(), torch.stack(ws).requires_grad_()
        grouped_real_linear(xr, [master], qw, FP8, counts, **{key: fp8}).backward(grad)
        out[fp8] = xr.grad, master.grad
    return out


def test_grouped_fp8_dgrad_per_expert():
    """Stacked experts: each expert's rows take that expert's weight scale; an expert without
    tokens is skipped; dW stays the BF16 backward's."""
    counts = [5, 0, 11, 8]
    case = experts_case(counts, weight_base=4.0)
    _, _, qws, _, grad = case
    out = grouped_grads(case, counts, "grad_fp8")
    start = 0
    for e, c in enumerate(counts):
        rows = slice(start, start + c)
        if not c:
            continue
        want = _closed_form(grad[rows], qws[e].codes, qws[e].scale, "e4m3")
        got = out["e4m3"][0][rows].double()
        assert ((got - want).abs() <= 2.0 ** -8 * want.abs() + 1e-6 * want.abs().amax()).all(), e
        start += c
    assert torch.equal(out["e4m3"][1], out[None][1])


COSINE_BOUND = 0.998
"""Lowest cosine of any parameter's (and the input's) FP8-backward gradient to the BF16
backward's, tiny dense Qwen3, one step (bench/fp8_backward.py, seed 0: measured 0.99860 for
E4M3, 0.99542 for E5M2)."""


@pytest.fixture(scope="module")
def megatron():
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        yield


def test_model_gradients_cosine_bound(megatron):
    """Through the model's aligned linears: every gradient within the cosine bound of the BF16
    backward's, layer 0 visibly changed, and the last linear's weight gradient (its dgrad is
    nobody's input) and the output layer's identical (the weight gradient stays BF16)."""
    from bench.fp8_backward import build, compare, gradients

    state, model = build("dense", "cpu", 0)
    ids = torch.randint(0, model.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
    ref = gradients(state, model, ids, "bf16", "e4m3")
    got = gradients(state, model, ids, "fp8", fp8_backward.GRAD_FORMAT)
    cos = {name: compare(got[name], r)[0] for name, r in ref.items()}
    assert min(cos.values()) > COSINE_BOUND, min(cos.items(), key=lambda kv: kv[1])
    assert cos["decoder.layers.0.self_attention.linear_qkv.weight"] < 1 - 1e-5
    for name in ("decoder.layers.1.mlp.linear_fc2.weight", "output_layer.weight"):
        assert torch.equal(got[name], ref[name]), name
    assert state.grad_fp8() == "e4m3"


def test_refusals_name_the_flag():
    from megatron_qrl.config.run import RoutingReplayConfig, TrainForwardConfig
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.te_quant import AlignedForwardState, trainer_forward
    from tests.helpers.te_quant_fixtures import tiny_hf

    flag = "--qrl-train-aligned-backward"
    configs = parse_configs(["--qrl-preset", "tiny-cpu", "--qrl-train-forward", "aligned",
                             "--qrl-train-aligned-gemm", "real", flag, "fp8"])[0]
    assert configs["train"].aligned_backward == "fp8"
    _, dense = tiny_hf("dense")
    off = RoutingReplayConfig("off")
    fwd = trainer_forward(TrainForwardConfig("aligned", aligned_gemm="real", aligned_backward="fp8"),
                          "fp8", off, dense)
    assert fwd.aligned.grad_fp8() == "e4m3"
    for bad in ({"aligned_backward": "fp8"},  # forward bf16
                {"forward": "aligned", "aligned_gemm": "fake", "aligned_backward": "fp8"},
                {"forward": "aligned", "aligned_backward": "fp16"}):
        with pytest.raises(ValueError, match=flag):
            TrainForwardConfig(**bad)
    cfg = TrainForwardConfig("aligned", aligned_gemm="real", aligned_backward="fp8")
    with pytest.raises(ValueError, match=f"{flag} fp8 needs per-channel E4M3.*int8"):
        trainer_forward(cfg, "int8", off, dense)
    with pytest.raises(ValueError, match=f"{flag} fp8: a Transformer Engine recipe"):
        trainer_forward(TrainForwardConfig("aligned", aligned_backward="fp8"), "fp8", off, dense,
                        te_recipe=True)
    with pytest.raises(ValueError, match=f"{flag} fp8 multiplies the real GEMM"):
        AlignedForwardState("fp8", gemm="fake", backward="fp8")
    with pytest.raises(ValueError, match=f"{flag} fp8 needs per-channel E4M3.*block"):
        fp8_backward.check_fp8_backward(get_spec("fp8_block"), "real")
    x, w, grad = _operands(2)
    with pytest.raises(ValueError, match=flag):
        real_linear(x, w, weight_operand(get_spec("int8"), w), get_spec("int8"), grad_fp8="e4m3")
