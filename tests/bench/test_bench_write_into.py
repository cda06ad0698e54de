"""bench/write_into.py on the CPU (2 experts per stack): one row per (format, implementation)
with the commit, the same bits from both implementations, and a write that differs reported
(exit status 1)."""

from __future__ import annotations

import json

import pytest
import torch

import bench.write_into as wi
from megatron_qrl.quant.fused import quant_impl


def _rows(out):
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_rows_for_each_format_and_implementation(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    assert wi.main(["--device", "cpu", "--experts", "2", "--repeats", "1",
                    "--formats", "fp8,fp8_block", "--out", str(out)]) == 0
    rows = _rows(out)
    assert [(r["format"], r["impl"]) for r in rows] == [
        ("fp8", "torch"), ("fp8", "auto"), ("fp8_block", "torch"), ("fp8_block", "auto")]
    # gate + up + down stacks of 2 experts in bf16, read; codes (1 byte) + scales written
    weights = 3 * 2 * 768 * 2048 * 2
    for r in rows:
        assert r["commit"] and r["ms_layer"] > 0 and r["bytes"] > weights + weights // 2
        # ms_layer is rounded to 0.001 ms, the projection is of the unrounded ms
        assert r["ms_48_layers"] == pytest.approx(r["ms_layer"] * 48, abs=0.1)
    assert all(r["same_bits"] is True and r["vs_torch"] > 0 for r in rows[1::2])
    assert "| fp8_block | auto |" in capsys.readouterr().out


def test_a_write_that_differs_fails_the_run(tmp_path, monkeypatch):
    real = wi._write_layer

    def off_by_one_code(spec, ws, regions):
        out = real(spec, ws, regions)
        if quant_impl() == "auto":  # the first code of the gate stack, one bit flipped
            codes = out[0].view(torch.uint8)
            codes[(0,) * codes.dim()] ^= 1
        return out

    monkeypatch.setattr(wi, "_write_layer", off_by_one_code)
    out = tmp_path / "w.jsonl"
    assert wi.main(["--device", "cpu", "--experts", "2", "--repeats", "1", "--formats", "int8",
                    "--out", str(out)]) == 1
    assert _rows(out)[1]["same_bits"] is False
