"""The main job until the RL loop lands: qrl-quant-report on the shipped tiny Qwen3-MoE."""

import json

import torch

from megatron_qrl.models.quant_report_cli import main
from megatron_qrl.quant import get_spec
from megatron_qrl.quant.hf_reference import hf_tensors, quantized_copy
from megatron_qrl.quant.report import DEFAULT_CONFIG, build_model


def test_report_writes_table_json_and_png(tmp_path, capsys):
    rc = main(["--formats", "bf16", "int8", "nvfp4", "--batch", "2", "--seq-len", "8",
               "--out-dir", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    rows = report["formats"]
    assert rows["bf16"]["kl_mean"] == 0.0 and rows["bf16"]["size_vs_bf16"] == 1.0
    assert 0 < rows["int8"]["kl_mean"] < rows["nvfp4"]["kl_mean"]
    assert all(r["contract_mismatches"] == 0 for r in rows.values())
    assert rows["nvfp4"]["size_vs_bf16"] < 0.5 < rows["int8"]["size_vs_bf16"] < 0.8
    assert (tmp_path / "report.png").stat().st_size > 10_000
    assert "| nvfp4 |" in capsys.readouterr().out


def test_quantized_copy_holds_exactly_the_dequantized_rollout_weights():
    model = build_model(DEFAULT_CONFIG, seed=0)
    spec = get_spec("fp8_block")
    clone = quantized_copy(model, spec)
    src, dst = dict(hf_tensors(model)), dict(hf_tensors(clone))
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    assert torch.equal(dst[name], spec.fake_quant_weight(src[name]))
    assert torch.equal(dst["model.layers.1.mlp.gate.weight"], src["model.layers.1.mlp.gate.weight"])


def test_activation_quant_reaches_attention_and_fused_experts():
    model = build_model(DEFAULT_CONFIG, seed=0)
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(0))
    spec = get_spec("int8")
    with torch.no_grad():
        weights_only = quantized_copy(model, get_spec("int8"))
        for h in list(weights_only.modules()):
            h._forward_pre_hooks.clear()
        a = weights_only(ids).logits
        b = quantized_copy(model, spec)(ids).logits
    assert not torch.equal(a, b)
    experts = quantized_copy(model, spec).model.layers[0].mlp.experts
    assert type(experts).__name__ == "_ActQuantFusedExperts"
