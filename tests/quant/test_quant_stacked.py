"""quant.stacked: quantizing many weights at once equals quantizing each alone, bit for bit."""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.stacked import can_stack, fake_quant_many, fused_amax, quantize_many

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
    # a per-tensor scale (NVFP4 weight_scale_2) stacks, given per row; bf16 has nothing to do
    assert can_stack(get_spec("nvfp4"), ws) and not can_stack(get_spec("bf16"), ws)
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


def _count_calls(monkeypatch, spec):
    """Names of the quantizer calls: ``quantize_weight`` and the fake-quant fast path."""
    calls = []
    for method in ("quantize_weight", "quantize_dequantize"):
        real = getattr(type(spec), method)
        monkeypatch.setattr(type(spec), method, lambda self, w, _real=real, **kw:
                            calls.append(kw.get("name")) or _real(self, w, **kw))
    return calls


def _assert_same(q, ref):
    assert torch.equal(q.codes, ref.codes)
    assert torch.equal(_bits(q.scale), _bits(ref.scale))
    assert q.global_scale.shape == () and q.global_scale.dtype == torch.float32
    assert torch.equal(q.global_scale, ref.global_scale)


@pytest.mark.parametrize("rows", [[128, 128, 128, 128, 128, 128], [256, 128, 384, 128, 64, 32]])
def test_nvfp4_stack_with_given_amax_equals_one_at_a_time(monkeypatch, rows):
    """Per-weight global amaxes (own, a float, a scalar tensor, a fused pair's shared one)
    in one call == ``quantize_weight(w, global_amax=a)`` each: codes, e4m3 block scales and
    the fp32 tensor scale, bit for bit; an all-zero weight gets tensor scale 1."""
    spec = get_spec("nvfp4")
    ws = _weights(rows)
    ws[4].zero_()
    shared = torch.maximum(ws[2].float().abs().amax(), ws[3].float().abs().amax())
    amaxes = [None, 3.7, shared, shared, None, torch.tensor(0.01, dtype=torch.bfloat16)]
    calls = _count_calls(monkeypatch, spec)
    got = quantize_many(spec, ws, global_amax=amaxes, name="experts")
    deq = fake_quant_many(spec, ws, global_amax=amaxes)
    assert calls == ["experts[0..5] (stacked)", "weights[0..5] (stacked)"]
    for w, a, q, d in zip(ws, amaxes, got, deq):
        ref = spec.quantize_weight(w, global_amax=a)
        _assert_same(q, ref)
        assert torch.equal(d, spec.dequantize(ref, dtype=w.dtype))
    assert float(got[4].global_scale) == 1.0 and not got[4].codes.any()
    assert torch.equal(got[2].global_scale, got[3].global_scale)


def test_nvfp4_amax_as_tensor_and_fused_amax():
    spec = get_spec("nvfp4")
    ws = _weights([128] * 6)
    pairs = fused_amax(ws, [2] * 3)
    want = [max(float(w.float().abs().amax()) for w in ws[j:j + 2]) for j in (0, 0, 2, 2, 4, 4)]
    assert pairs.dtype == torch.float32 and pairs.tolist() == want
    assert fused_amax(ws).tolist() == [float(w.float().abs().amax()) for w in ws]
    mixed = fused_amax(ws, [3, 2, 1])
    assert mixed.tolist() == [max(float(w.float().abs().amax()) for w in ws[s:e])
                              for s, e in [(0, 3)] * 3 + [(3, 5)] * 2 + [(5, 6)]]
    for q, w, a in zip(quantize_many(spec, ws, global_amax=pairs), ws, pairs):
        _assert_same(q, spec.quantize_weight(w, global_amax=a))
    with pytest.raises(ValueError, match="do not partition 6 weights"):
        fused_amax(ws, [2, 2])
    with pytest.raises(ValueError, match="global_amax has 5 entries for 6 weights"):
        quantize_many(spec, ws, global_amax=pairs[:5])
    with pytest.raises(ValueError, match=r"per-row global_amax for w must have shape \[128, 1\]"):
        spec.quantize_weight(ws[0], global_amax=torch.ones(64, 1), name="w")


def test_nvfp4_unstackable_uses_given_amax():
    """A group that cannot stack (different widths) still gets each weight's global amax."""
    spec = get_spec("nvfp4")
    ws = [_weights([128, 128])[0], _weights([128, 128], cols=512)[1]]
    assert not can_stack(spec, ws)
    amaxes = [5.0, 9.0]
    for q, w, a in zip(quantize_many(spec, ws, global_amax=amaxes), ws, amaxes):
        _assert_same(q, spec.quantize_weight(w, global_amax=a))
        assert float(q.global_scale) != float(spec.quantize_weight(w).global_scale)


def test_nvfp4_nonfinite_names_the_stack():
    ws = _weights([128, 128])
    ws[1][0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"nvfp4: experts\[0\.\.1\] \(stacked\) has 1 non-finite"):
        quantize_many(get_spec("nvfp4"), ws, name="experts")
