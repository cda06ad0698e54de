"""quant.stacked: quantizing many weights at once equals quantizing each alone, bit for bit."""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.stacked import can_stack, fake_quant_many, quantize_many

FORMATS = ["int8", "fp8", "fp8_block", "w4a16", "nvfp4"]


def _weights(rows, cols=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(r, cols, generator=g).to(torch.bfloat16) * (i + 1) for i, r in enumerate(rows)]
    ws[1][3].zero_()  # an all-zero row: the formats' zero-amax rule must not leak across weights
    return ws


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("max_elements", [1 << 27, 256 * 300])
def test_quantize_many_equals_one_at_a_time(fmt, max_elements):
    spec = get_spec(fmt)
    ws = _weights([256, 128, 384, 128])
    got = quantize_many(spec, ws, max_elements=max_elements)
    deq = fake_quant_many(spec, ws, max_elements=max_elements)
    assert len(got) == len(deq) == len(ws)
    for w, q, d in zip(ws, got, deq):
        ref = spec.quantize_weight(w)
        assert q.shape == ref.shape and q.codes.shape == ref.codes.shape
        assert q.codes.dtype == ref.codes.dtype
        assert torch.equal(_bits(q.codes), _bits(ref.codes))
        assert torch.equal(q.scale, ref.scale)
        if ref.global_scale is not None:
            assert torch.equal(q.global_scale, ref.global_scale)
        assert d.dtype == w.dtype
        assert torch.equal(d, spec.dequantize(ref, dtype=w.dtype))


def test_can_stack_rules():
    ws = _weights([256, 128])
    assert can_stack(get_spec("int8"), ws) and can_stack(get_spec("w4a16"), ws)
    assert can_stack(get_spec("fp8_block"), ws)
    # a 64-row weight would share a 128x128 block with its neighbour
    assert not can_stack(get_spec("fp8_block"), _weights([256, 64]))
    assert can_stack(get_spec("int8"), _weights([256, 64]))
    # a per-tensor scale (NVFP4 weight_scale_2) never stacks; bf16 has nothing to quantize
    assert not can_stack(get_spec("nvfp4"), ws) and not can_stack(get_spec("bf16"), ws)
    assert not can_stack(get_spec("int8"), [ws[0], ws[1][:, :128]])
    assert not can_stack(get_spec("int8"), ws[:1])


def test_fp8_block_unaligned_falls_back_exactly():
    spec = get_spec("fp8_block")
    ws = _weights([200, 64])  # partial edge blocks: quantized one at a time
    for w, d in zip(ws, fake_quant_many(spec, ws)):
        assert torch.equal(d, spec.dequantize(spec.quantize_weight(w), dtype=w.dtype))


def test_nonfinite_names_the_stack():
    ws = _weights([128, 128])
    ws[1][0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"experts\[0\.\.1\] \(stacked\).*non-finite"):
        quantize_many(get_spec("int8"), ws, name="experts")
