"""The fake-quant fast path (:meth:`QuantSpec.quantize_dequantize`, each format's
``_fake_quant``) == ``dequantize(quantize_weight(w))`` bit for bit: values AND sign bits
(``-0.0`` vs ``0.0``), random and constructed weights (ties, zeros, subnormal block scales,
saturation), scalar and per-row ``global_amax``, bf16 and fp32, one weight and stacked."""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.quant import numerics
from megatron_qrl.quant.formats import channel, fp8_block, nvfp4, w4a16  # noqa: F401
from megatron_qrl.quant.spec import QuantSpec, get_spec
from megatron_qrl.quant.stacked import fake_quant_many, fused_amax
from megatron_qrl.te_quant.shard_quant import FusionLayout, quantize_shards_stacked

FAST = ["nvfp4", "w4a16", "int8", "fp8", "fp8_block"]
DTYPES = [torch.float32, torch.bfloat16]
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT[t.dtype])


def _assert_bits(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.equal(got, ref)
    assert torch.equal(_bits(got), _bits(ref)), "same values, different bits (signed zero?)"


def _ref(spec, w, ga=None):
    return spec.dequantize(spec.quantize_weight(w, global_amax=ga))


def _check(spec, w, ga=None):
    _assert_bits(spec.quantize_dequantize(w, global_amax=ga), _ref(spec, w, ga))


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).mul(3)
    w[0, :7] = -0.0
    w[1, :5] = 0.0
    w[2, 3:9] = -1e-30  # tiny negatives: round to -0 before the sign rule
    return w.to(dtype)


@pytest.mark.parametrize("fmt", FAST)
def test_fast_path_is_overridden_and_used(fmt, monkeypatch):
    """The format has its own ``_fake_quant`` and ``quantize_dequantize`` never builds codes."""
    spec = get_spec(fmt)
    assert type(spec)._fake_quant is not QuantSpec._fake_quant

    def no_codes(*_a, **_k):
        raise AssertionError("fast path built codes")

    monkeypatch.setattr(type(spec), "_quantize", no_codes)
    spec.quantize_dequantize(torch.randn(128, 256))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(256, 512), (3, 128), (130, 384), (128, 2048)])
@pytest.mark.parametrize("fmt", FAST)
def test_random_weights(fmt, shape, dtype):
    spec = get_spec(fmt)
    w = _random(shape, dtype, seed=shape[0] + shape[1])
    _check(spec, w)
    _check(spec, w * 1e-3)  # other exponents: subnormal-ish block scales for nvfp4
    if spec.shares_tensor_scale:
        _check(spec, w, 2.5)  # scalar global amax (a fused group's shared one)
        _check(spec, w, w.float().abs().max() * 3)
        per_row = torch.rand(shape[0], 1, generator=torch.Generator().manual_seed(1)) * 4 + 0.01
        _check(spec, w, per_row)  # a row-stack (quant/stacked.py)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FAST)
def test_zero_and_constant_weights(fmt, dtype):
    spec = get_spec(fmt)
    _check(spec, torch.zeros(128, 256, dtype=dtype))
    _check(spec, torch.full((128, 256), -0.0, dtype=dtype))
    _check(spec, torch.full((128, 256), -3.0, dtype=dtype))
    _check(spec, torch.full((128, 256), 2.0**-26, dtype=dtype))  # below ModelOpt's zero amax
    if spec.shares_tensor_scale:
        _check(spec, torch.zeros(128, 256, dtype=dtype), torch.zeros(128, 1))


def test_e2m1_round_equals_encode_decode_everywhere():
    """Every fp32 within 64 ulps of each signed tie / zero, E2M1 grid points, saturation and
    random bit patterns: ``e2m1_round == e2m1_decode(e2m1_encode)`` including signed zeros."""
    pts = [0.0, 6.0, 7.0, 1e30, 2.0**-149, 1.0, 2.0, 3.0, 4.0, *numerics._E2M1_BOUNDS]
    base = torch.tensor(pts + [-p for p in pts], dtype=torch.float32)
    near = [base]
    up, down = base.clone(), base.clone()
    for _ in range(64):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, -float("inf")))
        near += [up, down]
    g = torch.Generator().manual_seed(0)
    rnd = torch.randint(-2**31, 2**31 - 1, (200_000,), generator=g, dtype=torch.int64)
    rnd = rnd.to(torch.int32).view(torch.float32)
    x = torch.cat([*near, torch.tensor([-0.0]), rnd[torch.isfinite(rnd)],
                   torch.linspace(-8, 8, 100_001)])
    _assert_bits(numerics.e2m1_round(x), numerics.e2m1_decode(numerics.e2m1_encode(x)))


def _nvfp4_edge_weight() -> torch.Tensor:
    """Blocks of 16 whose scaled values (s2 = 2^-10 from global amax 2.625, block scale 1)
    sit exactly on the ties, on zero, or need a subnormal / clamped e4m3 block scale."""
    d = 2.0**-10
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    rows = [
        [6.0, *ties, *[-t for t in ties], -0.0],
        [-6.0, *[-t for t in ties], *ties, 0.0],
        [6.0, 0.0, -0.0, -0.1, 0.1, -0.2, 5.5, -5.5, 4.5, 3.2, -2.9, 1.1, -0.6, 0.4, 2.2, -1.6],
        [0.0] * 16,  # all-zero block: scale 1
        [-0.0] * 15 + [0.0],
        [2.0**-8 * 6 * v for v in (1.0, -0.5, 0.25, 0.75, 0.3)] + [0.0] * 11,  # subnormal e4m3
        [2.0**-12 * v for v in (1.0, -0.7, 0.2)] + [0.0] * 13,  # block scale clamped at 2^-9
        [900.0 * v for v in (6.0, -5.0, 1.75, 3.5)] + [0.0] * 12,  # clamped at 448: saturation
    ]
    return torch.tensor(rows, dtype=torch.float32).mul(d).reshape(2, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_constructed_ties_zeros_subnormals_saturation(dtype):
    spec = get_spec("nvfp4")
    w = _nvfp4_edge_weight().to(dtype)
    codes = spec.quantize_weight(w.float(), global_amax=2.625).codes
    assert (codes == 8).any() and (codes == 0).any()  # -0 and +0 codes both occur
    for ga in (2.625, torch.tensor([[2.625], [2.625]]), None, 1e-6, torch.tensor([[1e-6], [9.0]])):
        _check(spec, w, ga)
        _check(spec, -w, ga)


@pytest.mark.parametrize("dtype", DTYPES)
def test_w4a16_constructed_ties_and_bf16_scale_rounding(dtype):
    """Group scale 2^-4 (amax 7 * 2^-4): x.5 ties both ways; negatives that round to -0; a
    group whose bf16 scale rounds down the most (|w / s| up to 7.03); a group at the zero
    rule's threshold; huge values."""
    spec = get_spec("w4a16")
    s = 2.0**-4
    ties = [v + 0.5 for v in range(-8, 7)]  # -7.5 .. 6.5
    g0 = [7.0, *ties, -0.3, 0.3, -0.0, 0.0] + [0.0] * (128 - 20)
    a = 7 * (1 + 2.0**-8 - 2.0**-20)  # bf16(a / 7) = 1: the largest round-down
    g1 = [a, -a, 6.9, -7.02] + [0.49] * 124
    g2 = [2.0**-24, -(2.0**-24)] + [2.0**-25] * 126  # amax == ZERO_AMAX_EPS: scale 1, codes 0
    g3 = [1e30, -3e29, 1e-30] + [-1.0] * 125
    w = torch.tensor([[v * s for v in g0] + g1, g2 + g3], dtype=torch.float32)
    q = spec.quantize_weight(w).codes
    assert int(q.abs().max()) == 7
    _check(spec, w.to(dtype))
    _check(spec, (-w).to(dtype))


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_block"])
def test_w8_constructed_rows(fmt):
    rows = torch.tensor([[127.0, -63.5, 62.5, 0.5, -0.5, -0.3, 1.5, -0.0] * 16,
                         [2.0**-25, -(2.0**-24)] + [0.0] * 126,
                         [1e30, -1e-30] + [-0.0] * 126])
    for dtype in DTYPES:
        _check(get_spec(fmt), rows.to(dtype))


@pytest.mark.parametrize("fmt", FAST)
def test_non_finite_weights_raise(fmt):
    spec = get_spec(fmt)
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = torch.randn(128, 256)
        w[5, 17] = bad
        with pytest.raises(ValueError, match="1 non-finite"):
            spec.quantize_dequantize(w, name="w")
        with pytest.raises(ValueError, match="non-finite"):
            fake_quant_many(spec, [torch.randn(128, 256), w])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FAST)
def test_fake_quant_many_and_shards_stacked(fmt, dtype):
    """Stacked calls (per-row tensor scales for nvfp4) == the per-weight reference."""
    spec = get_spec(fmt)
    ws = [_random((128, 256), dtype, seed=i) for i in range(6)]
    ws[3] = torch.zeros_like(ws[3])
    amaxes = [None, 2.5, None, None, None, torch.tensor(0.01)]
    for ga in (None, amaxes):
        got = fake_quant_many(spec, ws, global_amax=ga)
        for i, (g, w) in enumerate(zip(got, ws)):
            _assert_bits(g, spec.dequantize(spec.quantize_weight(
                w, global_amax=None if ga is None else ga[i]), dtype=w.dtype))
    layouts = [FusionLayout("gate_up")] * 3
    fused = [torch.cat([ws[2 * i], ws[2 * i + 1]]) for i in range(3)]
    got = quantize_shards_stacked(spec, fused, layouts)
    shared = fused_amax(ws, [2] * 3) if spec.shares_tensor_scale else [None] * 6
    for i, g in enumerate(got):
        ref = [spec.dequantize(spec.quantize_weight(ws[j], global_amax=shared[j]), dtype=dtype)
               for j in (2 * i, 2 * i + 1)]
        _assert_bits(g, torch.cat(ref))


@pytest.mark.parametrize("fmt", FAST)
def test_fake_quant_weight_straight_through(fmt):
    spec = get_spec(fmt)
    w = torch.randn(128, 256, requires_grad=True)
    out = spec.fake_quant_weight(w)
    _assert_bits(out.detach(), _ref(spec, w.detach()))
    up = torch.randn_like(out)
    out.backward(up)
    assert torch.equal(w.grad, up)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200 check)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FAST)
def test_cuda_fast_path_equals_reference_and_cpu(fmt, dtype):
    """On the GPU the training forward's fake-quant (fast path) must equal the codes the
    rollout's packing makes there (CUDA reference), and both the CPU reference."""
    spec = get_spec(fmt)
    w = _random((512, 1024), dtype, seed=7)
    gas = [None] + ([torch.rand(512, 1, generator=torch.Generator().manual_seed(2)) * 4 + 0.01]
                    if spec.shares_tensor_scale else [])
    for ga in gas:
        got = spec.quantize_dequantize(w.cuda(), global_amax=None if ga is None else ga.cuda())
        _assert_bits(got, _ref(spec, w.cuda(), None if ga is None else ga.cuda()))
        _assert_bits(got.cpu(), _ref(spec, w, ga))
