"""Edge cases of the reference quantizers, numerics closed forms and fused-group packing."""

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.numerics import (
    e2m1_decode,
    e2m1_encode,
    pack_int4_to_int32,
    pack_nibbles,
    unpack_int32_to_int4,
    unpack_nibbles,
)
from tests.quant.quant_cases import QUANT_NAME, gaussian

QUANTIZED = ["int8", "fp8", "fp8_block", "w4a16", "nvfp4"]


@pytest.mark.parametrize("name", QUANTIZED)
def test_all_zero_rows_and_tensors_quantize_to_exact_zeros(name):
    spec = get_spec(name)
    w = gaussian(out=256, k=256)
    w[:128] = 0.0
    fq = spec.fake_quant_weight(w)
    assert torch.isfinite(fq).all() and torch.equal(fq[:128], torch.zeros(128, 256))
    assert torch.equal(spec.fake_quant_weight(torch.zeros(128, 256)), torch.zeros(128, 256))


@pytest.mark.parametrize("name", QUANTIZED)
def test_one_huge_outlier_stays_finite_and_is_represented(name):
    spec = get_spec(name)
    w = gaussian(out=256, k=256)
    w[3, 5] = 1e4
    fq = spec.fake_quant_weight(w)
    assert torch.isfinite(fq).all()
    assert abs(float(fq[3, 5]) - 1e4) / 1e4 < 0.07  # the max of its group is kept (to fp8/e2m1)


def test_block_formats_confine_an_outlier_to_its_block():
    w = gaussian(out=256, k=256)
    clean = get_spec("fp8_block").fake_quant_weight(w)
    w[3, 5] = 1e4
    fq = get_spec("fp8_block").fake_quant_weight(w)
    assert torch.equal(fq[128:], clean[128:]) and torch.equal(fq[:128, 128:], clean[:128, 128:])


@pytest.mark.parametrize("name", QUANTIZED)
def test_denormal_weights_give_finite_results(name):
    w = gaussian(out=128, k=256) * 1e-38  # fp32 subnormal range
    fq = get_spec(name).fake_quant_weight(w)
    assert torch.isfinite(fq).all()
    assert (fq - w).abs().max() <= w.abs().max()


@pytest.mark.parametrize("name,k", [("fp8_block", 192), ("w4a16", 192), ("nvfp4", 40)])
def test_input_dims_that_split_a_group_are_rejected_naming_the_tensor(name, k):
    with pytest.raises(ValueError, match=rf"{name}: {QUANT_NAME} has in_features={k}"):
        get_spec(name).pack(QUANT_NAME, gaussian(out=128, k=k))


def test_fp8_block_allows_partial_output_blocks_deepseek_layout():
    spec = get_spec("fp8_block")
    w = gaussian(out=200, k=256)
    packed = dict(spec.pack(QUANT_NAME, w))
    assert packed[QUANT_NAME + "_scale_inv"].shape == (2, 2)
    q = spec.unpack(QUANT_NAME, packed, dtype=torch.float32)
    assert torch.equal(spec.dequantize(q), spec.fake_quant_weight(w))


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_raise_naming_the_tensor(name, bad):
    w = gaussian(out=128, k=256)
    w[1, 2] = bad
    with pytest.raises(ValueError, match=rf"{QUANT_NAME} has 1 non-finite"):
        get_spec(name).pack(QUANT_NAME, w)


def test_wrong_rank_and_dtype_are_rejected():
    spec = get_spec("int8")
    with pytest.raises(ValueError, match="2-D"):
        spec.quantize_weight(torch.zeros(4, 4, 4))
    with pytest.raises(TypeError, match="torch.int32"):
        spec.quantize_weight(torch.zeros(4, 4, dtype=torch.int32))


def test_dequantize_rejects_a_weight_of_another_format():
    q = get_spec("int8").quantize_weight(gaussian(out=128, k=128))
    with pytest.raises(ValueError, match="quantized with 'int8'"):
        get_spec("fp8").dequantize(q)


def test_int8_activation_closed_form_rounds_half_away_from_zero():
    x = torch.tensor([[254.0, 1.0, -1.0, 3.0]])  # scale 2: x/2 = 127, .5, -.5, 1.5
    assert torch.equal(get_spec("int8")._act(x), torch.tensor([[254.0, 2.0, -2.0, 4.0]]))


def test_fp8_activation_closed_form_and_zero_token():
    x = torch.tensor([[448.0, 1.0, -3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    y = get_spec("fp8")._act(x)
    assert torch.equal(y, torch.tensor([[448.0, 1.0, -3.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    x = torch.tensor([[896.0, 17.0]])  # scale 2: 17/2 = 8.5 -> e4m3 8 (ties to even) -> 16
    assert torch.equal(get_spec("fp8")._act(x), torch.tensor([[896.0, 16.0]]))


def test_fp8_block_activation_uses_one_scale_per_128_group():
    x = torch.zeros(1, 256)
    x[0, 0], x[0, 1] = 896.0, 17.0  # group 0: scale 2 -> 17 -> 16
    x[0, 128], x[0, 129] = 448.0, 17.0  # group 1: scale 1 -> 17 -> 16 (e4m3 step 2 above 16)
    x[0, 130] = 9.0  # scale 1: 9 is exact in e4m3
    y = get_spec("fp8_block")._act(x)
    assert y[0, 1] == 16.0 and y[0, 129] == 16.0 and y[0, 130] == 9.0 and y[0, 0] == 896.0


def test_e2m1_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3, -100.0, 0.74])
    expect = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -6.0, 0.5])
    assert torch.equal(e2m1_decode(e2m1_encode(x)), expect)
    codes = torch.tensor([c for c in range(16) if c != 8], dtype=torch.uint8)  # -0 -> +0
    assert torch.equal(e2m1_encode(e2m1_decode(codes)), codes)


def test_nibble_and_int4_packing_closed_forms():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0x43]]
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    q = torch.arange(-8, 8, dtype=torch.int8).reshape(1, 16)
    words = pack_int4_to_int32(q)
    assert words.tolist() == [[0x76543210, 0xFEDCBA98 - 2**32]]
    assert torch.equal(unpack_int32_to_int4(words), q)


def _layer(h=256, inter=256, e=None):
    g = torch.Generator().manual_seed(3)
    base = "model.layers.0."
    t = {f"{base}input_layernorm.weight": torch.ones(h),
         f"{base}self_attn.q_proj.weight": torch.randn(h, h, generator=g),
         f"{base}self_attn.k_proj.weight": torch.randn(128, h, generator=g) * 4,
         f"{base}self_attn.v_proj.weight": torch.randn(128, h, generator=g) * 0.1,
         f"{base}self_attn.o_proj.weight": torch.randn(h, h, generator=g),
         f"{base}mlp.gate_proj.weight": torch.randn(inter, h, generator=g),
         f"{base}mlp.up_proj.weight": torch.randn(inter, h, generator=g) * 3,
         f"{base}mlp.down_proj.weight": torch.randn(h, inter, generator=g)}
    return t


def test_nvfp4_fused_groups_share_one_tensor_scale():
    spec = get_spec("nvfp4")
    tensors = _layer()
    packed = dict(spec.pack_state_dict(tensors.items()))
    s2 = {n: packed[n.replace(".weight", ".weight_scale_2")] for n in tensors if "proj" in n}
    qkv = [s2[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert qkv[0] == qkv[1] == qkv[2]
    k_amax = tensors["model.layers.0.self_attn.k_proj.weight"].abs().max()
    assert qkv[0] >= k_amax / (6 * 448)
    assert s2["model.layers.0.mlp.gate_proj.weight"] == s2["model.layers.0.mlp.up_proj.weight"]
    assert s2["model.layers.0.self_attn.o_proj.weight"] != qkv[0]
    # and the trainer side reproduces the packed v_proj given the shared amax
    v = tensors["model.layers.0.self_attn.v_proj.weight"]
    shared = max(float(tensors[f"model.layers.0.self_attn.{p}_proj.weight"].abs().max())
                 for p in "qkv")
    q = spec.unpack("model.layers.0.self_attn.v_proj.weight", packed, dtype=torch.float32)
    assert torch.equal(spec.dequantize(q), spec.fake_quant_weight(v, global_amax=shared))


def test_incomplete_fused_group_is_an_error_for_nvfp4_only():
    tensors = _layer()
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="fused groups incomplete.*self_attn"):
        list(get_spec("nvfp4").pack_state_dict(tensors.items()))
    names = [n for n, _ in get_spec("int8").pack_state_dict(tensors.items())]
    assert names[0] == "model.layers.0.input_layernorm.weight" and len(names) == 1 + 6 * 2
