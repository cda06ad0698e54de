"""tools/mismatch_report.py --kv-cache: the "kv cache" row, checked against a transformers
reference whose attention function rounds the (post-RoPE, post k-norm) K/V with the test's
own FP8 grid (tests/helpers/kv_grid.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.kv_grid import positive_grid, round_half_even
from tests.helpers.te_quant_fixtures import quiet_torch_trace, tiny_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))


def _round(t: torch.Tensor) -> torch.Tensor:
    grid = positive_grid("fp8_e4m3")
    return torch.tensor([round_half_even(float(x), grid) for x in t.flatten()],
                        dtype=t.dtype).view_as(t)


def _rounded_kv_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(module, query, key, value, attention_mask, **kw):
        return sdpa_attention_forward(module, query, _round(key), _round(value), attention_mask, **kw)

    AttentionInterface.register("qrl_test_kv_fp8", rounded)
    saved = hf.config._attn_implementation
    hf.set_attn_implementation("qrl_test_kv_fp8")
    try:
        with torch.no_grad():
            return hf(input_ids=ids).logits
    finally:
        hf.set_attn_implementation(saved)


def test_kv_row_equals_transformers_reference(tmp_path, capsys):
    import mismatch_report

    from megatron_qrl.te_quant.attribution import prompt_ids, token_kl

    hf, arch = tiny_hf("dense")
    hf.save_pretrained(tmp_path / "hf")
    argv = ["--hf-dir", str(tmp_path / "hf"), "--format", "int8", "--kv-cache", "fp8_e4m3",
            "--out", str(tmp_path / "r.png"), "--batch", "2", "--seq-len", "12"]
    with quiet_torch_trace():
        assert mismatch_report.main(argv) == 0
    text = capsys.readouterr().out
    assert "kv cache=fp8_e4m3" in text.splitlines()[0]
    rows = {ln.split()[0]: ln.split()[1:] for ln in text.splitlines()[2:] if ln and ln[0] != "w"}
    assert set(rows) == {"attention", "mlp", "kv", "all"}, text
    kv_mean = float(rows["kv"][1])  # "kv cache <mean> ..."
    ids = prompt_ids(str(tmp_path / "hf"), None, 2, 12, arch.vocab_size, seed=0)
    with torch.no_grad():
        ref = token_kl(_rounded_kv_logits(hf, ids), hf(input_ids=ids).logits).mean().item()
    assert ref > 0 and kv_mean == pytest.approx(ref, rel=1e-2)
    assert float(rows["all"][0]) > 0


def test_plain_report_has_no_kv_row(tmp_path, capsys):
    import mismatch_report

    hf, _ = tiny_hf("dense")
    hf.save_pretrained(tmp_path / "hf")
    with quiet_torch_trace():
        assert mismatch_report.main(["--hf-dir", str(tmp_path / "hf"), "--format", "int8", "--out",
                                     str(tmp_path / "r.png"), "--seq-len", "8"]) == 0
    assert " kv cache" not in capsys.readouterr().out
