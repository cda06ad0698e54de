"""tools/export_quantized.py: the HF checkpoint SGLang loads, written atomically."""

import json

import pytest
import torch

from megatron_qrl.models.export import export_quantized
from megatron_qrl.models.hf_io import QuantizedCheckpointError
from megatron_qrl.quant import get_spec
from megatron_qrl.utils.outdir import OutputDirError
from tests.helpers.tiny_hf import make_tiny_hf, read_safetensors_dir
from tools.export_quantized import main as export_main

# every quantized linear's in_features a multiple of 128 (fp8_block, w4a16)
QUANT_DIMS = dict(hidden_size=128, head_dim=128, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=256, moe_intermediate_size=128)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("hf") / "moe", "moe", dtype=torch.bfloat16,
                        **QUANT_DIMS)


_read = read_safetensors_dir


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8", "fp8_block", "w4a16", "nvfp4"])
def test_export_writes_what_the_spec_packs(hf_dir, tmp_path, fmt):
    out = export_quantized(hf_dir, fmt, tmp_path / fmt, progress=False)
    spec = get_spec(fmt)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("quantization_config") == spec.hf_quantization_config()
    assert (out / "tokenizer_config.json").is_file()
    src, got = _read(hf_dir), _read(out)
    expected = dict(spec.pack_state_dict(sorted(src.items())))
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        a, b = got[name].reshape(-1), t.contiguous().reshape(-1)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    name = "model.layers.1.mlp.experts.7.down_proj.weight"
    q = spec.unpack(name, got, dtype=torch.bfloat16)
    w = spec.dequantize(q) if spec.quantizes_weights else q
    assert torch.equal(w, spec.fake_quant_weight(src[name]))
    assert not list(tmp_path.glob(".*tmp*"))


def test_existing_output_and_quantized_input_are_refused(hf_dir, tmp_path):
    out = export_quantized(hf_dir, "int8", tmp_path / "q", progress=False)
    with pytest.raises(OutputDirError, match="already exists.*--overwrite"):
        export_quantized(hf_dir, "int8", out, progress=False)
    with pytest.raises(QuantizedCheckpointError, match="already has a quantization_config"):
        export_quantized(out, "fp8", tmp_path / "again", progress=False)
    export_quantized(hf_dir, "fp8", out, overwrite=True, progress=False)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "w8a8_fp8"


def test_a_failed_export_leaves_nothing_behind(tmp_path):
    bad = make_tiny_hf(tmp_path / "bad", "moe")  # hidden 64: not a multiple of 128
    with pytest.raises(ValueError, match=r"fp8_block: model\.layers\.0\..* has in_features=\d+, not a multiple of 128"):
        export_quantized(bad, "fp8_block", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp*"))


def test_cli_reports_errors_with_exit_code_2(tmp_path, capsys):
    assert export_main(["--hf-dir", str(tmp_path / "missing"), "--format", "int8",
                        "--out", str(tmp_path / "o")]) == 2
    assert "config.json not found" in capsys.readouterr().err
