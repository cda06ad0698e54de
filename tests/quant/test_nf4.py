"""NF4 + double quantization (QLoRA): closed-form values of the table, codes and absmax."""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.quant.nf4 import (
    NF4_BLOCK,
    NF4_DQ_BLOCK,
    NF4_TABLE,
    dequantize_absmax,
    double_quantize_absmax,
    dynamic_map,
    nf4_dequantize,
    nf4_quantize,
    nf4_table_from_quantiles,
)


def test_table_is_the_normal_quantiles_of_qlora_eq4():
    ref = nf4_table_from_quantiles()
    assert ref.shape == (16,) and float(ref[7]) == 0.0 and ref[0] == -1 and ref[-1] == 1
    assert torch.allclose(NF4_TABLE.double(), ref, atol=1.2e-7, rtol=0)  # within one fp32 ulp of 1
    assert bool((NF4_TABLE[1:] > NF4_TABLE[:-1]).all())


def test_table_values_times_block_absmax_are_exact():
    """w = table[c] * a_b with one absmax a_b per block of 64: the codes come back and the
    dequantized weight equals w (all absmaxes equal: the second level is exact)."""
    g = torch.Generator().manual_seed(0)
    blocks = 8
    codes = torch.randint(0, 16, (blocks, NF4_BLOCK), generator=g)
    codes[:, 0] = 15  # every block holds +1 * absmax
    w = (NF4_TABLE[codes] * 0.37).reshape(16, 32)
    q = nf4_quantize(w)
    got = torch.stack([q.codes & 0xF, q.codes >> 4], 1).reshape(-1).long()
    assert torch.equal(got, codes.reshape(-1))
    assert torch.equal(nf4_dequantize(q), w)
    assert q.codes.numel() == w.numel() // 2 and q.absmax_q.numel() == blocks


def _nearest(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    return grid[(x[:, None] - grid).abs().argmin(1)]


def test_random_weight_codes_nearest_to_w_over_absmax():
    """Codes: nearest table value to w / absmax (exact absmax); value: table * absmax_hat."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 80, generator=g) * torch.linspace(0.1, 3, 80)
    q = nf4_quantize(w)
    dflat = nf4_dequantize(q).reshape(-1)
    blocks = w.reshape(-1, NF4_BLOCK)
    absmax = blocks.abs().amax(1)
    ahat = dequantize_absmax(q.absmax_q, q.absmax_scale, q.absmax_mean)
    assert ahat.numel() == blocks.shape[0] and not torch.equal(ahat, absmax)
    for b in range(blocks.shape[0]):
        want = _nearest(blocks[b] / absmax[b], NF4_TABLE) * ahat[b]
        assert torch.equal(dflat[b * NF4_BLOCK:(b + 1) * NF4_BLOCK], want)


def test_double_quantized_absmax_is_the_nearest_dynamic_map_value():
    g = torch.Generator().manual_seed(2)
    absmax = torch.rand(3 * NF4_DQ_BLOCK + 17, generator=g) * 2 + 0.1
    aq, scale, mean = double_quantize_absmax(absmax)
    assert aq.dtype == torch.uint8 and scale.numel() == 4 and float(mean) == float(absmax.mean())
    dyn = dynamic_map()
    assert dyn.numel() == 256 and bool((dyn[1:] >= dyn[:-1]).all()) and 1.0 in dyn and 0.0 in dyn
    back = dequantize_absmax(aq, scale, mean)
    centred = absmax - mean
    for i in range(absmax.numel()):
        s2 = scale[i // NF4_DQ_BLOCK]
        want = _nearest((centred[i] / s2).reshape(1), dyn) * s2 + mean
        assert torch.allclose(back[i], want, atol=1e-7, rtol=0), i
    assert float((back - absmax).abs().max()) < 0.02 * float(scale.max())


def test_bit_identical_to_bitsandbytes():
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(200, 320, generator=torch.Generator().manual_seed(4))
    qb, st = bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    ours = nf4_quantize(w)
    assert torch.equal(st.code, NF4_TABLE)
    assert torch.equal(st.absmax, ours.absmax_q) and float(st.offset) == float(ours.absmax_mean)
    assert torch.equal(st.state2.absmax, ours.absmax_scale)
    assert torch.equal(st.state2.code, dynamic_map())
    assert torch.equal(bnb_f.dequantize_4bit(qb, st), nf4_dequantize(ours))


def test_memory_is_about_4_127_bits_per_weight():
    w = torch.randn(256, 1024)
    q = nf4_quantize(w)
    bits = q.nbytes() * 8 / w.numel()
    assert 4.12 < bits < 4.14  # 4 + 8/64 + 32/(64*256) (+ the mean)
