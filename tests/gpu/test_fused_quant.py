"""H200: the compiled fused Triton quantizers (megatron_qrl/quant/triton_quant.py) give the
torch reference's bits on the GPU — codes, scales, dtypes, layouts and the packed tensors the
engine loads — for every format, on the edge cases of tests/quant/fused_cases.py, on
Qwen3-30B-A3B-sized expert stacks, and through the whole pack stream. The CPU test
(tests/quant/test_fused_quant.py) runs the same kernels in Triton's interpreter, whose float8
cast and arithmetic are not the GPU's: this is the proof for the compiled kernels.

The real GEMM's operand kernels (megatron_qrl/quant/triton_act.py): per-token activation codes
and scales equal CUDA torch's ``quantize_activation`` (whose scalar division is a multiply by
the fp32 reciprocal, unlike the CPU's: both compared), per-row dequantization equals
``(codes.float() * scale).to(dtype)``, and the real linear's output and gradients are the same
bits with and without them.

fp8_block's 1x128 activation groups (the aligned experts' fake-path input quantizer): the group
kernel's codes and scales equal CUDA torch's reference and the fake activation through the
kernels equals ``_act`` on edge groups and a Qwen3-30B-A3B-sized permuted input.

The fused writes into an engine's regions (``quantize_channel_into`` / ``quantize_fp8_block_into``,
the direct sync's ``QuantSpec.quantize_into``): the same bits as CUDA torch's and the CPU's
write on the edge cases and on 30B-A3B expert stacks written into one half of a ``w13``-like
region; fp8_block's equals its pack kernel per expert, non-finite blocks included.

The fused fake quantizers (megatron_qrl/quant/triton_fake.py: ``quantize_dequantize``, the
aligned forward's once-per-step refresh): the weight in its dtype equals CUDA torch's and the
CPU's fake quantization on the edge cases of ``fused_cases.fake_weights`` and on the 30B-A3B
expert stacks, and the stacked refresh takes them in one call.

The FP8 backward's gradient quantizers (megatron_qrl/quant/triton_grad.py): the dgrad's rows
and the wgrad's transposed columns equal CUDA torch's ``fp8_backward.quantize_grad_rows`` of
the folded gradient, and the real linear's FP8 gradients are the same bits with them.

Run: ``pytest tests/gpu/test_fused_quant.py`` (bench/h200.sh ``gpu-tests FILES=...``; < 1 min).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu import skip_unless_compiled_triton

pytestmark = pytest.mark.gpu

skip_unless_compiled_triton()

from megatron_qrl.quant import get_spec, triton_quant  # noqa: E402
from megatron_qrl.quant.fused import fused_kernel, set_quant_impl  # noqa: E402
from tests.quant.e4m3_cast import e4m3_codes  # noqa: E402
from tests.quant.fused_cases import (  # noqa: E402
    FORMATS,
    act_through_real_linear,
    activations,
    assert_bits_equal,
    assert_pack_streams_equal,
    assert_same,
    bits,
    dequant_cases,
    e4m3_probe,
    fake_act,
    fake_quant,
    fake_weights,
    fp8_backward_through_real_linear,
    grad_cases,
    group_activations,
    group_reference,
    quantize,
    quantize_act,
    weights,
)
from tests.quant.test_quant_pack_stream import moe_stream  # noqa: E402
from tests.quant.test_quantize_into import Engine  # noqa: E402

CUDA = "cuda"


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_picks_the_kernel_on_cuda(fmt):
    assert fused_kernel(get_spec(fmt), torch.device(CUDA)) is not None
    assert not triton_quant._SOFT  # the native float8 cast is what runs


@pytest.mark.parametrize("fmt", FORMATS)
def test_edge_cases_equal_reference(fmt):
    """Fused on the GPU == torch on the GPU == torch on the CPU, bit for bit."""
    for label, w in weights(fmt, CUDA):
        fused = quantize(fmt, w, "triton")
        assert_same(fused, quantize(fmt, w, "torch"), f"{fmt} {label} (cuda)")
        assert_same(fused, quantize(fmt, w.cpu(), "torch"), f"{fmt} {label} (cpu reference)")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(128 * 768, 2048), (128 * 2048, 768), (4096 + 64, 2048)])
def test_30b_sized_stacks_equal_reference(fmt, shape):
    """Expert stacks of one 30B-A3B layer (gate/up [128 x 768, 2048], down [128 x 2048, 768])
    in bf16, and a q/k/v-sized stack whose rows are not a multiple of 128."""
    if fmt == "fp8_block" and shape[0] % 128 == 64:
        shape = (shape[0] - 64 + 100, shape[1])
    g = torch.Generator(device=CUDA).manual_seed(sum(shape))
    w = (torch.randn(shape, device=CUDA, generator=g) * 0.02).to(torch.bfloat16)
    w[::97] *= 300.0
    ga = None
    if fmt == "nvfp4":  # a stack is quantized with each weight's tensor amax per row
        ga = w.float().abs().amax(dim=1, keepdim=True).view(-1, 64, 1).amax(1, keepdim=True)
        ga = ga.expand(-1, 64, 1).reshape(-1, 1).contiguous()
    assert_same(quantize(fmt, w, "triton", ga), quantize(fmt, w, "torch", ga),
                f"{fmt} {shape}")


def test_native_e4m3_cast_every_value_and_midpoint():
    """The compiled native cast and the kernels' bit arithmetic (the interpreter's path, here
    compiled) both equal torch's round-to-nearest-even cast on every value, midpoint and
    neighbour."""
    x = e4m3_probe(CUDA)
    ref = bits(x.to(torch.float8_e4m3fn))
    assert torch.equal(e4m3_codes(x, soft=False), ref)
    assert torch.equal(e4m3_codes(x, soft=True), ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_stream_fused_equals_torch(fmt):
    """The whole pack on the GPU (stacked experts, fused groups, row-split packing)."""
    stream = [(n, t.to(CUDA)) for n, t in moe_stream(
        layers=2, experts=16, hidden=512, inter=256, with_down=fmt != "fp8_block")]
    assert_pack_streams_equal(fmt, stream)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_activation_kernel_equals_cuda_torch(fmt):
    """Edge tokens and a Qwen3-4B-sized input (4096 tokens x 9728, bf16); the CPU reference's
    scales differ from CUDA's on some tokens (division vs reciprocal multiply: counted)."""
    g = torch.Generator(device=CUDA).manual_seed(5)
    big = (torch.randn(4096, 9728, device=CUDA, generator=g) * 3).bfloat16()
    cases = activations(fmt, CUDA) + [("4096x9728", big)]
    for label, x in cases:
        (q, s), (rq, rs) = quantize_act(fmt, x, "triton"), quantize_act(fmt, x, "torch")
        assert_bits_equal(q, rq, f"{fmt} {label} codes")
        assert_bits_equal(s, rs, f"{fmt} {label} scale")
        fake = {}
        for impl in ("triton", "torch"):
            set_quant_impl(impl)
            try:
                fake[impl] = get_spec(fmt).fake_quant_activation(x)
            finally:
                set_quant_impl(None)
        assert_bits_equal(fake["triton"], fake["torch"], f"{fmt} {label} fake quant")
    from megatron_qrl.quant.triton_act import torch_divides_by_reciprocal

    print(f"\ntorch on CUDA divides by a scalar as a reciprocal multiply: "
          f"{torch_divides_by_reciprocal('cuda', 127.0 if fmt == 'int8' else 448.0)}")
    _, cpu = quantize_act(fmt, big.cpu(), "torch")
    print(f"\n{fmt}: CPU scale != CUDA scale on {(bits(cpu) != bits(s.cpu())).sum().item()} "
          f"of {s.numel()} tokens")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_rows_kernel_equals_torch(dtype):
    from megatron_qrl.quant.fused import fused_kernel as pick

    for label, codes, scale in dequant_cases(CUDA):
        spec = get_spec("int8" if codes.dtype == torch.int8 else "fp8")
        assert pick(spec, codes.device, "fused_dequant_kernel") is not None
        assert_bits_equal(spec.dequantize_rows(codes, scale, dtype),
                          (codes.float() * scale).to(dtype), f"{label} -> {dtype}")


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_real_linear_same_bits_with_the_kernels(fmt):
    act_through_real_linear(fmt, CUDA)


def test_grad_kernels_equal_cuda_torch():
    """The FP8 backward's gradient quantizers (quant/triton_grad.py) against CUDA torch's
    ``quantize_grad_rows`` of the folded gradient: the edge cases and a Qwen3-4B fc1 gradient
    (4096 tokens x 19456, bf16), the dgrad's rows and the wgrad's transposed columns."""
    from megatron_qrl.quant import triton_grad
    from megatron_qrl.te_quant import fp8_backward as fb

    g = torch.Generator(device=CUDA).manual_seed(6)
    big = (torch.randn(4096, 19456, device=CUDA, generator=g) * 1e-3).bfloat16()
    sw = torch.rand(19456, device=CUDA, generator=g) * 1e-2 + 1e-4
    sx = torch.rand(4096, 1, device=CUDA, generator=g) * 1e-1 + 1e-3
    for label, grad, w, x in grad_cases(CUDA) + [("4096x19456", big, sw, sx)]:
        q, s = triton_grad.quantize_grad_rows(grad, w)
        rq, rs = fb.quantize_grad_rows(fb.folded_grad(grad, w), "e4m3")
        assert_bits_equal(q, rq, f"{label} dgrad codes")
        assert_bits_equal(s, rs, f"{label} dgrad scale")
        q, s = triton_grad.quantize_grad_cols_t(grad, x)
        rq, rs = fb.quantize_grad_rows(fb.folded_grad_t(grad, x), "e4m3")
        assert_bits_equal(q, rq, f"{label} wgrad codes")
        assert_bits_equal(s, rs, f"{label} wgrad scale")
    assert fb.grad_kernels(big.device, "e4m3") is triton_grad


def test_fp8_backward_same_bits_with_the_grad_kernels():
    calls = fp8_backward_through_real_linear(CUDA)
    assert calls["quantize_grad_rows"] >= 2 and calls["quantize_grad_cols_t"] >= 2, calls


def test_activation_group_kernel_equals_cuda_torch():
    """fp8_block's groups on CUDA: edge groups and a 30B-A3B micro batch's permuted expert
    input (4 x 1,032 tokens x top-8 rows x 2,048, bf16), codes, scales and the fake
    activation; ``auto`` picks the kernel on CUDA."""
    from megatron_qrl.quant import triton_act

    spec = get_spec("fp8_block")
    assert fused_kernel(spec, torch.device(CUDA), "fused_group_act_kernel") is not None
    g = torch.Generator(device=CUDA).manual_seed(6)
    big = (torch.randn(33024, 2048, device=CUDA, generator=g) * 3).bfloat16()
    for label, x in group_activations(CUDA) + [("33024x2048", big)]:
        q, s = triton_act.quantize_act_per_token_group(spec, x)
        rq, rs = group_reference(x)
        assert_bits_equal(q, rq, f"{label} codes")
        assert_bits_equal(s, rs, f"{label} scale")
        assert_bits_equal(fake_act(spec, x, "triton"), fake_act(spec, x, "torch"),
                          f"{label} fake quant")


@pytest.mark.parametrize("fmt", FORMATS)
def test_fake_kernel_equals_torch(fmt):
    """Fused fake quant on the GPU == torch's on the GPU == torch's on the CPU, bit for bit,
    in the weight's dtype (fp32, bf16, fp16: subnormal outputs, signed zeros, ragged and zero
    blocks, strided weights); ``auto`` picks the kernel on CUDA."""
    assert get_spec(fmt).fused_fake(torch.device(CUDA)) is not None
    for label, w in fake_weights(fmt, CUDA):
        got = fake_quant(fmt, w, "triton")
        assert_bits_equal(got, fake_quant(fmt, w, "torch"), f"{fmt} {label} (cuda)")
        assert_bits_equal(got.cpu(), fake_quant(fmt, w.cpu(), "torch"),
                          f"{fmt} {label} (cpu reference)")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(128 * 1536, 2048), (128 * 2048, 768)])
def test_fake_30b_expert_stacks_equal_torch(fmt, shape):
    """One 30B-A3B layer's expert stacks as the aligned refresh quantizes them (fc1
    ``[128 x 1536, 2048]``, fc2 ``[128 x 2048, 768]``, bf16), outliers every 97 rows; nvfp4
    with a tensor amax per 256 rows, given per row (as a stack is quantized)."""
    g = torch.Generator(device=CUDA).manual_seed(sum(shape))
    w = (torch.randn(shape, device=CUDA, generator=g) * 0.02).to(torch.bfloat16)
    w[::97] *= 300.0
    ga = None
    if fmt == "nvfp4":
        ga = w.float().abs().amax(dim=1, keepdim=True).view(-1, 256, 1).amax(1, keepdim=True)
        ga = ga.expand(-1, 256, 1).reshape(-1, 1).contiguous()
    assert_bits_equal(fake_quant(fmt, w, "triton", ga), fake_quant(fmt, w, "torch", ga),
                      f"{fmt} {shape}")


@pytest.mark.parametrize("fmt", ["fp8_block", "w4a16", "fp8", "int8"])
def test_stacked_refresh_on_cuda_takes_the_kernel(fmt, monkeypatch):
    """``fake_quant_stack_in_place`` of a 30B fc1 stack ``[128, 1536, 2048]`` under ``auto``:
    one fused call over the whole stack, the torch path's bits."""
    from megatron_qrl.quant import triton_fake
    from megatron_qrl.quant.finite_checks import FiniteChecks
    from megatron_qrl.te_quant.shard_quant import FusionLayout, fake_quant_stack_in_place

    name = get_spec(fmt).fused_fake_kernel
    real, calls = getattr(triton_fake, name), []
    monkeypatch.setattr(triton_fake, name,
                        lambda spec, w, *a: calls.append(w.shape) or real(spec, w, *a))
    g = torch.Generator(device=CUDA).manual_seed(7)
    w = (torch.randn(128, 1536, 2048, device=CUDA, generator=g) * 0.02).bfloat16()
    finite = FiniteChecks()
    got = fake_quant_stack_in_place(get_spec(fmt), w, FusionLayout("gate_up"), "fc1", finite)
    assert calls == [torch.Size([128 * 1536, 2048])]
    finite.check(get_spec(fmt))
    set_quant_impl("torch")
    try:
        want = fake_quant_stack_in_place(get_spec(fmt), w, FusionLayout("gate_up"), "fc1")
    finally:
        set_quant_impl(None)
    assert_bits_equal(got, want, f"{fmt} stacked refresh")


INTO = ["fp8", "int8", "fp8_block"]


def _write_into(fmt, name, w, impl, start):
    """``quantize_into`` of ``w`` into an :class:`Engine`'s regions through ``impl``: the
    bits written (the rest of each region's tensor checked untouched)."""
    set_quant_impl(impl)
    try:
        eng = Engine(start=start, device=w.device)
        written = dict(get_spec(fmt).quantize_into(name, w, eng.region))
        assert all(eng.untouched(k, t.shape) for k, t in written.items()), (fmt, impl)
        return {k: bits(t) for k, t in written.items()}
    finally:
        set_quant_impl(None)


@pytest.mark.parametrize("fmt", INTO)
def test_fused_into_equals_the_torch_write(fmt, monkeypatch):
    """The direct sync's write on CUDA under ``auto`` takes the fused kernel (one call per
    weight or stack) and gives CUDA torch's bits, and the CPU's on the edge weights: a 30B-A3B
    layer's gate / up stack ``[128, 768, 2048]`` into one half of a ``w13``-like region, its
    down stack ``[128, 2048, 768]``, a q/k/v-sized weight whose rows are not a multiple of
    128 (bf16, outliers every 97 rows), and fused_cases' edge weights."""
    spec = get_spec(fmt)
    name = spec.fused_into_kernel
    assert fused_kernel(spec, torch.device(CUDA), "fused_into_kernel") is not None
    real, calls = getattr(triton_quant, name), []
    monkeypatch.setattr(triton_quant, name,
                        lambda spec, w, *a: calls.append(w.shape) or real(spec, w, *a))
    stack = "model.layers.4.mlp.experts.*.up_proj.weight"
    one = "model.layers.4.self_attn.k_proj.weight"
    g = torch.Generator(device=CUDA).manual_seed(8)
    big = []
    for shape, start in (((128, 768, 2048), 768), ((128, 2048, 768), 0), ((4196, 2048), 3)):
        w = (torch.randn(shape, device=CUDA, generator=g) * 0.02).to(torch.bfloat16)
        w.view(-1, shape[-1])[::97] *= 300.0
        big.append((stack if len(shape) == 3 else one, w, start))
    edge = [(one, w, 128) for _, w in weights(fmt, CUDA)]
    for i, (wname, w, start) in enumerate(big + edge):
        got = _write_into(fmt, wname, w, "auto", start)
        want = _write_into(fmt, wname, w, "torch", start)
        if i >= len(big):
            cpu = _write_into(fmt, wname, w.cpu(), "torch", start)
            assert all(torch.equal(want[k].cpu(), cpu[k]) for k in want), (fmt, i)
        for k in want:
            assert torch.equal(got[k], want[k]), (fmt, tuple(w.shape), k)
    assert len(calls) == len(big) + len(edge)


def test_fp8_block_into_kernel_is_the_pack_kernel_per_expert_on_cuda():
    """Compiled: ``quantize_fp8_block_into`` on a stack equals ``quantize_fp8_block`` on each
    expert (codes, scales, block amaxes), NaN / Inf blocks included (the kernels' one tile)."""
    spec = get_spec("fp8_block")
    g = torch.Generator(device=CUDA).manual_seed(9)
    w = (torch.randn(4, 300, 512, device=CUDA, generator=g) * 0.02).to(torch.bfloat16)
    w[0, 5, 6], w[1, 200, 300], w[3, 0, 0] = float("nan"), float("inf"), float("-inf")
    codes = torch.empty(4, 300, 512, dtype=torch.float8_e4m3fn, device=CUDA)
    scale = torch.empty(4, 3, 4, device=CUDA)
    amax = triton_quant.quantize_fp8_block_into(spec, w, codes, scale)
    for e in range(4):
        q, a = triton_quant.quantize_fp8_block(spec, w[e])
        assert torch.equal(bits(codes[e]), bits(q.codes)), e
        assert torch.equal(bits(scale[e]), bits(q.scale)), e
        assert torch.equal(bits(amax[e]), bits(a)), e
