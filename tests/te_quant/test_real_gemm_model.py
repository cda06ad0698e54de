"""The real GEMM in a BF16 model (CPU, ``gemm="real"`` forced): closer to the rollout engine's
GEMM than the fake path is, at the logits and the gradients.

Why not "real close to fake": the two paths differ per GEMM by BF16 rounding only
(``tests/te_quant/test_real_gemm.py``: ``<= 2^-8`` relative), but every later activation
quantizer turns a dense relative perturbation ``d`` into sparse code flips of one step ``q``
(E4M3: ``2^-4..2^-3`` of the value; int8: ``amax / 127``) on a fraction ``~ d / q`` of the
elements, and the next GEMM sums them into a dense perturbation of relative size
``~ sqrt(d q)``. So the gap grows towards the quantization noise itself, whatever its start
(a rounding argument, measured here on the tiny models of ``tests.helpers.te_quant_fixtures``,
batch 4 x 64 tokens, the mean relative logit difference by decoder layer, then logits):

=========  ============================  =============================  ==================
model      real vs fake                  real vs exact engine GEMM      fake vs exact
=========  ============================  =============================  ==================
dense fp8  0.055, 0.077, 0.078           0.001, 0.009, 0.010            0.055, 0.077, 0.078
moe fp8    0.044, 0.074, 0.077           0.000, 0.011, 0.012            0.044, 0.076, 0.079
dense int8 0.028, 0.037, 0.037           0.000, 0.000, 0.000            0.028, 0.037, 0.037
moe int8   0.022, 0.039, 0.039           0.000, 0.000, 0.000            0.022, 0.039, 0.039
=========  ============================  =============================  ==================

(the H200 measured 0.077 for real vs fake fp8, the same mechanism). Even fp32 summation
order alone (real vs exact, fp8) grows from 1e-7 to 1e-2 in two layers. What matters for
alignment is the distance to the engine, which multiplies the same codes and applies the
scales after an fp32 accumulation (SGLang ``fp8_scaled_mm`` / ``int8_scaled_mm``); its exact
form here is :func:`tests.helpers.real_gemm_model.exact_gemm` run through the real path's
plumbing. The checks:

1. the first quantized GEMM (layer 0 ``linear_qkv``, the same BF16 input on both paths, no
   flips upstream): real within ``2^-7`` mean relative of fake (measured ``2^-9``; a wrong
   scale is ``>= 2^-4``). Mutation caught: per-tensor activation scales in
   ``activation_operand`` (the engine reference shares that plumbing, so 2. cannot see it);
2. logits and gradients: real at most half as far from the exact engine GEMM as fake
   (measured 0-0.2 of it). Mutation caught: the real GEMM computing the fake path's
   arithmetic (BF16-rounded dequantized operands), ratio 1.
"""

from __future__ import annotations

import pytest

from tests.helpers.real_gemm_model import check_model, exact_gemm


@pytest.fixture(scope="module")
def megatron():
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        yield


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_real_closer_to_the_engine_gemm_than_fake(megatron, kind, fmt):
    check_model(kind, fmt, "cpu", {"exact": exact_gemm})
