"""bench/logprob_kernel.py on the CPU (tiny logits): one record per run with the commit, each
implementation's times and GB/s, the torch / triton ratios and the largest differences. The
kernels' place is taken here by the pure-torch stand-in of tests/losses/logprob_cases.py."""

from __future__ import annotations

import json

import pytest

from megatron_qrl.losses import logprobs
from tests.losses.logprob_cases import STANDIN


def test_one_implementation_appends_a_record(tmp_path, capsys):
    from bench.logprob_kernel import main

    out = tmp_path / "lp.jsonl"
    for _ in range(2):
        assert main(["--device", "cpu", "--rows", "6", "--vocab", "4096", "--impls", "torch",
                     "--repeats", "2", "--warmup", "0", "--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 2 and recs[0]["commit"] and recs[0]["device"] == "cpu"
    r = recs[0]["torch"]
    assert r["total_ms"] == pytest.approx(r["fwd_ms"] + r["bwd_ms"], abs=2e-3)
    assert r["fwd_gbs"] > 0 and "ratio_total" not in recs[0] and "max_diff" not in recs[0]
    assert "| torch |" in capsys.readouterr().out


def test_both_implementations_give_ratios_and_differences(monkeypatch, capsys):
    from bench.logprob_kernel import run

    monkeypatch.setattr(logprobs, "_kernels", lambda device: STANDIN
                        if logprobs.logprob_impl() == "triton" else None)
    rec = run(5, 33, "bf16", 0.7, ["torch", "triton"], "cpu", repeats=1, warmup=1)
    for key in ("fwd", "bwd", "total"):
        assert rec[f"ratio_{key}"] == pytest.approx(
            rec["torch"][f"{key}_ms"] / rec["triton"][f"{key}_ms"], rel=0.02)
    assert set(rec["max_diff"]) == {"lp", "ent", "grad"}
    assert rec["max_diff"]["lp"] < 1e-5 and rec["max_diff"]["grad"] < 1e-2


def test_bad_impls_and_configs_are_one_line():
    from bench.logprob_kernel import _configs, main

    for bad in ("cuda", "torch,torch", ""):
        with pytest.raises(SystemExit, match="--impls .*torch, triton"):
            main(["--device", "cpu", "--impls", bad])
    assert _configs("2048x4, 8192x16") == ["2048x4", "8192x16"] and _configs("") == []
    for bad in ("4096", "3000x8", "4096x3", "0x8", "ax8"):
        with pytest.raises(SystemExit, match="--configs .*BLOCKxWARPS"):
            main(["--device", "cpu", "--configs", bad])
