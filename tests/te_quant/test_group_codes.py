"""The claim SGLang's 1x128 activation codes are held to on the H200 (tests/helpers/group_codes.py):
scales bit-equal to the fp8_block spec's, codes equal but where the kernel's approximate
``448 / a`` (``--use_fast_math``) moves ``x * 448 / a`` across an E4M3 rounding midpoint.

On the H200 the old claim (dequantized codes ``torch.equal`` to the spec's fake quantizer)
failed: SGLang 0.5.17's kernel divides approximately. Here that kernel is emulated on the CPU
(its quotient 1 or 2 ulp off the rounded one, per group), which the old claim refuses
(``test_old_claim_refuses_the_approximate_division``) and the new one accepts; the new one
refuses a scale taken by division (``a / 448``, the Triton kernel's, not ``a * (1/448)``) and
codes of a wrong quotient (``447 / a``).
"""

from __future__ import annotations

import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.numerics import FP8_E4M3_MAX, cast_e4m3
from tests.helpers.group_codes import mismatches


def _x(m=512, k=2048, seed=3):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 4).bfloat16()
    x[5] = 0
    return x


def _kernel(x, ulps=None, quotient=FP8_E4M3_MAX, divide=False):
    """Codes and scales as SGLang's JIT kernel computes them, its ``quotient / a`` moved by
    ``ulps`` (per group: -2..2) to emulate the approximate division."""
    m, k = x.shape
    g = x.float().reshape(m, k // 128, 128)
    a = torch.clamp(g.abs().amax(-1, keepdim=True), min=1e-10)
    q = quotient / a
    if ulps is not None:
        for _ in range(2):
            step = torch.nextafter(q, torch.where(ulps > 0, torch.inf, -torch.inf))
            q = torch.where(ulps != 0, step, q)
            ulps = ulps - ulps.sign()
    scale = a / FP8_E4M3_MAX if divide else a * (1.0 / FP8_E4M3_MAX)
    return cast_e4m3(g * q).reshape(m, k), scale.reshape(m, k // 128)


def _ulps(x, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, (x.shape[0], x.shape[1] // 128, 1), generator=gen)


def test_old_claim_refuses_the_approximate_division():
    x = _x()
    codes, scale = _kernel(x, _ulps(x))
    got = (codes.float().view(x.shape[0], -1, 128) * scale[..., None]).view(x.shape).bfloat16()
    assert not torch.equal(got, get_spec("fp8_block").fake_quant_activation(x))


def test_new_claim_accepts_it():
    x = _x()
    n, bad = mismatches(x, *_kernel(x, _ulps(x)))
    print(f"\n{n} of {x.numel()} codes differ")
    assert n > 0 and not bad, bad


def test_the_rounded_quotient_is_the_spec():
    x = _x(m=64)
    assert mismatches(x, *_kernel(x)) == (0, [])


def test_new_claim_refuses_a_divided_scale_and_a_wrong_quotient():
    x = _x(m=64)
    assert any("scales" in b for b in mismatches(x, *_kernel(x, divide=True))[1])
    assert any("midpoint" in b or "step" in b for b in mismatches(x, *_kernel(x, quotient=447.0))[1])
