"""Shipped fused-MoE configs: merged config directory, writer, tuner search space, and the
engine directory of --qrl-rollout-engine sglang (CPU parts; the tuner itself runs on GPU)."""

import json

import pytest

from megatron_qrl.rollout_sglang.kernels import moe_configs as mc
from megatron_qrl.rollout_sglang.kernels.moe_tune import (
    TUNE_FORMATS,
    make_case,
    stage1_space,
    stage2_space,
)
from megatron_qrl.rollout_sglang.launch import engine_config, write_engine_dir

NAME = "E=8,N=64,device_name=NVIDIA_H200,dtype=fp8_w8a8.json"


def _sglang_root(tmp_path):
    root = tmp_path / "sglang_triton_utils"
    for ver, body in (("triton_3_6_0", {"1": {"BLOCK_SIZE_M": 16}}), ("triton_3_5_1", {})):
        d = root / "configs" / ver
        d.mkdir(parents=True)
        (d / NAME).write_text(json.dumps(body))
        (d / "other.json").write_text("{}")
    return root


def test_merge_prefers_ours_and_keeps_sglang_files(tmp_path):
    ours = tmp_path / "ours"
    path = mc.write_config("3.6.0", NAME, {64: {"BLOCK_SIZE_M": 64}, 1: {"BLOCK_SIZE_M": 32}}, ours)
    assert list(json.loads(path.read_text())) == ["1", "64"]  # SGLang's format: str(M), sorted
    out = mc.merge_config_dirs(_sglang_root(tmp_path), ours, tmp_path / "merged")
    merged = out / "configs" / "triton_3_6_0"
    assert json.loads((merged / NAME).read_text())["64"] == {"BLOCK_SIZE_M": 64}
    assert (merged / "other.json").exists()  # SGLang's own files stay visible
    assert (out / "configs" / "triton_3_5_1" / NAME).exists()  # fallback versions too
    # merging again (engine restart) is idempotent
    mc.merge_config_dirs(_sglang_root(tmp_path / "again"), ours, tmp_path / "merged")
    assert json.loads((merged / NAME).read_text())["1"] == {"BLOCK_SIZE_M": 32}


def test_user_config_dir_is_respected(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_MOE_CONFIG_DIR", str(tmp_path))
    assert mc.config_dir_for_engine(tmp_path / "cache") is None


def test_search_space_respects_fp8_block_shape():
    for cfg in stage1_space(TUNE_FORMATS["fp8_block"]):
        assert 128 % cfg["BLOCK_SIZE_N"] == 0 and 128 % cfg["BLOCK_SIZE_K"] == 0
    assert any(c["BLOCK_SIZE_K"] == 256 for c in stage1_space(TUNE_FORMATS["int8"]))
    tiles = stage1_space(TUNE_FORMATS["fp8"])[:2]
    s2 = stage2_space(tiles + tiles)
    assert len(s2) == 2 * 6 and len({tuple(sorted(c.items())) for c in s2}) == len(s2)


@pytest.mark.parametrize("fmt", sorted(TUNE_FORMATS))
def test_tuning_cases_have_the_kernel_layout(fmt):
    c = make_case(fmt, 4, 128, 256, device="cpu")
    assert c.w1.shape == (4, 256, 256) and c.w2.shape == (4, 256, 128)
    assert (c.E, c.N, c.K) == (4, 128, 256)
    if fmt == "fp8_block":
        assert c.w1_scale.shape == (4, 2, 2) and c.w2_scale.shape == (4, 2, 1)
    elif fmt != "bf16":
        assert c.w1_scale.shape == (4, 256, 1)
    with pytest.raises(ValueError, match="Marlin"):
        make_case("w4a16", 4, 128, 256, device="cpu")


def test_engine_dir_holds_the_format_config(tmp_path):
    hf = {"model_type": "qwen3_moe", "torch_dtype": "float32", "hidden_size": 128}
    assert "quantization_config" not in engine_config(hf, "bf16")
    cfg = engine_config(hf, "int8")
    assert cfg["torch_dtype"] == "bfloat16" and cfg["quantization_config"]["quant_method"] == "w8a8_int8"
    d = write_engine_dir(hf, "fp8_block", root=tmp_path)
    on_disk = json.loads((d / "config.json").read_text())
    assert on_disk["quantization_config"]["weight_block_size"] == [128, 128]
    assert not list(d.glob(".*.tmp"))
