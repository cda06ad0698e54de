"""How far SGLang's 1x128 activation codes may be from the fp8_block spec's (no tests here): the
claim tests/gpu/test_real_gemm.py holds SGLang's ``per_token_group_quant_fp8`` to, checked on
the CPU by tests/te_quant/test_group_codes.py.

Both compute, per group of 128, ``a = max(amax, 1e-10)``, the scale ``a * fp32(1/448)`` and
the codes ``e4m3(x * (448 / a))``. SGLang 0.5.17's JIT kernel
(``jit/csrc/gemm/per_token_group_quant.cuh``) is built with ``--use_fast_math``, so its
``448 / a`` is the approximate division (PTX ``div.approx.f32``: ``a * rcp.approx(b)``, at most
2 ulp from the rounded quotient, relative ``2^-22``), while the spec's (torch, IEEE) is
correctly rounded. The scales are then bit-equal, and a code can differ only where
``x * (448 / a)`` lies within that relative error (plus the product's rounding, ``2^-24``) of
a rounding midpoint between two adjacent E4M3 values: then the two codes are adjacent. The
check allows 4x the derived distance (``2^-20``) and nothing else.
"""

from __future__ import annotations

import torch

from megatron_qrl.quant.numerics import FP8_E4M3_MAX, cast_e4m3

MIDPOINT_REL = 2.0 ** -20
"""Largest relative distance of ``x * 448 / a`` from the midpoint where codes may differ."""


def spec_group_codes(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """(codes, scales ``[M, K / group]``, exact ``x * 448 / a`` in fp64) of the spec's
    quantizer (fp8_block's ``_act``) of ``x`` ``[M, K]``."""
    m, k = x.shape
    g = x.float().reshape(m, k // group, group)
    a = torch.clamp(g.abs().amax(-1, keepdim=True), min=1e-10)
    codes = cast_e4m3(g * (FP8_E4M3_MAX / a)).reshape(m, k)
    exact = (g.double() * (FP8_E4M3_MAX / a.double())).reshape(m, k)
    return codes, (a * (1.0 / FP8_E4M3_MAX)).reshape(m, k // group), exact


def mismatches(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int = 128
               ) -> tuple[int, list[str]]:
    """(number of codes that differ from the spec's, the violations of the module doc's claim:
    scales not bit-equal, or a differing code that is not adjacent, or not at a midpoint)."""
    want, want_scale, exact = spec_group_codes(x, group)
    bad = []
    if not torch.equal(scale.float().cpu(), want_scale.cpu()):
        bad.append(f"scales differ in {(scale.float() != want_scale).sum().item()} groups")
    got_bits, want_bits = codes.view(torch.uint8).int(), want.view(torch.uint8).int()
    diff = got_bits != want_bits
    n = int(diff.sum().item())
    if n:
        same_sign = (got_bits[diff] & 0x80) == (want_bits[diff] & 0x80)
        adjacent = ((got_bits[diff] & 0x7F) - (want_bits[diff] & 0x7F)).abs() == 1
        if not bool((same_sign & adjacent).all()):
            bad.append(f"{int((~(same_sign & adjacent)).sum())} codes more than one E4M3 step "
                       "from the spec's")
        mid = (codes[diff].double().abs() + want[diff].double().abs()) / 2
        v = exact[diff].abs()
        far = (v - mid).abs() > MIDPOINT_REL * v
        if bool(far.any()):
            bad.append(f"{int(far.sum())} differing codes not at a rounding midpoint "
                       f"(worst relative distance {((v - mid).abs() / v).max().item():.2e})")
    return n, bad
