"""Which quantizer runs (megatron_qrl/quant/fused.py), on the CPU without Triton: a CUDA
weight with Triton gets the format's fused kernel, everything else the torch reference;
``torch`` forces the reference, ``triton`` the kernel or a clear error. The kernels module is
replaced by a recorder here (the kernels' bits: tests/quant/test_fused_quant.py, GPU:
tests/gpu/test_fused_quant.py)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_qrl.quant import fused, get_spec, list_specs
from megatron_qrl.quant.fused import ENV, fused_kernel, quant_impl, set_quant_impl
from tests.quant.fused_cases import bits

ROOT = Path(__file__).resolve().parents[2]
FUSED = {"int8": "quantize_channel", "fp8": "quantize_channel",
         "fp8_block": "quantize_fp8_block", "w4a16": "quantize_w4a16", "nvfp4": "quantize_nvfp4"}


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield
    set_quant_impl(None)


def _recorder(calls):
    """A stand-in kernels module: each function records its call and returns the reference
    quantization (of the weight's own amax) with a finite tile amax."""
    def make(name):
        def kernel(spec, w, *args):
            calls.append((name, spec.name, args))
            return spec._quantize(w, None), torch.zeros(1)
        return kernel
    return SimpleNamespace(**{n: make(n) for n in set(FUSED.values())})


def test_registry_names_its_kernels():
    """Every format declares its fused kernel (or none), and the name exists in triton_quant."""
    tree = ast.parse((ROOT / "megatron_qrl/quant/triton_quant.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in list_specs():
        assert get_spec(name).fused_kernel == FUSED.get(name), name
        assert get_spec(name).fused_kernel in defined | {None}, name


@pytest.mark.parametrize("fmt", list(FUSED))
def test_cuda_with_triton_gets_the_kernel(monkeypatch, fmt):
    monkeypatch.setattr(fused, "kernels", lambda *_: _recorder([]))
    spec = get_spec(fmt)
    assert fused_kernel(spec, torch.device("cuda", 0)).__name__ == "kernel"
    assert fused_kernel(spec, torch.device("cpu")) is None  # auto: CPU weights stay on torch
    set_quant_impl("torch")
    assert fused_kernel(spec, torch.device("cuda", 0)) is None
    monkeypatch.setattr(fused, "kernels", lambda *_: None)  # no Triton: torch
    set_quant_impl(None)
    assert fused_kernel(spec, torch.device("cuda", 0)) is None
    assert fused_kernel(get_spec("bf16"), torch.device("cuda", 0)) is None


def test_forced_triton_without_triton_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(fused, "kernels", lambda *_: None)
    monkeypatch.setenv(ENV, "triton")
    with pytest.raises(RuntimeError, match="QRL_QUANT_IMPL=triton.*Triton is not installed"):
        get_spec("fp8").quantize_weight(torch.randn(8, 16))
    monkeypatch.setattr(fused, "kernels", lambda *_: _recorder([]))
    with pytest.raises(RuntimeError, match="the tensor is on cpu"):
        get_spec("fp8").quantize_weight(torch.randn(8, 16))


def test_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV, "cuda")
    with pytest.raises(ValueError, match="QRL_QUANT_IMPL='cuda'.*auto, torch, triton"):
        quant_impl()
    with pytest.raises(ValueError, match="set_quant_impl='x'"):
        set_quant_impl("x")
    set_quant_impl("torch")  # the setter wins over the environment
    assert quant_impl() == "torch"


@pytest.mark.parametrize("fmt", list(FUSED))
def test_quantize_weight_dispatches_and_checks_the_tile_amax(monkeypatch, fmt):
    """quantize_weight hands a selected kernel the weight (and nvfp4 its tensor scale), checks
    finiteness on the kernel's tile amax, and names the tensor when it is not finite."""
    calls = []
    monkeypatch.setattr(fused, "kernels", lambda *_: _recorder(calls))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors may take the kernel path
    set_quant_impl("triton")
    spec = get_spec(fmt)
    w = torch.randn(128, 256)
    q = spec.quantize_weight(w, name="layers.0.w")
    assert [c[:2] for c in calls] == [(FUSED[fmt], fmt)]
    if fmt == "nvfp4":  # its tensor scale, from the weight's amax
        assert torch.equal(calls[0][2][0], spec._quantize(w, None).global_scale)
    else:
        assert calls[0][2] == ()
    assert torch.equal(bits(q.codes), bits(spec._quantize(w, None).codes))
    w[1, 2] = float("inf")  # the recorder's amax is finite: only a real check of w raises
    monkeypatch.setattr(fused, "kernels", lambda *_: SimpleNamespace(
        **{FUSED[fmt]: lambda spec, w, *a: (spec._quantize(w, None), torch.full((1,), 1e30)
                                            / torch.zeros(1))}))
    with pytest.raises(ValueError, match="layers.0.w"):
        spec.quantize_weight(w, name="layers.0.w")
    set_quant_impl("torch")
    with pytest.raises(ValueError, match="layers.0.w"):
        spec.quantize_weight(w, name="layers.0.w")


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_activation_and_dequant_kernels_follow_the_same_switch(monkeypatch, fmt):
    """``quantize_activation`` and ``dequantize_rows`` of the W8A8 per-token formats take
    their :mod:`.triton_act` kernels by the same rule as the weight quantizer (x in its own
    dtype, no fp32 copy), and the torch code under ``torch`` or on the CPU (auto)."""
    calls = []
    spec = get_spec(fmt)

    def module(name="triton_quant"):
        def act(spec, x):
            calls.append(("act", name, x.dtype))
            return spec._act_codes(x.float())

        def deq(spec, codes, scale, dtype):
            calls.append(("deq", name, dtype))
            return (codes.float() * scale).to(dtype)
        return SimpleNamespace(quantize_act_per_token=act, dequantize_rows=deq,
                               quantize_act_per_token_group=act)

    monkeypatch.setattr(fused, "kernels", module)
    x = torch.randn(6, 32).bfloat16()
    codes, scale = spec.quantize_activation(x)  # auto on the CPU: torch
    spec.dequantize_rows(codes, scale, torch.bfloat16)
    assert calls == []
    assert spec.fused_act_kernel == "quantize_act_per_token"
    assert fused_kernel(spec, torch.device("cuda", 0), "fused_act_kernel") is not None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    set_quant_impl("triton")
    q2, s2 = spec.quantize_activation(x)
    spec.dequantize_rows(q2, s2, torch.bfloat16)
    assert calls == [("act", "triton_act", torch.bfloat16), ("deq", "triton_act", torch.bfloat16)]
    assert torch.equal(bits(q2), bits(codes)) and torch.equal(s2, scale)
    set_quant_impl("torch")
    spec.quantize_activation(x)
    assert len(calls) == 2
    assert fused_kernel(get_spec("fp8_block"), torch.device("cuda", 0), "fused_act_kernel") is None
    # fp8_block's fake-path groups: their own kernel, chosen by the same rule
    set_quant_impl(None)
    block = get_spec("fp8_block")
    assert block.fused_group_act_kernel == "quantize_act_per_token_group"
    assert fused_kernel(block, torch.device("cuda", 0), "fused_group_act_kernel") is not None
    assert fused_kernel(block, torch.device("cpu"), "fused_group_act_kernel") is None


FAKE = {"int8": "fake_quant_channel", "fp8": "fake_quant_channel",
        "fp8_block": "fake_quant_fp8_block", "w4a16": "fake_quant_w4a16",
        "nvfp4": "fake_quant_nvfp4"}


def test_registry_names_its_fake_kernels():
    """Every weight format names its fused fake quantizer, a function of triton_fake."""
    tree = ast.parse((ROOT / "megatron_qrl/quant/triton_fake.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in list_specs():
        assert get_spec(name).fused_fake_kernel == FAKE.get(name), name
        assert get_spec(name).fused_fake_kernel in defined | {None}, name
    assert fused.KERNEL_MODULES["fused_fake_kernel"] == "triton_fake"


@pytest.mark.parametrize("fmt", list(FAKE))
def test_quantize_dequantize_dispatches_and_checks_the_tile_amax(monkeypatch, fmt):
    """``quantize_dequantize`` takes the fused fake quantizer by the weight quantizer's rule
    (CUDA + Triton under auto, forced ``triton``; the CPU under auto and ``torch`` keep the
    torch ``_fake_quant``), hands it the weight (nvfp4: and its tensor scale), returns its
    result as is, and checks finiteness on its tile amax: a non-finite amax names the weight,
    at once or in the stream's :class:`FiniteChecks`. Mutations caught: the routing dropped
    (no call), nvfp4's tensor scale not passed, the tile amax not checked."""
    from megatron_qrl.quant.finite_checks import FiniteChecks
    from megatron_qrl.utils.finite import NonFiniteError

    calls, amax = [], [torch.zeros(1)]

    def kernel(spec, w, *args):
        calls.append(args)
        return spec._fake_quant(w, None, "x", FiniteChecks()).to(w.dtype), amax[0]

    monkeypatch.setattr(fused, "kernels", lambda *_: SimpleNamespace(**{FAKE[fmt]: kernel}))
    spec = get_spec(fmt)
    assert spec.fused_fake(torch.device("cuda", 0)) is kernel
    w = torch.randn(128, 256).bfloat16()
    want = spec.quantize_dequantize(w)  # auto on the CPU: torch
    assert calls == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    set_quant_impl("triton")
    got = spec.quantize_dequantize(w, name="layers.0.w")
    assert len(calls) == 1 and torch.equal(bits(got), bits(want))
    if fmt == "nvfp4":
        assert torch.equal(calls[0][0], spec._quantize(w, None).global_scale)
    else:
        assert calls[0] == ()
    amax[0] = torch.full((4,), float("inf"))  # only the kernel's amax says non-finite
    finite = FiniteChecks()
    spec.quantize_dequantize(w, name="layers.0.w", finite=finite)
    with pytest.raises(NonFiniteError, match=f"^{fmt}: layers.0.w holds"):
        finite.check(spec)
    w[1, 2] = float("nan")  # at once: a non-finite amax sends the weight to the full check
    with pytest.raises(NonFiniteError, match=f"^{fmt}: layers.0.w has 1 non-finite"):
        spec.quantize_dequantize(w, name="layers.0.w")
    set_quant_impl("torch")
    spec.quantize_dequantize(w.nan_to_num())
    assert len(calls) == 3
