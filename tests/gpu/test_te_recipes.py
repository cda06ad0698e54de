"""H200 / Hopper: Transformer Engine's FP8 block recipe vs the spec's reference quantizer.

``te_recipes.RECIPES`` claims ``fp8_block`` == TE ``Float8BlockScaling`` with fp32 scales and
that ``fp8`` != ``Float8CurrentScaling``. This test proves (or refutes) both on a GPU:
bit-exact dequantized weights (128x128) and activations (1x128), and the GEMM of a ``te.Linear``
under the recipe against ``Q_a(x) @ Q_w(W)^T`` (accumulation order only). Skips with TE's own
reason where TE or FP8 is unavailable. Run: ``pytest tests/gpu/test_te_recipes.py -s``.
"""

from __future__ import annotations

import os

import pytest
import torch

# before TE is imported: Float8BlockScaling reads it for its default scale constraint
os.environ.setdefault("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)
te = pytest.importorskip("transformer_engine.pytorch", reason="Transformer Engine not installed")


def _block_available() -> tuple[bool, str]:
    ok, reason = te.is_fp8_available(return_reason=True)
    if not ok:
        return ok, reason
    fn = getattr(te, "is_fp8_block_scaling_available", None)
    if fn is None:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager as M

        fn = getattr(M, "is_fp8_block_scaling_available", None)
    return fn(return_reason=True) if fn is not None else (True, "")


_OK, _REASON = _block_available()
if not _OK:
    pytest.skip(f"Transformer Engine: {_REASON}", allow_module_level=True)


def _block_quantizer(dim: int):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    return Float8BlockQuantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False,
                                amax_epsilon=0.0, force_pow_2_scales=False, block_scaling_dim=dim)


def _data(out=512, inp=256, tokens=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(out, inp, device="cuda", generator=g).bfloat16() * 0.05
    x = torch.randn(tokens, inp, device="cuda", generator=g).bfloat16()
    return w, x


def test_fp8_block_weight_and_activation_bit_exact():
    from megatron_qrl.quant import get_spec

    spec = get_spec("fp8_block")
    w, x = _data()
    te_w = _block_quantizer(2)(w).dequantize().float()
    te_x = _block_quantizer(1)(x).dequantize().float()
    ref_w = spec.fake_quant_weight(w.float())
    ref_x = spec.fake_quant_activation(x.float())
    dw, dx = (te_w - ref_w).abs().max().item(), (te_x - ref_x).abs().max().item()
    print(f"fp8_block: max |TE - reference| weight {dw:.3e}, activation {dx:.3e}")
    assert dw == 0.0 and dx == 0.0


def test_fp8_block_recipe_gemm_matches_reference():
    from megatron_qrl.quant import get_spec
    from megatron_qrl.te_quant.te_recipes import RECIPES, make_te_recipe

    spec = get_spec("fp8_block")
    w, x = _data()
    layer = te.Linear(w.shape[1], w.shape[0], bias=False, params_dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        layer.weight.copy_(w)
    autocast = getattr(te, "autocast", None)
    recipe = make_te_recipe(RECIPES["fp8_block"])
    ctx = autocast(enabled=True, recipe=recipe) if autocast else te.fp8_autocast(
        enabled=True, fp8_recipe=recipe)
    with torch.no_grad(), ctx:
        y = layer(x).float()
    ref = spec.fake_quant_activation(x.float()) @ spec.fake_quant_weight(w.float()).t()
    rel = ((y - ref).abs().max() / ref.abs().max()).item()
    print(f"fp8_block GEMM: max |TE - reference| / max|reference| = {rel:.3e}")
    assert rel <= 8e-3  # bf16 output rounding (2^-8) + fp32 accumulation order


def test_fp8_current_scaling_differs_from_rollout_fp8():
    """Why ``fp8`` uses the fake-quant path: TE current scaling has one scale per tensor."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    from megatron_qrl.quant import get_spec

    w, _ = _data()
    w = w * torch.linspace(0.1, 10, w.shape[0], device="cuda").bfloat16()[:, None]
    q = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=torch.device("cuda"))
    diff = (q(w).dequantize().float() - get_spec("fp8").fake_quant_weight(w.float())).abs().max()
    print(f"fp8 (per-channel) vs TE Float8CurrentScaling (per-tensor): max diff {diff.item():.3e}")
    assert diff.item() > 0
