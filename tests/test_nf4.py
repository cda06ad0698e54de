"""NF4 + double quantization (QLoRA): closed-form values of the table, codes and absmax."""

from __future__ import annotations

import torch

from megatron_qrl.quant.nf4 import (
    NF4_BLOCK,
    NF4_DQ_BLOCK,
    NF4_TABLE,
    dequantize_absmax,
    double_quantize_absmax,
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


def test_random_weight_rounds_to_nearest_grid_value():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 80, generator=g) * torch.linspace(0.1, 3, 80)
    q = nf4_quantize(w)
    deq = nf4_dequantize(q)
    flat, dflat = w.reshape(-1), deq.reshape(-1)
    ahat = dequantize_absmax(q.absmax_q, q.absmax_scale, q.absmax_mean)
    n_blocks = -(-flat.numel() // NF4_BLOCK)
    assert ahat.numel() == n_blocks
    for b in range(n_blocks):
        x = flat[b * NF4_BLOCK:(b + 1) * NF4_BLOCK]
        grid = NF4_TABLE * ahat[b]
        nearest = grid[(x[:, None].clamp(-ahat[b], ahat[b]) - grid).abs().argmin(1)]
        assert torch.equal(dflat[b * NF4_BLOCK:(b + 1) * NF4_BLOCK], nearest)


def test_double_quantized_absmax_error_is_half_a_step():
    g = torch.Generator().manual_seed(2)
    absmax = torch.rand(3 * NF4_DQ_BLOCK + 17, generator=g) * 2 + 0.1
    aq, scale, mean = double_quantize_absmax(absmax)
    assert aq.dtype == torch.int8 and scale.numel() == 4
    back = dequantize_absmax(aq, scale, mean)
    step = scale.repeat_interleave(NF4_DQ_BLOCK)[: absmax.numel()]
    assert bool(((back - absmax).abs() <= step / 2 + 1e-6).all())
    assert float(mean) == float(absmax.mean())


def test_memory_is_about_4_127_bits_per_weight():
    w = torch.randn(256, 1024)
    q = nf4_quantize(w)
    bits = q.nbytes() * 8 / w.numel()
    assert 4.12 < bits < 4.14  # 4 + 8/64 + 32/(64*256) (+ the mean)
