"""H200: the aligned forward's real low-bit GEMMs (``te_quant.real_gemm``) on CUDA.

1. Kernels: fp8 ``torch._scaled_mm`` / int8 ``torch._int_mm`` on the spec's codes vs the fake
   path's BF16 GEMM of the dequantized operands, within the bound of
   ``tests/te_quant/test_real_gemm.py`` (BF16 rounding of the operands and the output), on
   aligned and unaligned (padded) shapes; the codes equal the CPU quantizer's bit for bit;
   gradients bit-equal the fake path's.
2. Engine: the same codes through sgl_kernel's ``fp8_scaled_mm`` / ``int8_scaled_mm`` (what
   SGLang's ``w8a8_fp8`` / ``w8a8_int8`` linears run): int8 at most one BF16 ulp apart (exact
   int32 sums, the scales' product order); fp8 within the kernel-vs-fake bound (summation
   order of the FP8 accumulation); bit-equal fraction and ulps printed.
3. Models (BF16, local spec): a tiny dense Qwen3 and a tiny Qwen3-MoE with stacked experts
   (fp8: one ``torch._scaled_grouped_mm`` per expert GEMM, counted), real vs fake logits and
   gradients; agreement numbers printed. The BF16 model's paths differ by more than one
   GEMM's rounding: a rounding difference moves later activation codes (one int8 code is
   1/127 of the token's amax) and can flip a top-k expert, so the check is a mean relative
   logit difference < 5e-2 and a gradient cosine > 0.99 (a wrong scale gives O(1)).

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
    spec = get_spec(fmt)
    x, w = _operands(256, 1024, 512, seed=1)
    g = torch.randn(256, 512, device="cuda").bfloat16()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    real_linear(xr, wr, weight_operand(spec, w), spec).backward(g)
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    (spec.fake_quant_activation(xf) @ spec.fake_quant_weight(wf).t()).backward(g)
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


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_model_real_vs_fake(megatron, kind, fmt):
    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.stacked_experts import stacked_experts_spec_hook
    from megatron_qrl.models.streaming import groups_from_parallel_state, load_hf_weights
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook, compose_hooks
    from tests.helpers.te_quant_fixtures import hf_state, ids, tiny_hf

    hf, arch = tiny_hf(kind)
    state = AlignedForwardState(fmt)
    hook = compose_hooks(stacked_experts_spec_hook if kind == "moe" else None,
                         aligned_spec_hook(state))
    model = build_model(arch, None, torch.bfloat16, spec_hook=hook, use_te=False,
                        use_cpu_initialization=False)
    load_hf_weights(model, arch, hf_state(hf).__getitem__, groups_from_parallel_state())
    model = model.cuda()
    x = ids(batch=4, seq=64).cuda()
    pos = torch.arange(x.shape[1], device="cuda")[None].expand_as(x)

    def run(gemm):
        state.gemm = gemm
        state.mark_weights_updated()
        model.zero_grad()
        ops = _Ops()
        with ops:
            logits = model(x, pos, attention_mask=None).float()
        logits.log_softmax(-1)[..., 0].sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()
                           if p.grad is not None])
        return logits.detach(), grads, ops.names

    fake, g_fake, _ = run("fake")
    real, g_real, names = run("real")
    rel = ((real - fake).abs().mean() / fake.abs().mean()).item()
    cos = torch.nn.functional.cosine_similarity(g_real, g_fake, dim=0).item()
    print(f"\n{kind} {fmt}: logits mean |real - fake| / mean |fake| {rel:.4f}, max "
          f"{(real - fake).abs().max().item():.3f}; gradient cosine {cos:.5f}; ops "
          f"{sorted({n for n in names if 'mm' in n})}")
    assert "_scaled_mm" in names if fmt == "fp8" else "_int_mm" in names
    if kind == "moe" and fmt == "fp8" and torch.cuda.get_device_capability()[0] == 9:
        assert "_scaled_grouped_mm" in names
    assert rel < 5e-2 and cos > 0.99
