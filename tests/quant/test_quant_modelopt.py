"""Agreement with NVIDIA ModelOpt where it has the same format on CPU.

Weights: exact codes for int8/fp8/fp8_block (values bit-exact for fp8/fp8_block; int8
values may differ in the last fp32 bit because ModelOpt divides by 127/amax where the engine
multiplies by the stored scale), exact codes and scales for NVFP4 (``NVFP4QTensor``).
Deliberate differences, checked against our own closed form instead:
- w4a16 stores bf16 group scales (Marlin's), so ~0.3% of codes move by one step compared
  with ModelOpt's fp32-scale INT4 blockwise quantizer;
- activations use SGLang's dynamic kernels (per token / per 1x128 group), which ModelOpt's
  static or per-tensor input quantizers do not reproduce bit for bit.
"""

import copy
import warnings

import modelopt.torch.quantization as mtq  # a required dependency (setup.py): never skipped
import pytest
import torch

from megatron_qrl.quant import get_spec
from tests.quant.quant_cases import QUANT_NAME, gaussian, heavy_tailed

warnings.filterwarnings("ignore")


class _OneLinear(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.proj = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        self.proj.weight.data = w.clone()

    def forward(self, x):
        return self.proj(x)


def _modelopt_fake_weight(cfg, w):
    m = _OneLinear(w)
    x = torch.randn(4, w.shape[1])
    mtq.quantize(m, copy.deepcopy(cfg), forward_loop=lambda mod: mod(x))
    with torch.no_grad():
        return m.proj.weight_quantizer(m.proj.weight)


@pytest.mark.parametrize("weights", [gaussian, heavy_tailed])
@pytest.mark.parametrize("name", ["fp8", "fp8_block"])
def test_fp8_weights_bit_exact_with_modelopt(name, weights):
    spec = get_spec(name)
    w = weights(out=256, k=384)
    assert torch.equal(_modelopt_fake_weight(spec.modelopt_config(), w), spec.fake_quant_weight(w))


@pytest.mark.parametrize("cfg_name", ["INT8_DEFAULT_CFG", "INT8_WEIGHT_ONLY_CFG"])
@pytest.mark.parametrize("weights", [gaussian, heavy_tailed])
def test_int8_codes_exact_with_modelopt(cfg_name, weights):
    spec = get_spec("int8")
    w = weights(out=256, k=384)
    ref = _modelopt_fake_weight(getattr(mtq, cfg_name), w)
    q = spec.quantize_weight(w)
    ref_codes = torch.round(ref * (127.0 / w.abs().amax(dim=1, keepdim=True)))
    assert torch.equal(ref_codes, q.codes.float())
    # ModelOpt divides by 127/amax, the engine multiplies by the stored 1/s: <= 2 ulp apart
    torch.testing.assert_close(spec.dequantize(q), ref, rtol=2**-22, atol=0)


def test_int8_config_from_spec_quantizes_weights_like_int8_default():
    w = gaussian(out=128, k=256)
    a = _modelopt_fake_weight(get_spec("int8").modelopt_config(), w)
    b = _modelopt_fake_weight(mtq.INT8_DEFAULT_CFG, w)
    assert torch.equal(a, b)


@pytest.mark.parametrize("weights", [gaussian, heavy_tailed])
def test_w4a16_within_one_step_of_modelopt_int4_blockwise(weights):
    w = weights(out=256, k=384)
    ref = _modelopt_fake_weight(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, w)
    fp32_scale = w.reshape(256, 3, 128).abs().amax(-1, keepdim=True) / 7.0
    ref_codes = torch.round(ref.reshape(256, 3, 128) / fp32_scale)
    ours = get_spec("w4a16").quantize_weight(w)
    diff = (ours.codes.reshape(256, 3, 128).float() - ref_codes).abs()
    assert diff.max() <= 1 and diff.mean() < 0.01
    # our closed form: codes against the bf16 scale the kernel multiplies by
    s = (fp32_scale).to(torch.bfloat16).float()
    expected = torch.clamp(torch.round(w.reshape(256, 3, 128) / s), -8, 7)
    assert torch.equal(ours.codes.reshape(256, 3, 128).float(), expected)


@pytest.mark.parametrize("weights", [gaussian, heavy_tailed])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_codes_and_scales_exact_with_nvfp4qtensor(weights, dtype):
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    w = weights(out=128, k=256, dtype=dtype)
    packed = dict(get_spec("nvfp4").pack(QUANT_NAME, w))
    mod = QUANT_NAME[: -len(".weight")]
    ours_s2 = packed[f"{mod}.weight_scale_2"]
    # our tensor scale is ModelOpt's rounded up to bf16 (Marlin holds it in bf16)
    mo_s2 = NVFP4QTensor.get_weights_scaling_factor_2(w)
    assert ours_s2 >= mo_s2 and (ours_s2 - mo_s2) / mo_s2 < 2**-7
    assert ours_s2.to(torch.bfloat16).float() == ours_s2
    qt, s_blk, s2 = NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=ours_s2)
    assert torch.equal(packed[f"{mod}.weight"], qt._quantized_data)
    assert torch.equal(packed[f"{mod}.weight_scale"].view(torch.uint8), s_blk.view(torch.uint8))
    assert torch.equal(packed[f"{mod}.weight_scale_2"], s2.float().reshape(()))
    ref = qt.dequantize(dtype=torch.float32, scale=s_blk, double_scale=s2, block_sizes={-1: 16})
    q = get_spec("nvfp4").unpack(QUANT_NAME, packed, dtype=torch.float32)
    assert torch.equal(get_spec("nvfp4").dequantize(q), ref)


def test_nvfp4_modelopt_config_is_weight_only_nvfp4():
    cfg = get_spec("nvfp4").modelopt_config()
    weight = next(e for e in cfg["quant_cfg"] if e.get("quantizer_name") == "*weight_quantizer")
    assert tuple(weight["cfg"]["num_bits"]) == (2, 1)
    assert weight["cfg"]["block_sizes"][-1] == 16
    assert not any(e.get("quantizer_name") == "*input_quantizer" and e.get("enable", True)
                   and "cfg" in e for e in cfg["quant_cfg"])


def test_bf16_has_no_modelopt_config():
    with pytest.raises(ValueError, match="nothing is quantized"):
        get_spec("bf16").modelopt_config()
