"""H200: the aligned forward's real low-bit GEMMs (``te_quant.real_gemm``) on CUDA.

1. Kernels: fp8 ``torch._scaled_mm`` / int8 ``torch._int_mm`` on the spec's codes vs the fake
   path's BF16 GEMM of the dequantized operands, within the bound of
   ``tests/te_quant/test_real_gemm.py`` (BF16 rounding of the operands and the output), on
   aligned and unaligned (padded) shapes; the codes equal the CPU quantizer's bit for bit;
   gradients bit-equal the fake path's.
2. Engine: the same codes through sgl_kernel's ``fp8_scaled_mm`` / ``int8_scaled_mm`` (what
   SGLang's ``w8a8_fp8`` / ``w8a8_int8`` linears run): int8 at most one BF16 ulp apart (exact
   int32 sums, the scales' product order); fp8 within the kernel-vs-fake bound (summation
   order of the FP8 accumulation), and closer to the engine than ``torch._scaled_mm`` with the
   other accumulation (``real_gemm.FAST_ACCUM``); bit-equal fraction and ulps printed.
3. Models (BF16, local spec): a tiny dense Qwen3 and a tiny Qwen3-MoE with stacked experts
   (fp8: one ``torch._scaled_grouped_mm`` per expert GEMM, counted). Real and fake logits of
   a BF16 model drift apart layer by layer (each activation quantizer turns a small dense
   difference into larger sparse code flips: measured 0.055 -> 0.077 over the two layers for
   fp8, on the CPU as on the H200), so the check is what alignment needs: the first quantized
   GEMM within one GEMM's rounding of fake, and logits / gradients at most half as far as
   fake's from the engine's GEMM on the same codes (sgl_kernel's; int8: and the exact sum; not
   fp8's exact sum, which Hopper's FP8 accumulator does not compute). Reasoning,
   numbers and the mutations caught: tests/te_quant/test_real_gemm_model.py.
4. FP8 backward (``--qrl-train-aligned-backward fp8``): the input gradient's
   ``torch._scaled_mm`` (dense; stacked experts: ``_scaled_grouped_mm``) vs its fp64
   emulation, within the FP8 tensor-core accumulation (13 fraction bits, truncating:
   ``tests/helpers/fp8_accum.py``) and one BF16 rounding, and its distance to the BF16 dgrad
   in the band of its element type.
5. FP8 weight gradient (``--qrl-train-aligned-wgrad fp8``): ``torch._scaled_mm`` of the
   per-channel quantized ``g * sx`` and the forward's saved activation codes vs its fp64
   emulation (dense; stacked experts per expert), within the same accumulation bound.
6. BF16 backward of the stacked experts: two GEMMs, gradients bit-equal autograd of the fake
   path's grouped GEMM (torch's CUDA ``_grouped_mm`` derivative formulas, and the padded path).

Run: ``pytest tests/gpu/test_real_gemm.py -s -rs`` (< 1 min).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = [pytest.mark.gpu]

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

# the fake path's BF16 GEMM with fp32 reductions (the bound assumes them)
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

from megatron_qrl.quant import get_spec  # noqa: E402
from megatron_qrl.te_quant.real_gemm import (  # noqa: E402
    activation_operand,
    device_info,
    kernel_for,
    real_linear,
    select_gemm,
    weight_operand,
)

FORMATS = [f for f in ("fp8", "int8")
           if select_gemm(get_spec(f), device_info(), "auto").gemm == "real"]
if not FORMATS:
    pytest.skip(f"no real GEMM on this GPU ({device_info()})", allow_module_level=True)


def _operands(m, k, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) * 4
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    return x.bfloat16(), w.bfloat16()


def _bound(spec, x, w, y_fake):
    a = spec.fake_quant_activation(x).double().abs() @ spec.quantize_dequantize(w).double().abs().t()
    return (2.0 ** -8 * (1 + 2.0 ** -8) + x.shape[1] * 2.0 ** -24) * a + 2.0 ** -8 * y_fake.double().abs()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(512, 2560, 1024), (10, 72, 40)])
def test_kernel_vs_fake_and_codes(fmt, shape):
    spec = get_spec(fmt)
    x, w = _operands(*shape)
    qw = weight_operand(spec, w)
    cpu = spec.quantize_weight(w.cpu())
    assert torch.equal(qw.codes.cpu().view(torch.int8), cpu.codes.view(torch.int8))
    assert torch.equal(qw.scale.cpu(), cpu.scale)
    xq, xs = activation_operand(spec, x)
    real = kernel_for(spec)(xq, xs, qw.codes, qw.scale, torch.bfloat16)
    fake = spec.fake_quant_activation(x) @ spec.quantize_dequantize(w).t()
    err = (real.double() - fake.double()).abs()
    ratio = (err / _bound(spec, x, w, fake).clamp_min(1e-30)).max().item()
    print(f"\n{fmt} {shape}: max |real - fake| {err.max().item():.3g}, max err / bound "
          f"{ratio:.3f}, bit-equal {(err == 0).double().mean().item():.4f}")
    assert ratio <= 1.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_gradients_equal_the_fake_path(fmt):
    _gradients_equal_the_fake_path(get_spec(fmt))


def _real_and_fake_grads(spec):
    """One [256, 1024] x [512, 1024] linear's backward on the real GEMM and on the fake path,
    the same operands and output gradient: ``(xr, wr, xf, wf, g)`` with ``.grad`` filled."""
    x, w = _operands(256, 1024, 512, seed=1)
    g = torch.randn(256, 512, device="cuda").bfloat16()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    real_linear(xr, wr, weight_operand(spec, w), spec).backward(g)
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    (spec.fake_quant_activation(xf) @ spec.fake_quant_weight(wf).t()).backward(g)
    return xr, wr, xf, wf, g


def _gradients_equal_the_fake_path(spec):
    xr, wr, xf, wf, _ = _real_and_fake_grads(spec)
    assert torch.equal(xr.grad, xf.grad) and torch.equal(wr.grad, wf.grad)


def _engine(fmt):
    try:
        import sgl_kernel
    except Exception as exc:  # noqa: BLE001 - any import failure: skip with its reason
        pytest.skip(f"sgl_kernel not importable: {exc}")
    return {"fp8": sgl_kernel.fp8_scaled_mm, "int8": sgl_kernel.int8_scaled_mm}[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_real_gemm_equals_the_engine_kernel(fmt):
    spec = get_spec(fmt)
    mm = _engine(fmt)
    x, w = _operands(512, 2560, 1024, seed=2)
    qw = weight_operand(spec, w)
    xq, xs = activation_operand(spec, x)
    ours = kernel_for(spec)(xq, xs, qw.codes, qw.scale, torch.bfloat16)
    kw = {"bias": None} if fmt == "int8" else {}
    theirs = mm(xq, qw.codes.t(), xs, qw.scale, out_dtype=torch.bfloat16, **kw)
    diff = (ours.double() - theirs.double()).abs()
    ulp = 2.0 ** -7 * theirs.double().abs().clamp_min(2.0 ** -126)  # one bf16 ulp (upper bound)
    print(f"\n{fmt} vs sgl_kernel: bit-equal {(diff == 0).double().mean().item():.4f}, "
          f"max diff / ulp {(diff / ulp).max().item():.3f}")
    limit = ulp if fmt == "int8" else _bound(spec, x, w, theirs)
    assert (diff <= limit).all()
    if fmt == "fp8":  # the accumulation the forward picks is the one closer to the engine's
        from megatron_qrl.te_quant.real_gemm import FAST_ACCUM, scaled_mm

        other = scaled_mm(xq, xs, qw.codes, qw.scale, torch.bfloat16, fast_accum=not FAST_ACCUM)
        d_other = (other.double() - theirs.double()).abs()
        print(f"fp8 with use_fast_accum={not FAST_ACCUM}: bit-equal to sgl_kernel "
              f"{(d_other == 0).double().mean().item():.4f}, mean |diff| "
              f"{d_other.mean().item():.3e} (ours {diff.mean().item():.3e})")
        assert diff.mean() <= d_other.mean()


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def megatron():
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        yield


def _engine_gemm(fmt):
    """The engine's kernel as a real GEMM ``fn(xq, xs, wq, ws, out_dtype)``, rows padded to 16."""
    from megatron_qrl.te_quant.real_gemm import _pad

    mm = _engine(fmt)
    kw = {"bias": None} if fmt == "int8" else {}

    def gemm(xq, xs, wq, ws, out_dtype, cuda_shapes=None):
        m = xq.shape[0]
        y = mm(_pad(xq, 0, 16), wq.t(), _pad(xs, 0, 16), ws, out_dtype=torch.bfloat16, **kw)
        return y[:m].to(out_dtype)
    return gemm


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_model_real_closer_to_the_engine_than_fake(megatron, kind, fmt):
    """BF16 tiny model: the first quantized GEMM within one GEMM's rounding of fake; logits and
    gradients at most half as far as fake's from the engine's GEMM on the same codes:
    sgl_kernel's own, and for int8 the exact sum too. Not the exact sum for fp8: Hopper's FP8
    MMA accumulates with 13 fraction bits (tests/helpers/fp8_accum.py), so neither the engine
    nor the real GEMM computes it (on the H200 the real logits were 0.067 from it, fake's
    0.077; on the CPU, where ``_scaled_mm`` sums in fp32, 0.010:
    tests/te_quant/test_real_gemm_model.py). Why not a real-vs-fake bound, and the mutations
    each check catches: tests/te_quant/test_real_gemm_model.py."""
    from tests.helpers.real_gemm_model import check_model, exact_gemm

    refs = {"exact": exact_gemm} if fmt == "int8" else {}
    try:
        refs["sgl_kernel"] = _engine_gemm(fmt)
    except pytest.skip.Exception as exc:
        if not refs:
            raise
        print(f"\nno sgl_kernel reference: {exc}")
    check_model(kind, fmt, "cuda", refs)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_model_real_runs_the_low_bit_kernels(megatron, kind, fmt):
    """The real model's forward runs ``_scaled_mm`` (fp8; MoE on sm 9.x:
    ``_scaled_grouped_mm``) / ``_int_mm`` (int8)."""
    from tests.helpers.real_gemm_model import build_bf16, run

    state, model, x, pos = build_bf16(kind, fmt, "cuda")
    ops = _Ops()
    with ops:
        run(state, model, x, pos, "real")
    names = ops.names
    print(f"\n{kind} {fmt}: {sorted({n for n in names if 'mm' in n})}")
    assert "_scaled_mm" in names if fmt == "fp8" else "_int_mm" in names
    if kind == "moe" and fmt == "fp8" and torch.cuda.get_device_capability()[0] == 9:
        assert "_scaled_grouped_mm" in names


# ---- fp8_block: SGLang's own block-FP8 kernels (te_quant.block_gemm) --------------------------
BLOCK = get_spec("fp8_block")


def _block_or_skip():
    choice = select_gemm(BLOCK, device_info(), "auto")
    if choice.gemm != "real":
        pytest.skip(f"fp8_block real GEMM not here: {choice.reason}")


def _same_codes_fake(xq, xs, qw):
    """The fake path's BF16 GEMM of the same codes (dequantized operands, fp32 reductions)."""
    from megatron_qrl.te_quant.block_gemm import dequantize_groups

    return dequantize_groups(xq, xs, torch.bfloat16) @ qw.dequantize(BLOCK, torch.bfloat16).t()


@pytest.mark.parametrize("shape", [(512, 2560, 1024), (16, 384, 200), (1, 2048, 6144)])
def test_block_kernel_vs_fake_on_the_same_codes(shape):
    """SGLang's Triton block GEMM vs the fake path's BF16 GEMM of the same codes: within the
    bound of the per-channel kernels (BF16 rounding of the dequantized operands and of the
    output, fp32 sums); weight codes / ``weight_scale_inv`` equal the CPU quantizer's."""
    _block_or_skip()
    x, w = _operands(*shape)
    qw = weight_operand(BLOCK, w)
    cpu = BLOCK.quantize_weight(w.cpu())
    assert torch.equal(qw.codes.cpu().view(torch.int8), cpu.codes.view(torch.int8))
    assert torch.equal(qw.scale.cpu(), cpu.scale)
    assert qw.scale.shape == (-(-shape[2] // 128), shape[1] // 128)
    xq, xs = activation_operand(BLOCK, x)
    real = kernel_for(BLOCK)(xq, xs, qw.codes, qw.scale, torch.bfloat16)
    fake = _same_codes_fake(xq, xs, qw)
    a = (xq.double() * xs.double().repeat_interleave(128, 1)).abs() @ \
        qw.dequantize(BLOCK, torch.float32).double().abs().t()
    bound = (2.0 ** -8 * (1 + 2.0 ** -8) + shape[1] * 2.0 ** -24) * a \
        + 2.0 ** -8 * fake.double().abs()
    err = (real.double() - fake.double()).abs()
    print(f"\nfp8_block {shape}: max |real - fake| {err.max().item():.3g}, max err / bound "
          f"{(err / bound.clamp_min(1e-30)).max().item():.3f}, bit-equal "
          f"{(err == 0).double().mean().item():.4f}")
    assert (err <= bound).all()


def test_block_activation_codes_within_the_fast_division():
    """SGLang's ``per_token_group_quant_fp8`` vs fp8_block's activation quantizer
    (``e4m3(x * (448 / a))``, scale ``a * (1 / 448)``): scales bit-equal; codes equal but where
    the kernel's approximate ``448 / a`` (built with ``--use_fast_math``) moves ``x * 448 / a``
    across an E4M3 rounding midpoint, to the adjacent code
    (:func:`tests.helpers.group_codes.mismatches`; bit-equality failed on the H200 with SGLang
    0.5.17). The fraction of differing codes is printed."""
    from tests.helpers.group_codes import mismatches

    _block_or_skip()
    x, _ = _operands(4096, 2048, 128, seed=3)
    x[5] = 0
    xq, xs = activation_operand(BLOCK, x)
    n, bad = mismatches(x, xq, xs)
    print(f"\nfp8_block activations: SGLang vs spec differ in {n / x.numel():.2e} of codes")
    assert not bad, bad


def test_block_gradients_equal_the_fake_path():
    """dx bit-equal the fake path's straight-through gradient; dW bit-equal the fake path's
    GEMM on the real forward's activation operand (SGLang's codes dequantized), i.e. today's
    gradients up to the forward's rounding: the activation codes, which differ from the
    spec's at rounding midpoints only (:func:`test_block_activation_codes_within_the_fast_division`);
    every dW column whose activation codes all equal the spec's is bit-equal to the fake
    path's."""
    from megatron_qrl.te_quant.block_gemm import dequantize_groups

    _block_or_skip()
    xr, wr, xf, wf, g = _real_and_fake_grads(BLOCK)
    assert torch.equal(xr.grad, xf.grad)
    x, w = xr.detach(), wr.detach()
    engine_x = dequantize_groups(*activation_operand(BLOCK, x), x.dtype)
    we = w.clone().requires_grad_()
    (engine_x @ BLOCK.fake_quant_weight(we).t()).backward(g)
    assert torch.equal(wr.grad, we.grad)
    same = (engine_x == BLOCK.fake_quant_activation(x)).all(dim=0)
    print(f"\nfp8_block dW: {int((~same).sum())} of {same.numel()} columns take a differing code")
    assert torch.equal(wr.grad[:, same], wf.grad[:, same])


@pytest.mark.parametrize("shape", [(512, 2560, 1024), (3, 384, 200)])
def test_block_equals_sglangs_own_linear(shape):
    """The real forward vs SGLang's ``triton_w8a8_block_fp8_linear`` (its FP8 block linear with
    DeepGEMM off) on the same weight codes and ``weight_scale_inv``: bit-equal, the same two
    kernels on the same inputs."""
    _block_or_skip()
    from sglang.srt.layers.quantization.fp8_utils import triton_w8a8_block_fp8_linear

    m, k, n = shape
    x, w = _operands(2 * m, k, n, seed=4)
    x = x.view(2, m, k)
    qw = weight_operand(BLOCK, w)
    ours = real_linear(x, w, qw, BLOCK)
    theirs = triton_w8a8_block_fp8_linear(x, qw.codes, [128, 128], qw.scale)
    assert ours.shape == theirs.shape == (2, m, n) and ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs)


# ---- --qrl-train-aligned-backward fp8: the input gradient as a torch._scaled_mm ---------------
def _fp8_dgrad_operands(m, k, n, seed):
    x, w = _operands(m, k, n, seed=seed)
    g = torch.randn(m, n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    g = g.bfloat16()
    g[1] = 0  # an all-zero gradient row
    return x, w, g


def _dgrad_bound(grad, codes, scale, fmt, exact):
    """``|got - exact|`` of the BF16 dgrad from an FP8 tensor-core GEMM: Hopper's FP8 MMA
    accumulates with 13 fraction bits, truncating (not fp32: an fp32 bound, ``(N + 2) 2^-24``
    of ``sum |terms|``, failed on the H200 by 1.2-1.5x on the small shape, where ``N`` is small
    and the BF16 rounding no longer covers the accumulator), then the fp32 row scale and one
    BF16 rounding: :func:`tests.helpers.fp8_accum.fp8_gemm_bound`, derived there and checked
    against an emulation of the accumulator in tests/te_quant/test_fp8_accum.py."""
    from megatron_qrl.te_quant.fp8_backward import folded_grad, quantize_grad_rows
    from tests.helpers.fp8_accum import fp8_gemm_bound

    qg, sg = quantize_grad_rows(folded_grad(grad, scale), fmt)
    return fp8_gemm_bound(qg, codes, sg, exact)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(512, 2560, 1024), (10, 72, 40)])
def test_fp8_dgrad_scaled_mm_equals_the_emulation(fmt, shape):
    """``torch._scaled_mm`` on the weight's transposed codes (``RealWeight.codes_t``,
    column-major B; unaligned shapes zero-padded) vs the exact emulation
    (:func:`~megatron_qrl.te_quant.fp8_backward.dgrad_fp8_reference`): within the FP8
    tensor-core accumulation and the BF16 output rounding (:func:`_dgrad_bound`). Mutations
    caught: the weight scale not folded into the
    gradient, ``codes`` for ``codes_t`` (the wrong transpose), E4M3 / E5M2 swapped (the
    distance to the BF16 dgrad: E4M3 measured 2.7e-2 on the CPU, E5M2 5.3e-2)."""
    if "fp8" not in FORMATS:
        pytest.skip("no fp8 real GEMM on this GPU")
    from megatron_qrl.te_quant.fp8_backward import GRAD_DTYPES, dgrad_fp8_reference

    if fmt == "e5m2":
        _e5m2_rowwise_or_skip(GRAD_DTYPES[fmt])
    spec = get_spec("fp8")
    x, w, g = _fp8_dgrad_operands(*shape, seed=5)
    qw = weight_operand(spec, w)
    xr = x.clone().requires_grad_()
    real_linear(xr, w, qw, spec, grad_fp8=fmt).backward(g)
    ref = dgrad_fp8_reference(g, qw.codes, qw.scale, torch.float64, fmt)
    err = (xr.grad.double() - ref).abs()
    ratio = (err / _dgrad_bound(g, qw.codes, qw.scale, fmt, ref).clamp_min(1e-30)).max().item()
    bf16 = (g @ qw.dequantize(spec, torch.bfloat16)).double()
    rel = ((xr.grad.double() - bf16).norm() / bf16.norm()).item()
    same = (xr.grad == ref.to(torch.bfloat16)).double().mean().item()
    print(f"\nfp8 dgrad {fmt} {shape}: max err / bound {ratio:.3f}, equal to the rounded "
          f"emulation {same:.4f}, rel L2 to the BF16 dgrad {rel:.3e}")
    assert ratio <= 1.0 and xr.grad[1].eq(0).all()
    assert {"e4m3": 2.0 ** -8 < rel < 3.5e-2, "e5m2": 3.5e-2 < rel < 7e-2}[fmt]


def _e5m2_rowwise_or_skip(dtype):
    """Skip with torch's reason where its row-wise ``_scaled_mm`` refuses an E5M2 ``A`` with
    E4M3 ``B`` (the bench's E5M2 rows then come from the CPU)."""
    a = torch.ones(16, 16, device="cuda").to(dtype)
    b = torch.ones(16, 16, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones(16, 1, device="cuda")
    try:
        torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one.t().contiguous(),
                         out_dtype=torch.bfloat16)
    except RuntimeError as exc:
        pytest.skip(f"torch._scaled_mm (row-wise) refuses E5M2 x E4M3: {exc}")


def test_fp8_dgrad_grouped_equals_per_expert_emulation():
    """Stacked experts: the FP8 dgrad (``torch._scaled_grouped_mm`` on sm 9.x, else one
    ``_scaled_mm`` per expert) vs each expert's emulation with its own weight scale, within
    the FP8 tensor-core accumulation bound (:func:`_dgrad_bound`; the fp32 bound failed for
    expert 0 on the H200). Mutation caught: expert 0's weight scale for every expert (the
    experts' weights differ by factors of 2)."""
    if "fp8" not in FORMATS:
        pytest.skip("no fp8 real GEMM on this GPU")
    from megatron_qrl.te_quant.fp8_backward import dgrad_fp8_reference
    from megatron_qrl.te_quant.real_gemm import RealWeight, grouped_real_linear

    spec, counts = get_spec("fp8"), [96, 0, 160, 32]
    x, _, g = _fp8_dgrad_operands(sum(counts), 512, 256, seed=6)
    ws = [_operands(8, 512, 256, seed=20 + e)[1] * 2.0 ** e for e in range(len(counts))]
    qws = [weight_operand(spec, w) for w in ws]
    qw = RealWeight(torch.stack([q.codes for q in qws]), torch.stack([q.scale for q in qws]))
    xr, master = x.clone().requires_grad_(), torch.stack(ws).requires_grad_()
    ops = _Ops()
    with ops:
        grouped_real_linear(xr, [master], qw, spec, counts, grad_fp8="e4m3").backward(g)
    start = 0
    for e, c in enumerate(counts):
        rows = slice(start, start + c)
        start += c
        if not c:
            continue
        ref = dgrad_fp8_reference(g[rows], qws[e].codes, qws[e].scale, torch.float64)
        err = (xr.grad[rows].double() - ref).abs()
        assert (err <= _dgrad_bound(g[rows], qws[e].codes, qws[e].scale, "e4m3", ref)).all(), e
    if torch.cuda.get_device_capability()[0] == 9:
        assert ops.names.count("_scaled_grouped_mm") == 2  # the forward's and the dgrad's


# ---- --qrl-train-aligned-wgrad fp8: the weight gradient as a torch._scaled_mm ----------------
def _wgrad_bound(grad, act_codes, act_scale, fmt, exact):
    """``|got - exact|`` of the BF16 wgrad from an FP8 tensor-core GEMM (``A = Q_col(g sx)^T``
    with its per-output-channel scale, ``B`` the activation codes; the sum runs over the
    tokens): :func:`tests.helpers.fp8_accum.fp8_gemm_bound`, as :func:`_dgrad_bound`."""
    from megatron_qrl.te_quant.fp8_backward import folded_grad_t, quantize_grad_rows
    from tests.helpers.fp8_accum import fp8_gemm_bound

    qh, sh = quantize_grad_rows(folded_grad_t(grad, act_scale), fmt)
    return fp8_gemm_bound(qh, act_codes, sh, exact)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(512, 2560, 1024), (10, 72, 40)])
def test_fp8_wgrad_scaled_mm_equals_the_emulation(fmt, shape):
    """``torch._scaled_mm`` of the per-channel quantized ``g * sx`` and the forward's saved
    activation codes (column-major B; tokens, the contraction, zero-padded to 16 where needed)
    vs the exact emulation (:func:`~megatron_qrl.te_quant.fp8_backward.wgrad_fp8_reference`):
    within the FP8 tensor-core accumulation and the BF16 output rounding (:func:`_wgrad_bound`);
    dx stays the BF16 backward's bit for bit. Mutations caught: the token scale not folded or
    folded into the output channels, the gradient scale per token instead of per channel,
    E4M3 / E5M2 swapped (the distance to the BF16 wgrad: one shape or the other leaves its
    band)."""
    if "fp8" not in FORMATS:
        pytest.skip("no fp8 real GEMM on this GPU")
    from megatron_qrl.te_quant.fp8_backward import GRAD_DTYPES, wgrad_fp8_reference

    if fmt == "e5m2":
        _e5m2_rowwise_or_skip(GRAD_DTYPES[fmt])
    spec = get_spec("fp8")
    x, w, g = _fp8_dgrad_operands(*shape, seed=7)
    x = x * torch.logspace(-6, 2, x.shape[0], base=2.0, device="cuda")[:, None].bfloat16()
    g[:, 3] = 0  # an all-zero output channel
    qw, (qx, sx) = weight_operand(spec, w), spec.quantize_activation(x)
    wr, wb = w.clone().requires_grad_(), w.clone().requires_grad_()
    xr, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    real_linear(xr, wr, qw, spec, wgrad_fp8=fmt).backward(g)
    real_linear(xb, wb, qw, spec).backward(g)
    ref = wgrad_fp8_reference(g, qx, sx, torch.float64, fmt)
    err = (wr.grad.double() - ref).abs()
    ratio = (err / _wgrad_bound(g, qx, sx, fmt, ref).clamp_min(1e-30)).max().item()
    bf16 = wb.grad.double()
    rel = ((wr.grad.double() - bf16).norm() / bf16.norm()).item()
    same = (wr.grad == ref.to(torch.bfloat16)).double().mean().item()
    print(f"\nfp8 wgrad {fmt} {shape}: max err / bound {ratio:.3f}, equal to the rounded "
          f"emulation {same:.4f}, rel L2 to the BF16 wgrad {rel:.3e}")
    assert ratio <= 1.0 and wr.grad[3].eq(0).all() and torch.equal(xr.grad, xb.grad)
    # emulated on the CPU (3 seeds): E4M3 1.0-1.2e-2 (small) / 2.5e-2, E5M2 2.0-2.4e-2 / 5.0e-2
    assert {"e4m3": 2.0 ** -8 < rel < 3.5e-2, "e5m2": 1.5e-2 < rel < 7e-2}[fmt]


def test_fp8_wgrad_grouped_equals_per_expert_emulation():
    """Stacked experts: each expert's FP8 wgrad (one ``_scaled_mm`` per expert with tokens) vs
    that expert's emulation over its own tokens, within :func:`_wgrad_bound`; an expert without
    tokens gets zeros. Mutation caught: one gradient scale over all experts' tokens (the
    experts' gradients differ by factors of 16)."""
    if "fp8" not in FORMATS:
        pytest.skip("no fp8 real GEMM on this GPU")
    from megatron_qrl.te_quant.fp8_backward import wgrad_fp8_reference
    from megatron_qrl.te_quant.real_gemm import RealWeight, grouped_real_linear

    spec, counts = get_spec("fp8"), [96, 0, 160, 30]
    x, _, g = _fp8_dgrad_operands(sum(counts), 512, 256, seed=8)
    g = g * torch.tensor([16.0 ** e for e, c in enumerate(counts) for _ in range(c)],
                         device="cuda")[:, None].bfloat16()
    ws = [_operands(8, 512, 256, seed=40 + e)[1] for e in range(len(counts))]
    qws = [weight_operand(spec, w) for w in ws]
    qw = RealWeight(torch.stack([q.codes for q in qws]), torch.stack([q.scale for q in qws]))
    master = torch.stack(ws).requires_grad_()
    grouped_real_linear(x, [master], qw, spec, counts, wgrad_fp8="e4m3").backward(g)
    qx, sx = spec.quantize_activation(x)
    start = 0
    for e, c in enumerate(counts):
        rows = slice(start, start + c)
        start += c
        if not c:
            assert master.grad[e].eq(0).all()
            continue
        ref = wgrad_fp8_reference(g[rows], qx[rows], sx[rows], torch.float64)
        err = (master.grad[e].double() - ref).abs()
        assert (err <= _wgrad_bound(g[rows], qx[rows], sx[rows], "e4m3", ref)).all(), e


@pytest.mark.parametrize("k,n", [(512, 256), (196, 72)], ids=["grouped_mm", "padded"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_bf16_backward_two_gemms_bit_equal(fmt, k, n):
    """Stacked experts, BF16 backward: gradients bit-equal autograd of the fake path's grouped
    GEMM on the same dequantized operands (torch's CUDA ``_grouped_mm`` derivative formulas,
    or the padded ``bmm``'s where rows are not 16-byte aligned), from exactly two GEMMs (no
    forward GEMM run again)."""
    from megatron_qrl.models.grouped_gemm import grouped_mm
    from megatron_qrl.te_quant.real_gemm import RealWeight, grouped_real_linear

    spec, counts = get_spec(fmt), [96, 0, 160, 32]
    x, _ = _operands(sum(counts), k, n, seed=8)
    ws = torch.stack([_operands(8, k, n, seed=30 + e)[1] for e in range(len(counts))])
    qws = [weight_operand(spec, w) for w in ws]
    qw = RealWeight(torch.stack([q.codes for q in qws]), torch.stack([q.scale for q in qws]))
    g = _operands(sum(counts), n, 8, seed=9)[0]
    xr, master = x.clone().requires_grad_(), ws.clone().requires_grad_()
    y = grouped_real_linear(xr, [master], qw, spec, counts)
    ops = _Ops()
    with ops:
        y.backward(g)
    gemms = [o for o in ops.names if o in ("mm", "bmm", "_grouped_mm", "_scaled_mm",
                                           "_scaled_grouped_mm", "_int_mm")]
    assert len(gemms) == 2, gemms
    xf = spec.fake_quant_activation(x).requires_grad_()
    wf = torch.stack([qw.dequantize(spec, torch.bfloat16) for qw in qws]).requires_grad_()
    grouped_mm(xf, wf, counts).backward(g)
    assert torch.equal(xr.grad, xf.grad) and torch.equal(master.grad, wf.grad)
