"""H200: the compiled fused Triton quantizers (megatron_qrl/quant/triton_quant.py) give the
torch reference's bits on the GPU — codes, scales, dtypes, layouts and the packed tensors the
engine loads — for every format, on the edge cases of tests/quant/fused_cases.py, on
Qwen3-30B-A3B-sized expert stacks, and through the whole pack stream. The CPU test
(tests/quant/test_fused_quant.py) runs the same kernels in Triton's interpreter, whose float8
cast and arithmetic are not the GPU's: this is the proof for the compiled kernels.

Run: ``pytest tests/gpu/test_fused_quant.py`` (bench/h200.sh ``gpu-tests FILES=...``; < 1 min).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu import skip_unless_compiled_triton

pytestmark = pytest.mark.gpu

skip_unless_compiled_triton()

from megatron_qrl.quant import get_spec, triton_quant  # noqa: E402
from megatron_qrl.quant.fused import fused_kernel  # noqa: E402
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
