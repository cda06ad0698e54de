"""bench/fake_quant_speed.py on tiny expert stacks on the CPU: one row per format x
implementation with the commit, the bits of the fused path compared with torch's (the kernels'
place taken by a torch stand-in here; the real kernels under Triton's interpreter:
tests/quant/test_fused_fake_quant.py), a wrong kernel result reported as a difference naming
its stack (exit status 1), and the Triton rows skipped with the reason where Triton is
missing."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench.fake_quant_speed import FORMATS, main
from megatron_qrl.quant import fused
from megatron_qrl.quant.finite_checks import FiniteChecks
from megatron_qrl.quant.formats.nvfp4 import block_amax, fake_quant_rows

ARGS = ["--device", "cpu", "--tiny", "--layers", "1", "--experts", "4", "--repeats", "1",
        "--warmup", "0"]


def _standin(calls, wrong=None):
    """A kernels module whose fake quantizers are the torch path (recording their calls);
    ``wrong``: a format whose results get one value changed."""
    def make(name):
        def kernel(spec, w, *args):
            calls.append((name, spec.name, tuple(w.shape)))
            out = (fake_quant_rows(w, args[0], block_amax(w)) if args
                   else spec._fake_quant(w, None, "x", FiniteChecks())).to(w.dtype)
            if spec.name == wrong:
                out[1, 2] += 1.0
            return out, w.float().abs().amax(dim=1)
        return kernel
    names = {"fake_quant_channel", "fake_quant_fp8_block", "fake_quant_w4a16",
             "fake_quant_nvfp4"}
    return SimpleNamespace(**{n: make(n) for n in names})


@pytest.fixture
def kernels(monkeypatch):
    calls: list = []
    state = {"wrong": None}
    monkeypatch.setattr(fused, "kernels", lambda *_: _standin(calls, state["wrong"]))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return calls, state


def _rows(out):
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_every_format_and_impl_gives_a_row_and_the_same_bits(tmp_path, capsys, kernels):
    """fc1 [4, 256, 256] and fc2 [4, 256, 128]: both implementations per format, the stand-in
    called once per stack (the whole stack: the fused path's lifted cap; nvfp4 per stacked
    component run), bits equal, GB/s from the bytes and the time."""
    calls, _ = kernels
    out = tmp_path / "fq.jsonl"
    assert main(ARGS + ["--out", str(out)]) == 0
    rows = _rows(out)
    assert [(r["format"], r["impl"]) for r in rows] == [(f, i) for f in FORMATS
                                                        for i in ("torch", "triton")]
    nbytes = 4 * (256 * 256 + 256 * 128) * 2
    for r in rows:
        assert r["commit"] and r["cpu_numbers"] is True and r["bytes"] == nbytes
        assert r["agree"] is True and r["same_as"] == "torch" and "skipped" not in r
        assert r["gbs"] == pytest.approx(2 * nbytes / r["ms"] / 1e6, rel=1e-3)
    block = [c for c in calls if c[1] == "fp8_block"]
    assert len(block) == 2 * 2 and {c[2] for c in block} == {(1024, 256), (1024, 128)}
    printed = capsys.readouterr().out
    assert "CPU numbers" in printed and "DIFFER" not in printed


def test_a_wrong_kernel_result_is_a_difference(tmp_path, capsys, kernels):
    _, state = kernels
    state["wrong"] = "w4a16"
    out = tmp_path / "fq.jsonl"
    assert main(ARGS + ["--formats", "fp8_block,w4a16", "--out", str(out)]) == 1
    rows = {(r["format"], r["impl"]): r for r in _rows(out)}
    assert rows[("fp8_block", "triton")]["agree"] is True
    bad = rows[("w4a16", "triton")]
    assert bad["agree"] is False and bad["first_difference"].startswith(
        "layers.0.mlp.experts.linear_fc1: 1 of ")
    assert "DIFFER from torch" in capsys.readouterr().out


def test_without_triton_the_fused_rows_are_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(fused, "kernels", lambda *_: None)
    out = tmp_path / "fq.jsonl"
    assert main(ARGS + ["--formats", "int8", "--out", str(out)]) == 0
    torch_row, triton_row = _rows(out)
    assert triton_row["skipped"] == "Triton is not installed" and torch_row["agree"] is True


def test_bad_lists_are_one_line():
    for flag, bad in (("--formats", "fp4"), ("--impls", "torch,torch"), ("--impls", "")):
        with pytest.raises(SystemExit, match=f"{flag} .*comma list"):
            main(["--device", "cpu", flag, bad])

