"""tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py: round trip, errors, dry run."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_qrl.models import CONFIG_DIR
from megatron_qrl.models.checkpoint import read_metadata
from megatron_qrl.models.convert import UAQ_CONFIG_KEY
from tests.helpers.tiny_hf import hf_logits, make_tiny_hf, tokens

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TO_MEGATRON = _tool("convert_hf_to_megatron")
TO_HF = _tool("convert_megatron_to_hf")


def _weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.mark.parametrize("kind, dtype, overrides", [
    ("dense", torch.float32, {"tie_word_embeddings": True}),
    ("dense", torch.bfloat16, {}),
    ("moe", torch.float32, {}),
])
def test_round_trip_is_bit_exact(tmp_path, kind, dtype, overrides):
    hf = make_tiny_hf(tmp_path / "hf", kind, dtype=dtype, **overrides)
    cfg_path = hf / "config.json"  # config.json's dtype may disagree: the stored dtype wins
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "dtype": "float32"}))
    assert TO_MEGATRON.main(["--hf-dir", str(hf), "--out", str(tmp_path / "mg")]) == 0
    meta, cfg, arch = read_metadata(tmp_path / "mg")
    assert meta["saved_layout"] == {"tp": 1, "ep": 1} and meta["uaq_scale"] is None
    assert (tmp_path / "mg" / "hf" / "tokenizer_config.json").is_file()
    assert TO_HF.main(["--megatron-dir", str(tmp_path / "mg"), "--out", str(tmp_path / "back")]) == 0
    before, after = _weights(hf), _weights(tmp_path / "back")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[n], after[n]) and before[n].dtype == after[n].dtype for n in before)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == cfg
    assert meta["dtype"] == str(dtype).removeprefix("torch.")
    ids = tokens()
    assert torch.equal(hf_logits(hf, ids), hf_logits(tmp_path / "back", ids))
    assert not list(tmp_path.glob(".*tmp-*"))  # temp dirs renamed or removed


def _expect_error(capsys, tool, argv, pattern):
    assert tool.main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err


def test_hf_to_megatron_errors(tmp_path, capsys):
    out = str(tmp_path / "out")
    _expect_error(capsys, TO_MEGATRON, ["--hf-dir", str(tmp_path / "nope"), "--out", out],
                  r"nope/config\.json not found")
    hf = make_tiny_hf(tmp_path / "hf", "dense")
    cfg = json.loads((hf / "config.json").read_text())
    bad_arch = tmp_path / "arch"
    bad_arch.mkdir()
    (bad_arch / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    _expect_error(capsys, TO_MEGATRON, ["--hf-dir", str(bad_arch), "--out", out],
                  r"unknown architecture 'LlamaForCausalLM'; supported: \['Qwen3ForCausalLM'")
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(cfg))
    _expect_error(capsys, TO_MEGATRON, ["--hf-dir", str(no_weights), "--out", out],
                  r"no \*\.safetensors files")
    (hf / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 80}))
    _expect_error(capsys, TO_MEGATRON, ["--hf-dir", str(hf), "--out", out],
                  r"gate_proj\.weight has shape \(96, 64\) but config\.json implies \(80, 64\)")
    (hf / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(hf / "model.safetensors")
    tensors.pop("model.layers.1.self_attn.q_norm.weight")
    save_file(tensors, str(hf / "model.safetensors"))
    _expect_error(capsys, TO_MEGATRON, ["--hf-dir", str(hf), "--out", out],
                  r"missing \['model\.layers\.1\.self_attn\.q_norm\.weight'\]")
    assert not Path(out).exists()


def test_output_exists_and_missing_megatron_dir(tmp_path, capsys):
    hf = make_tiny_hf(tmp_path / "hf", "dense")
    (tmp_path / "taken").mkdir()
    _expect_error(capsys, TO_MEGATRON, ["--hf-dir", str(hf), "--out", str(tmp_path / "taken")],
                  r"taken already exists")
    _expect_error(capsys, TO_HF, ["--megatron-dir", str(hf), "--out", str(tmp_path / "o")],
                  r"megatron_qrl\.json not found")
    with pytest.raises(SystemExit):
        TO_MEGATRON.parse_args(["--hf-dir", str(hf)])  # --out required without --dry-run


def test_uaq_is_not_applied_twice(tmp_path, capsys):
    hf = make_tiny_hf(tmp_path / "hf", "dense")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, UAQ_CONFIG_KEY: 1.5}))
    _expect_error(capsys, TO_MEGATRON, ["--hf-dir", str(hf), "--out", str(tmp_path / "o"),
                                        "--uaq-scale", "1.5"], r"already folded")


def test_uaq_scale_keeps_logits_and_is_recorded(tmp_path):
    pytest.importorskip("megatron_qrl.quant.uaq", reason="apply_uaq lands with the UAQ branch")
    hf = make_tiny_hf(tmp_path / "hf", "moe")
    assert TO_MEGATRON.main(["--hf-dir", str(hf), "--out", str(tmp_path / "mg"),
                             "--uaq-scale", "1.5"]) == 0
    meta, cfg, _ = read_metadata(tmp_path / "mg")
    assert meta["uaq_scale"] == 1.5 and cfg[UAQ_CONFIG_KEY] == 1.5
    assert TO_HF.main(["--megatron-dir", str(tmp_path / "mg"), "--out", str(tmp_path / "back")]) == 0
    before, after = _weights(hf), _weights(tmp_path / "back")
    name = "model.layers.0.input_layernorm.weight"
    assert torch.allclose(after[name], before[name] * 1.5)
    ids = tokens()
    assert (hf_logits(hf, ids) - hf_logits(tmp_path / "back", ids)).abs().max() <= 1e-4
    assert TO_MEGATRON.main(["--hf-dir", str(tmp_path / "back"), "--out", str(tmp_path / "again"),
                             "--uaq-scale", "1.5"]) == 2


def test_dry_run_qwen3_30b_a3b(capsys):
    assert TO_MEGATRON.main(["--hf-dir", str(CONFIG_DIR / "qwen3_30b_a3b.json"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "total parameters:  30,532,122,624 (30.53B)" in out
    assert "active parameters: 3,353,032,704 (3.35B)" in out
