"""tools/mismatch_report.py: per-layer-type KL(pi_aligned || pi_bf16) table and PNG."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.te_quant_fixtures import quiet_torch_trace, tiny_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))


def test_token_kl_closed_form():
    from megatron_qrl.te_quant.attribution import token_kl

    p = torch.tensor([[math.log(0.75), math.log(0.25)]])
    q = torch.tensor([[0.0, 0.0]])  # uniform
    want = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert token_kl(p, q).item() == pytest.approx(want, rel=1e-6)
    assert token_kl(p + 3.0, p).item() == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_report_table_png_and_reference_kl(tmp_path, capsys, kind):
    import mismatch_report

    from megatron_qrl.quant import get_spec
    from megatron_qrl.quant.hf_reference import quantized_copy
    from megatron_qrl.te_quant.attribution import prompt_ids, token_kl

    hf, arch = tiny_hf(kind)
    hf.save_pretrained(tmp_path / "hf")
    out = tmp_path / "report.png"
    argv = ["--hf-dir", str(tmp_path / "hf"), "--format", "nvfp4", "--out", str(out),
            "--batch", "2", "--seq-len", "16"]
    with quiet_torch_trace():
        assert mismatch_report.main(argv) == 0
    text = capsys.readouterr().out
    assert out.is_file() and out.stat().st_size > 1000
    rows = {ln.split()[0]: ln.split()[1:] for ln in text.splitlines()[2:] if ln and ln[0] != "w"}
    expected = {"attention", "experts" if kind == "moe" else "mlp", "all"}
    assert set(rows) == expected, text
    assert (rows["all"][3] != "-") == (kind == "moe")
    # independent check of the "all" row: transformers reference with the rollout weights
    ids = prompt_ids(str(tmp_path / "hf"), None, 2, 16, arch.vocab_size, seed=0)
    with torch.no_grad():
        ref = token_kl(quantized_copy(hf, get_spec("nvfp4"))(input_ids=ids).logits,
                       hf(input_ids=ids).logits).mean().item()
    assert float(rows["all"][0]) == pytest.approx(ref, rel=1e-3)
    assert all(float(r[0]) > 0 for r in rows.values())


def test_report_rejects_bf16_and_missing_dir(tmp_path, capsys):
    import mismatch_report

    with pytest.raises(SystemExit):
        mismatch_report.main(["--hf-dir", str(tmp_path), "--format", "bf16", "--out", "x.png"])
    assert mismatch_report.main(["--hf-dir", str(tmp_path), "--format", "int8",
                                 "--out", str(tmp_path / "x.png")]) == 2
    assert "config.json" in capsys.readouterr().err
