"""The contract every consumer relies on: one spec, bit-identical on both sides."""
import dataclasses

import pytest
import torch

from megatron_qrl.quant import get_spec, list_specs
from megatron_qrl.quant.numerics import sqnr_db
from tests.quant.quant_cases import QUANT_NAME, gaussian, heavy_tailed

SIX = ["bf16", "int8", "fp8", "fp8_block", "w4a16", "nvfp4"]
QUANTIZED = [n for n in SIX if n != "bf16"]


def test_registry_lists_the_six_formats_in_order():
    assert list_specs() == SIX
    assert {get_spec(n).sglang_quantization for n in SIX} == {
        None, "w8a8_int8", "w8a8_fp8", "fp8", "compressed-tensors", "modelopt_fp4"}


def test_unknown_format_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown quantization format 'int3'.*nvfp4"):
        get_spec("int3")


def test_duplicate_registration_is_rejected():
    from megatron_qrl.quant import register_spec
    from megatron_qrl.quant.formats.channel import Int8Spec

    class Again(Int8Spec):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_spec(Again)


def test_specs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_spec("int8").name = "x"
    assert get_spec("int8") is get_spec("int8")


@pytest.mark.parametrize("name", SIX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weights", [gaussian, heavy_tailed])
def test_dequantize_unpack_pack_equals_fake_quant_bit_for_bit(name, dtype, weights):
    spec = get_spec(name)
    w = weights(dtype=dtype)
    packed = spec.pack(QUANT_NAME, w)
    assert [n for n, _ in packed] == list(spec.packed_names(QUANT_NAME))
    q = spec.unpack(QUANT_NAME, dict(packed), dtype=dtype)
    rollout_w = spec.dequantize(q) if spec.quantizes_weights else q
    trainer_w = spec.fake_quant_weight(w)
    assert rollout_w.dtype == trainer_w.dtype == dtype
    assert torch.equal(rollout_w, trainer_w)


@pytest.mark.parametrize("name", QUANTIZED)
def test_packed_dtypes_and_shapes_match_the_sglang_loader(name):
    spec = get_spec(name)
    w = gaussian(out=256, k=384, dtype=torch.bfloat16)
    got = {n.rsplit(".", 1)[-1]: (t.dtype, tuple(t.shape)) for n, t in spec.pack(QUANT_NAME, w)}
    expected = {
        "int8": {"weight": (torch.int8, (256, 384)), "weight_scale": (torch.float32, (256, 1))},
        "fp8": {"weight": (torch.float8_e4m3fn, (256, 384)),
                "weight_scale": (torch.float32, (256, 1))},
        "fp8_block": {"weight": (torch.float8_e4m3fn, (256, 384)),
                      "weight_scale_inv": (torch.float32, (2, 3))},
        "w4a16": {"weight_packed": (torch.int32, (256, 48)),
                  "weight_scale": (torch.bfloat16, (256, 3)),
                  "weight_shape": (torch.int64, (2,))},
        "nvfp4": {"weight": (torch.uint8, (256, 192)),
                  "weight_scale": (torch.float8_e4m3fn, (256, 24)),
                  "weight_scale_2": (torch.float32, ()),
                  "input_scale": (torch.float32, ())},
    }[name]
    assert got == expected


@pytest.mark.parametrize("name", SIX)
@pytest.mark.parametrize(
    "hf_name",
    ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
     "model.layers.1.mlp.gate.weight", "model.layers.1.input_layernorm.weight",
     "model.layers.1.self_attn.q_norm.weight", "model.layers.1.mlp.shared_expert_gate.weight"],
)
def test_embeddings_norms_router_and_lm_head_stay_high_precision(name, hf_name):
    spec = get_spec(name)
    w = gaussian(out=128, k=128, dtype=torch.bfloat16)
    assert not spec.is_quantized(hf_name)
    [(n, t)] = spec.pack(hf_name, w)
    assert n == hf_name and t is w


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize(
    "hf_name",
    ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
     "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
     "model.layers.7.mlp.experts.127.up_proj.weight",
     "model.layers.0.mlp.shared_expert.down_proj.weight"],
)
def test_every_attention_and_mlp_linear_is_quantized(name, hf_name):
    assert get_spec(name).is_quantized(hf_name)


@pytest.mark.parametrize("name", QUANTIZED)
def test_fake_quant_weight_is_straight_through(name):
    spec = get_spec(name)
    w = gaussian(dtype=torch.float32).requires_grad_(True)
    g = torch.randn_like(w)
    (spec.fake_quant_weight(w) * g).sum().backward()
    assert torch.equal(w.grad, g)


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_block"])
def test_fake_quant_activation_is_straight_through_and_changes_values(name):
    spec = get_spec(name)
    x = torch.randn(2, 3, 256, requires_grad=True)
    y = spec.fake_quant_activation(x)
    assert not torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("name", ["bf16", "w4a16", "nvfp4"])
def test_weight_only_formats_leave_activations_alone(name):
    x = torch.randn(2, 3, 256)
    assert get_spec(name).fake_quant_activation(x) is x


def test_sqnr_table(capsys):
    """Prints SQNR per format (the note's table); asserts only the ordering bits imply."""
    rows = []
    for name in QUANTIZED:
        spec = get_spec(name)
        row = [name]
        for make in (gaussian, heavy_tailed):
            w = make(out=512, k=1024)
            row.append(sqnr_db(w, spec.fake_quant_weight(w)))
        rows.append(row)
    with capsys.disabled():
        print("\nformat     | SQNR dB gaussian | SQNR dB heavy-tailed")
        for name, g, h in rows:
            print(f"{name:10s} | {g:16.2f} | {h:20.2f}")
    sq = {r[0]: r[1] for r in rows}
    # Gaussian SQNR ~ 6.02 b + c: 8-bit int > fp8 (3 mantissa bits) > 4-bit formats
    assert sq["int8"] > 38 and 28 < sq["fp8"] < 36 and 28 < sq["fp8_block"] < 36
    assert 15 < sq["w4a16"] < 24 and 17 < sq["nvfp4"] < 24
