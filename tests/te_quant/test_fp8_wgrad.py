"""``--qrl-train-aligned-wgrad``: the FP8 weight-gradient GEMM of the real aligned linears.

Closed form (``megatron_qrl/te_quant/fp8_backward.py``): ``dW = Q_col(g * sx)^T @ qx`` with the
forward's per-token activation scale ``sx`` folded into the gradient's rows and the folded
gradient quantized per output channel over the tokens (``amax / MAX`` per column), times the
forward's saved activation codes ``qx``; written out here independently of the module. The CPU
runs ``torch._scaled_mm`` on the CPU (the CUDA kernel: ``tests/gpu/test_real_gemm.py``).

Mutations caught (each checked by hand: mutate, run, restore):
- default no longer BF16 (``real_linear``'s default ``wgrad_fp8="e4m3"``, or
  ``AlignedForwardState.wgrad_fp8`` ignoring ``wgrad``) -> ``test_default_wgrad_is_bf16``;
- the activation scale not folded (``folded_grad_t`` without ``act_scale``), folded on the
  wrong index (into the gradient's columns, the output channels, instead of its rows, the
  tokens: ``act_scale.reshape(1, -1)``), the gradient scale over the wrong dimension (per token
  instead of per output channel: ``folded_grad_t`` without ``.t()``) ->
  ``test_fp8_wgrad_equals_the_closed_form``;
- the activation codes re-quantized or dequantized in the backward (``spec.quantize_activation(
  dequantize_activation(...))`` before the GEMM) -> ``test_fp8_wgrad_multiplies_the_saved_codes``;
- one gradient scale over all experts' tokens (``grouped_wgrad_fp8`` as one ``wgrad_fp8`` of
  all rows, split after) -> ``test_grouped_fp8_wgrad_per_expert``;
- a missing refusal -> ``test_wgrad_refusals_name_the_flag``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_qrl.quant import get_spec
from megatron_qrl.te_quant import fp8_backward
from megatron_qrl.te_quant.real_gemm import (
    real_linear,
    weight_operand,
)
from tests.te_quant.test_fp8_backward import FP8, MAX, experts_case, grouped_grads

FLAG = "--qrl-train-aligned-wgrad"


def _operands(seed: int, m: int = 40, k: int = 96, n: int = 40):
    """``x`` with per-token magnitudes spread over ``2^-6..2^2`` (a token scale not folded, or
    folded on the wrong index, shows at once); ``m == n`` by default so that folding on the
    wrong index is a wrong value, not a shape error."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-6, 3, (m, 1), generator=g))
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    grad = torch.randn(m, n, generator=g).bfloat16()
    grad[:, 3] = 0  # an all-zero output channel (scale 1, no NaN)
    return x.bfloat16(), w, grad


def _closed_form(grad: torch.Tensor, x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``Q_col(g sx)^T @ qx`` per the module doc: the quantization in fp32, the GEMM in fp64."""
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    qx, sx = FP8.quantize_activation(x)
    h = grad.float() * sx.float()  # [M, N]: the token scale on the rows
    sh = h.abs().amax(dim=0, keepdim=True) / MAX[fmt]  # [1, N]: per output channel
    sh = torch.where(sh > 0, sh, torch.ones_like(sh))
    q = (h / sh).clamp(-MAX[fmt], MAX[fmt]).to(dtype)
    return (q.double().t() @ qx.double()) * sh.double().t()


def _grads(x, w, grad, wgrad_fp8, grad_fp8=None):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    real_linear(xr, wr, weight_operand(FP8, w), FP8, grad_fp8=grad_fp8,
                wgrad_fp8=wgrad_fp8).backward(grad)
    return xr.grad, wr.grad


def test_default_wgrad_is_bf16():
    """The default (no ``wgrad_fp8``; the state's and the config's defaults) gives the fake
    path's straight-through weight gradient bit for bit."""
    from megatron_qrl.config.run import TrainForwardConfig
    from megatron_qrl.te_quant import AlignedForwardState

    assert TrainForwardConfig().aligned_wgrad == "bf16"
    assert AlignedForwardState("fp8", gemm="real").wgrad_fp8() is None
    assert AlignedForwardState("fp8", gemm="real", wgrad="fp8").wgrad_fp8() == "e4m3"
    x, w, grad = _operands(0)
    wr = w.clone().requires_grad_()
    real_linear(x, wr, weight_operand(FP8, w), FP8).backward(grad)  # the default arguments
    wf = w.clone().requires_grad_()
    (FP8.fake_quant_activation(x) @ FP8.fake_quant_weight(wf).t()).backward(grad)
    assert torch.equal(wr.grad, wf.grad)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_wgrad_equals_the_closed_form(fmt):
    """dW equals the closed form up to fp32 summation order and one BF16 rounding; dx stays the
    BF16 backward's bit for bit; the reference the GPU test uses agrees exactly."""
    x, w, grad = _operands(1)
    dx, dw = _grads(x, w, grad, fmt)
    want = _closed_form(grad, x, fmt)
    assert dw.dtype == torch.bfloat16 and dw.shape == w.shape
    bound = 2.0 ** -8 * want.abs() + x.shape[0] * 2.0 ** -24 * want.abs().amax()
    assert ((dw.double() - want).abs() <= bound).all()
    assert dw[3].eq(0).all()
    qx, sx = FP8.quantize_activation(x)
    ref = fp8_backward.wgrad_fp8_reference(grad, qx, sx, torch.float64, fmt)
    assert torch.equal(ref, want)
    assert torch.equal(dx, _grads(x, w, grad, None)[0])
    bf16 = _grads(x, w, grad, None)[1].double()
    rel = ((dw.double() - bf16).norm() / bf16.norm()).item()
    assert 2.0 ** -8 < rel < {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}[fmt]


class _Casts(TorchDispatchMode):
    """Records FP8 casts and dequantizations (ops turning FP8 into another dtype) and the
    ``_scaled_mm`` operands."""

    def __init__(self):
        super().__init__()
        self.to_fp8, self.from_fp8, self.mm = 0, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        fp8_in = any(isinstance(a, torch.Tensor) and a.dtype.itemsize == 1 and a.is_floating_point()
                     for a in args)
        if isinstance(out, torch.Tensor) and name not in ("view", "_unsafe_view", "t",
                                                          "transpose", "slice", "alias"):
            if out.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and not fp8_in:
                self.to_fp8 += 1
            elif fp8_in and out.dtype.itemsize > 1:
                self.from_fp8.append(name)
        if name == "_scaled_mm":
            self.mm.append(args[:2])
        return out


def test_fp8_wgrad_multiplies_the_saved_codes():
    """The backward (BF16 dgrad, FP8 wgrad) casts one tensor to FP8 (the gradient), reads FP8
    only in ``_scaled_mm``, and its ``B`` operand is the forward's activation codes bit for bit
    (``[M, K]``, column-major)."""
    x, w, grad = _operands(2)
    wr = w.clone().requires_grad_()
    y = real_linear(x, wr, weight_operand(FP8, w), FP8, wgrad_fp8="e4m3")
    casts = _Casts()
    with casts:
        y.backward(grad)
    assert casts.to_fp8 == 1 and set(casts.from_fp8) == {"_scaled_mm"}, vars(casts)
    (a, b), = casts.mm
    qx, _ = FP8.quantize_activation(x)
    assert a.shape == (w.shape[0], x.shape[0])
    # B is the codes themselves, column-major (``_scaled_mm``'s layout)
    assert b.stride() == (1, x.shape[0]) and torch.equal(b.view(torch.uint8), qx.view(torch.uint8))


def test_grouped_fp8_wgrad_per_expert():
    """Stacked experts: each expert's gradient is quantized over its own tokens; an expert
    without tokens gets a zero gradient; dx stays the BF16 backward's."""
    counts = [12, 0, 20, 8]
    # experts' gradients 16x apart: one scale over all tokens would coarsen the small ones
    case = experts_case(counts, grad_base=16.0)
    x, _, _, _, grad = case
    out = grouped_grads(case, counts, "wgrad_fp8")
    start = 0
    for e, c in enumerate(counts):
        rows = slice(start, start + c)
        start += c
        got = out["e4m3"][1][e].double()
        if not c:
            assert got.eq(0).all()
            continue
        want = _closed_form(grad[rows], x[rows], "e4m3")
        assert ((got - want).abs() <= 2.0 ** -8 * want.abs() + 1e-6 * want.abs().amax()).all(), e
    assert torch.equal(out["e4m3"][0], out[None][0])


COSINE_BOUND = 0.999
"""Lowest cosine of any parameter's FP8-wgrad gradient to the BF16 backward's, tiny dense Qwen3,
one step (bench/fp8_backward.py, seed 0: measured 0.99963 for E4M3, 0.99856 for E5M2)."""


@pytest.fixture(scope="module")
def megatron():
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        yield


def test_model_wgrad_cosine_bound(megatron):
    """Through the model's aligned linears: every weight gradient within the cosine bound of
    the BF16 backward's, layer 0's visibly changed; the input gradient, the norms' and the output
    layer's identical (the dgrad stays BF16 and the FP8 wgrad changes only the aligned weights)."""
    from bench.fp8_backward import build, compare, gradients

    state, model = build("dense", "cpu", 0)
    ids = torch.randint(0, model.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
    ref = gradients(state, model, ids, "bf16", "e4m3")
    got = gradients(state, model, ids, "bf16", fp8_backward.GRAD_FORMAT, wgrad="fp8")
    cos = {name: compare(got[name], r)[0] for name, r in ref.items()}
    assert min(cos.values()) > COSINE_BOUND, min(cos.items(), key=lambda kv: kv[1])
    assert cos["decoder.layers.0.self_attention.linear_qkv.weight"] < 1 - 1e-5
    for name in ("<input>", "decoder.final_layernorm.weight", "output_layer.weight"):
        assert torch.equal(got[name], ref[name]), name
    assert state.wgrad_fp8() == "e4m3" and state.grad_fp8() is None


def test_wgrad_refusals_name_the_flag():
    from megatron_qrl.config.run import RoutingReplayConfig, TrainForwardConfig
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.te_quant import AlignedForwardState, trainer_forward
    from tests.helpers.te_quant_fixtures import tiny_hf

    configs = parse_configs(["--qrl-preset", "tiny-cpu", "--qrl-train-forward", "aligned",
                             "--qrl-train-aligned-gemm", "real", FLAG, "fp8"])[0]
    assert configs["train"].aligned_wgrad == "fp8"
    _, dense = tiny_hf("dense")
    off = RoutingReplayConfig("off")
    cfg = TrainForwardConfig("aligned", aligned_gemm="real", aligned_wgrad="fp8")
    assert trainer_forward(cfg, "fp8", off, dense).aligned.wgrad_fp8() == "e4m3"
    for bad in ({"aligned_wgrad": "fp8"},  # forward bf16
                {"forward": "aligned", "aligned_gemm": "fake", "aligned_wgrad": "fp8"},
                {"forward": "aligned", "aligned_wgrad": "fp16"}):
        with pytest.raises(ValueError, match=FLAG):
            TrainForwardConfig(**bad)
    with pytest.raises(ValueError, match=f"{FLAG} fp8 needs per-token E4M3.*int8"):
        trainer_forward(cfg, "int8", off, dense)
    with pytest.raises(ValueError, match=f"{FLAG} fp8: a Transformer Engine recipe"):
        trainer_forward(TrainForwardConfig("aligned", aligned_wgrad="fp8"), "fp8", off, dense,
                        te_recipe=True)
    with pytest.raises(ValueError, match=f"{FLAG} fp8 multiplies the real GEMM"):
        AlignedForwardState("fp8", gemm="fake", wgrad="fp8")
    for fmt in ("fp8_block", "w4a16", "nvfp4"):
        with pytest.raises(ValueError, match=f"{FLAG} fp8 needs per-token E4M3.*{fmt}"):
            fp8_backward.check_fp8_wgrad(get_spec(fmt), "real")
    x, w, _ = _operands(4)
    with pytest.raises(ValueError, match=FLAG):
        real_linear(x, w, weight_operand(get_spec("int8"), w), get_spec("int8"), wgrad_fp8="e4m3")
