"""The fused Triton quantizers (megatron_qrl/quant/triton_quant.py) give the torch reference's
bits, run by Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set here before
Triton loads). The interpreter's float8 cast is replaced by the kernels' bit arithmetic and its
arithmetic is numpy's, so the compiled kernels' own proof is tests/gpu/test_fused_quant.py.

Run: ``PYTHONPATH=/tmp/triton_site:$PWD TRITON_INTERPRET=1 pytest tests/quant/test_fused_quant.py``
(Triton installed aside; the shared venv has none, and there the module skips).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton  # noqa: F401
except ImportError:
    pytest.skip("triton not installed (CPU CI): GPU test tests/gpu/test_fused_quant.py covers it",
                allow_module_level=True)

from megatron_qrl.quant import get_spec, triton_quant  # noqa: E402
from megatron_qrl.quant.fused import set_quant_impl  # noqa: E402
from tests.quant.fused_cases import FORMATS, assert_same, quantize, weights  # noqa: E402
from tests.quant.test_quant_pack_stream import moe_stream  # noqa: E402

if not triton_quant._SOFT:
    pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set; run this module alone",
                allow_module_level=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_equals_reference(fmt):
    for label, w in weights(fmt):
        assert_same(quantize(fmt, w, "triton"), quantize(fmt, w, "torch"), f"{fmt} {label}")


def test_nvfp4_given_tensor_amax_per_row_and_scalar():
    w = weights("nvfp4")[1][1]
    for ga in (torch.tensor(3e3), torch.linspace(1.0, 5e4, w.shape[0]).reshape(-1, 1)):
        assert_same(quantize("nvfp4", w, "triton", ga), quantize("nvfp4", w, "torch", ga),
                    f"nvfp4 global_amax {tuple(ga.shape)}")


def test_e4m3_every_value_and_midpoint():
    """The interpreter's float8 cast (bit arithmetic) on every E4M3 value, every midpoint
    between neighbours (ties to even) and its fp32 neighbours, against torch's cast."""
    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[1:] + vals[:-1]) / 2
    near = torch.cat([torch.nextafter(mids, mids * 2), torch.nextafter(mids, -mids)])
    x = torch.cat([vals, mids, near, torch.tensor([448.0, 2.0**-10, 2.0**-20])])
    x = torch.cat([x, -x]).reshape(2, -1)
    x = torch.nn.functional.pad(x, (0, 256 - x.shape[1] % 256 if x.shape[1] % 256 else 0))
    codes = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    scale = torch.ones(x.shape[0], 1)
    triton_quant._channel_kernel[(1,)](
        x, codes.view(torch.uint8), scale, torch.empty(2), 2, x.shape[1], x.shape[1],
        MAXV=1.0, INT8=False, EPS=-1.0, SOFT=True, BLOCK_R=2, BLOCK_K=256)
    # MAXV=1, EPS=-1: s = 1 / amax; rescale so that codes compare on x itself
    a = x.abs().amax(dim=1, keepdim=True)
    ref = (x * (a.reciprocal() * 1.0)).to(torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_stream_fused_equals_torch(fmt):
    """The whole pack (stacked experts, fused groups, row-split packing) through the kernels."""
    stream = moe_stream(layers=1, experts=4, hidden=256, inter=128, with_down=fmt != "fp8_block")
    spec = get_spec(fmt)
    out = {}
    for impl in ("torch", "triton"):
        set_quant_impl(impl)
        try:
            out[impl] = [(n, t.clone()) for n, t in spec.pack_state_dict(iter(stream),
                                                                         stack_experts=True)]
        finally:
            set_quant_impl(None)
    assert [n for n, _ in out["triton"]] == [n for n, _ in out["torch"]]
    for (n, a), (_, b) in zip(out["triton"], out["torch"]):
        assert a.dtype == b.dtype and a.shape == b.shape, n
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b), n


def test_non_finite_weight_named():
    for fmt in FORMATS:
        w = weights(fmt)[0][1].clone()
        w[11, 7] = float("nan")
        with pytest.raises(ValueError, match="non-finite|finite|NaN|nan"):
            quantize(fmt, w, "triton")
