"""fp8_block's real GEMM (SGLang's own block-FP8 kernels) on the CPU: selection, call, maths.

SGLang's kernels are CUDA Triton kernels and SGLang is not installed here, so a stand-in
module (:mod:`tests.helpers.sglang_block_standin`) records every call and computes what
SGLang's kernels compute, in torch. The real kernels on the H200 against the same checks and
against SGLang's own linear: tests/gpu/test_real_gemm.py.

Mutations these tests catch (each run, then restored):
- ``column_major_scales=True`` in ``quantize_act_groups`` -> test_calls_are_sglangs_linear;
- the GEMM called with ``(xq, wq, ws, xs)`` (scales swapped) -> test_calls_are_sglangs_linear;
- ``_real_support`` skipping the SGLang import check -> test_selection_follows_the_import;
- ``dequantize_activation`` using per-row ``dequantize_rows`` -> test_forward_and_gradients;
- ``real_codes`` splitting block scales with the codes' layout -> test_sync_codes_are_the_engines;
- ``gemm_for`` returning ``gemm`` for experts -> test_experts_keep_the_fake_path;
- the dense linears' forward testing ``state.gemm`` instead of ``gemm_for`` ->
  test_model_real_equals_fake[moe-sequential] (the experts' linears run the block GEMM).
"""

from __future__ import annotations

import sys

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.te_quant import block_gemm
from megatron_qrl.te_quant.real_gemm import (
    FLAG,
    DeviceInfo,
    check_block_layout,
    grouped_real_linear,
    kernel_for,
    real_linear,
    select_gemm,
    weight_operand,
)
from tests.helpers.sglang_block_standin import sglang_standin

SPEC = get_spec("fp8_block")
CPU, H200, A100 = DeviceInfo("cpu"), DeviceInfo("cuda", (9, 0)), DeviceInfo("cuda", (8, 0))


@pytest.fixture
def sglang():
    """The stand-in SGLang module (records ``calls``)."""
    with sglang_standin() as mod:
        yield mod


@pytest.fixture
def no_sglang(monkeypatch):
    for name in block_gemm.MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    block_gemm._load.cache_clear()
    yield
    block_gemm._load.cache_clear()


def _operands(m=12, k=384, n=200, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * (1 + 4 * torch.rand(m, 1, generator=g))).to(dtype)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1).to(dtype)
    x[3] = 0  # an all-zero token
    return x, w


def test_selection_follows_the_import(sglang):
    assert select_gemm(SPEC, H200, "auto").gemm == "real"
    assert select_gemm(SPEC, H200, "real").gemm == "real"
    assert "SGLang" in select_gemm(SPEC, H200, "auto").reason
    assert select_gemm(SPEC, A100, "auto").gemm == "fake"  # no FP8 tensor cores
    assert select_gemm(SPEC, CPU, "auto").gemm == "fake"
    assert select_gemm(SPEC, H200, "fake").gemm == "fake"
    with pytest.raises(ValueError, match=f"{FLAG} real: fp8_block: .*CUDA"):
        select_gemm(SPEC, CPU, "real")


def test_selection_without_sglang(no_sglang):
    choice = select_gemm(SPEC, H200, "auto")
    assert choice.gemm == "fake" and "not importable" in choice.reason
    with pytest.raises(ValueError, match=f"^{FLAG} real: fp8_block: needs SGLang's block-FP8 "
                                         "kernels, not importable .*; use"):
        select_gemm(SPEC, H200, "real")
    from megatron_qrl.te_quant import AlignedForwardState

    with pytest.raises(ValueError, match=f"{FLAG} real: .*not importable"):
        AlignedForwardState("fp8_block", gemm="real")


def test_calls_are_sglangs_linear(sglang):
    """The two calls of SGLang's ``triton_w8a8_block_fp8_linear``: the activation quantizer on
    the contiguous 2-D input, groups of 128, row-major scales; the GEMM on the spec's weight
    codes and ``weight_scale_inv`` (what the sync sends), block [128, 128], output in x's dtype."""
    x, w = _operands()
    q = SPEC.quantize_weight(w)
    x3 = x.view(3, 4, -1).transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous 3-D
    y = real_linear(x3, w, weight_operand(SPEC, w), SPEC)
    assert y.shape == (3, 4, w.shape[0]) and y.dtype == x.dtype
    (_, xa, group, kw), (_, a, b, a_s, b_s, block, out) = sglang.calls
    assert xa.shape == (12, 384) and xa.is_contiguous() and group == 128
    assert kw == {"column_major_scales": False}
    assert torch.equal(xa, x3.reshape(12, 384))
    assert a.dtype == torch.float8_e4m3fn and a_s.shape == (12, 3) and a_s.stride() == (3, 1)
    assert torch.equal(b.view(torch.uint8), q.codes.view(torch.uint8)) and b.is_contiguous()
    assert b_s.shape == (2, 3) and torch.equal(b_s, q.scale)  # [ceil(N/128), K/128]
    assert block == [128, 128] and out == torch.bfloat16


def test_forward_and_gradients(sglang):
    """Forward: the fake path's value up to BF16 rounding of its operands and output (the
    bound of tests/te_quant/test_real_gemm.py); backward: dx, dW bit-equal the fake path's
    straight-through gradients."""
    x, w = _operands(seed=1)
    g = torch.randn(x.shape[0], w.shape[0]).to(x.dtype)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    real = real_linear(xr, wr, weight_operand(SPEC, w), SPEC)
    real.backward(g)
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    fake = SPEC.fake_quant_activation(xf) @ SPEC.fake_quant_weight(wf).t()
    fake.backward(g)
    a = SPEC.fake_quant_activation(x).float().abs() @ SPEC.quantize_dequantize(w).float().abs().t()
    bound = 2.0 ** -8 * (1 + 2.0 ** -8) * a + 2.0 ** -8 * fake.detach().float().abs() \
        + x.shape[1] * 2.0 ** -24 * a
    assert ((real.detach().float() - fake.detach().float()).abs() <= bound).all()
    assert torch.equal(xr.grad, xf.grad) and torch.equal(wr.grad, wf.grad)


def test_sync_codes_are_the_engines(sglang):
    """A fused q/k/v weight (head_dim 128): the real GEMM's cached operand, split into its HF
    components, is each component's own quantization (codes and ``weight_scale_inv``)."""
    from megatron_qrl.te_quant.qcodes import real_codes
    from megatron_qrl.te_quant.shard_quant import FusionLayout

    layout = FusionLayout("qkv", heads_per_group=2, head_dim=128)
    _, w = _operands(n=2 * 4 * 128, k=256, seed=2)
    got = real_codes(SPEC, weight_operand(SPEC, w, layout=layout), layout, w.dtype)
    want = [SPEC.quantize_weight(p) for p in layout.split(w)]
    assert [tuple(q.scale.shape) for q in got] == [(4, 2), (2, 2), (2, 2)]
    for a, b in zip(got, want):
        assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
        assert torch.equal(a.scale, b.scale)


def test_blocks_straddling_fused_components_refused():
    from megatron_qrl.te_quant.shard_quant import FusionLayout

    with pytest.raises(ValueError, match=f"{FLAG} real: fp8_block linear_qkv: .*64 rows"):
        check_block_layout(SPEC, 4 * 64, FusionLayout("qkv", 2, 64), "linear_qkv")
    with pytest.raises(ValueError, match="gate_up segment of 192 rows"):
        check_block_layout(SPEC, 384, FusionLayout("gate_up"), "linear_fc1")
    check_block_layout(SPEC, 512, FusionLayout("gate_up"), "linear_fc1")
    check_block_layout(get_spec("fp8"), 384, FusionLayout("gate_up"), "linear_fc1")


def test_experts_keep_the_fake_path(sglang):
    from megatron_qrl.te_quant import AlignedForwardState

    state = AlignedForwardState("fp8_block", gemm="real")
    assert [state.gemm_for(k) for k in ("attention", "mlp", "experts")] == \
        ["real", "real", "fake"]
    assert AlignedForwardState("fp8", gemm="real").gemm_for("experts") == "real"
    x, w = _operands()
    with pytest.raises(ValueError, match="fused-MoE block-FP8 kernel is not wired"):
        grouped_real_linear(x, [w.unsqueeze(0)], weight_operand(SPEC, w), SPEC, [12])
    assert kernel_for(SPEC).keywords == {"block": (128, 128)}


def _sequential_moe():
    """The local spec's MoE without the stacked-experts hook: one aligned linear per expert."""
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook
    from tests.helpers.te_quant_fixtures import build, hf_state, tiny_hf

    hf, arch = tiny_hf("moe")
    state = AlignedForwardState("fp8_block")
    return state, build(arch, hf_state(hf), aligned_spec_hook(state))


@pytest.mark.parametrize("kind", ["dense", "moe", "moe-sequential", "te-dense", "te-moe"])
def test_model_real_equals_fake(sglang, megatron, kind):
    """FP32 tiny Qwen3 / Qwen3-MoE (head_dim 128, hidden 256: whole blocks; local and TE
    spec): real == fake logits to 1e-4 up to rounding-boundary flips, the dense linears'
    caches hold the codes and ran SGLang's GEMM, the experts' stay on the fake path."""
    from megatron_qrl.te_quant.real_gemm import RealWeight
    from tests.te_quant.test_real_gemm import _fake_then_real, _model

    state, model = _sequential_moe() if kind == "moe-sequential" else _model(kind, "fp8_block")
    _fake_then_real(state, model, f"{kind} fp8_block real vs fake")
    caches = {n: m._qrl_cache[1] for n, m in model.named_modules()
              if getattr(m, "_qrl_cache", None)}
    on_real = {n for n, c in caches.items() if isinstance(c, RealWeight)}
    assert on_real and not any("experts" in n for n in on_real)
    assert any("linear_qkv" in n for n in on_real) and any("linear_proj" in n for n in on_real)
    assert any(c[0] == "gemm" for c in sglang.calls)
    if "moe" in kind:
        assert any("experts" in n for n in caches.keys() - on_real)
