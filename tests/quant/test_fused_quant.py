"""The fused Triton quantizers (megatron_qrl/quant/triton_quant.py) give the torch reference's
bits, run by Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set here before
Triton loads). The interpreter's float8 cast is replaced by the kernels' bit arithmetic and its
arithmetic is numpy's, so the compiled kernels' own proof is tests/gpu/test_fused_quant.py.

Run: ``PYTHONPATH=/tmp/triton_site:$PWD TRITON_INTERPRET=1 pytest tests/quant/test_fused_quant.py``
(Triton installed aside; the shared venv has none, and there the module skips).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.triton_cpu import require_triton_interpreter

require_triton_interpreter("tests/gpu/test_fused_quant.py")

from megatron_qrl.quant import get_spec, triton_quant  # noqa: E402
from megatron_qrl.quant.fused import set_quant_impl  # noqa: E402
from megatron_qrl.utils.finite import NonFiniteError  # noqa: E402
from tests.quant.e4m3_cast import e4m3_codes  # noqa: E402
from tests.quant.fused_cases import (  # noqa: E402
    FORMATS,
    assert_pack_streams_equal,
    assert_same,
    bits,
    e4m3_probe,
    quantize,
    weights,
)
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
    """The interpreter's float8 cast (the kernels' bit arithmetic) equals torch's."""
    x = e4m3_probe()
    assert torch.equal(e4m3_codes(x, soft=True), bits(x.to(torch.float8_e4m3fn)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_stream_fused_equals_torch(fmt):
    """The whole pack (stacked experts, fused groups, row-split packing) through the kernels."""
    stream = moe_stream(layers=1, experts=4, hidden=256, inter=128, with_down=fmt != "fp8_block")
    assert_pack_streams_equal(fmt, stream)


def test_non_finite_weight_named():
    for fmt in FORMATS:
        w = weights(fmt)[0][1].clone()
        w[11, 7] = float("nan")
        with pytest.raises(ValueError, match="non-finite|finite|NaN|nan"):
            quantize(fmt, w, "triton")


def test_pack_stream_through_the_kernels_names_the_nonfinite_weight():
    """The stream's one check reads the kernels' tile amaxes (fp8_block: one row per 128 weight
    rows) and names the expert that held the NaN, not its stack. Fails with
    ``FiniteChecks.bad_weights`` taking one weight row per element of a stack's ``ok``."""
    stream = moe_stream(layers=1, experts=4, hidden=256, inter=128, with_down=False)
    bad = "model.layers.0.mlp.experts.2.up_proj.weight"
    dict(stream)[bad][100, 7] = float("nan")
    for fmt in FORMATS:
        set_quant_impl("triton")
        try:
            with pytest.raises(NonFiniteError, match=rf"^{fmt}: {re.escape(bad)} holds"):
                list(get_spec(fmt).pack_state_dict(iter(stream), stack_experts=True))
        finally:
            set_quant_impl(None)
