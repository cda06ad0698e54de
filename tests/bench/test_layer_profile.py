"""bench/layer_profile.py and train_mfu.py's MoE rows: parts named, recompute told apart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench.layer_profile import backward_part, forward_part, table  # noqa: E402
from bench.train_mfu import Row  # noqa: E402


def test_part_names():
    layer = "module.module.decoder.layers.3"
    assert forward_part(f"{layer}.mlp.router") == "router"
    assert forward_part(f"{layer}.mlp.experts") == "experts"
    assert forward_part(f"{layer}.mlp") == "mlp_or_moe"
    assert forward_part(f"{layer}.self_attention") == "attention"
    assert forward_part(f"{layer}.mlp.experts.linear_fc1") is None  # inside a part: its own
    assert forward_part("module.module.output_layer") == "lm_head"
    assert backward_part("GroupedLinearBackward") == "experts"
    assert backward_part("torch::autograd::AccumulateGrad") == "other"
    assert backward_part("PermuteMaskMapBackward") == "mlp_or_moe"
    assert backward_part("FusedAttnFuncBackward") == "attention"


def test_moe_row_words():
    r = Row.parse("none-mb8-gg-pf")
    assert dict(r.moe) == {"moe_grouped_gemm": True, "moe_permute_fusion": True}
    assert r.rl_step_args()[1] == "--moe-grouped-gemm --moe-permute-fusion"
    assert Row.parse("none-mb8-pf-gg").moe == r.moe  # one build per set, whatever the order
    assert Row.parse("full-mb2").moe == ()
    assert dict(Row.parse("none-mb2-ag").moe) == {"moe_token_dispatcher_type": "allgather"}


def test_table_lines():
    rows = [{"row": "a", "breakdown": {"parts_ms": {"experts": 8.0, "optimizer": 2.0},
                                       "gpu_busy_ms": 10.0, "wall_ms": 12.0}}]
    text = table(rows, layers=4)
    assert "| experts | 8.0 (2.00/layer) |" in text and "| optimizer | 2.0 |" in text


def test_breakdown_on_a_tiny_moe(tmp_path):
    """The CPU attribution (each op's own CPU time): every MoE part shows up, and only the row
    with activation recompute has ``recompute:`` parts."""
    out = tmp_path / "t.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/train_mfu.py"), "--device", "cpu", "--model",
         "tiny_qwen3_moe", "--prompts", "2", "--n", "4", "--new-tokens", "12", "--updates", "1",
         "--rows", "none-mb4,full-mb4-ag", "--breakdown", "--no-profile", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["row"]: r for r in map(json.loads, out.read_text().splitlines())}
    plain, full = rows["none-mb4"]["breakdown"]["parts_ms"], rows["full-mb4-ag"]["breakdown"]["parts_ms"]
    for part in ("router", "experts", "attention", "optimizer"):
        assert plain.get(part, 0) > 0, (part, plain)
    assert not any(p.startswith("recompute:") for p in plain)
    assert full.get("recompute:experts", 0) > 0, full
    assert rows["none-mb4"]["commit"]
    assert "| part |" in proc.stdout


def test_a_range_does_not_count_its_kernels_twice():
    """A ``record_function`` range's own CUDA span (listed by torch's profiler as a kernel named
    like the range) and a user annotation's kernels are not the range's: counting them charged
    GPU time inside ``Optimizer.step`` and the ``qrl::`` ranges twice on the H200."""
    from types import SimpleNamespace as NS

    from bench.layer_profile import launched_kernels

    gemm = NS(name="sm90_xmma_gemm", duration=5.0)
    op = NS(name="aten::mm", kernels=[gemm], is_user_annotation=False)
    rng = NS(name="Optimizer.step#AdamW.step", is_user_annotation=False,
             kernels=[NS(name="Optimizer.step#AdamW.step", duration=900.0)])
    ann = NS(name="qrl::experts", is_user_annotation=True, kernels=[gemm])
    assert launched_kernels(op) == [gemm]
    assert launched_kernels(rng) == [] and launched_kernels(ann) == []
