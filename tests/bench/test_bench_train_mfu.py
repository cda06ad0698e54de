"""bench/train_mfu.py: row grammar, --pick, the recompute switch reaching megatron-core, CPU smoke."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench.train_mfu import RECOMPUTE, Row, _kernel_profile, pick  # noqa: E402
from tests.helpers.mp_utils import run_distributed  # noqa: E402


def test_row_grammar_and_rl_step_flags():
    r = Row.parse("full-mb4-oldlp-norope")
    assert (r.recompute, r.micro_batch, r.max_tokens, r.chunked, r.rope_fusion) == (
        True, 4, 0, False, False)
    assert r.rl_step_args() == ("--micro-batch-size 4", RECOMPUTE + " --no-rope-fusion", "")
    assert Row.parse("none-tok8192-lp16384-prox1").rl_step_args() == (
        "--max-tokens-per-micro-batch 8192", "",
        "--qrl-log-prob-max-tokens 16384 --qrl-prox-from-first-update")
    assert Row.parse("none-mb4-thd").rl_step_args() == ("--micro-batch-size 4", "",
                                                         "--qrl-pack-sequences")
    assert Row.parse("none-mb4-prox0").rl_step_args()[2] == "--no-qrl-prox-from-first-update"
    assert [Row.parse(f"none-mb4{w}").prox_first for w in ("", "-prox1", "-prox0")] == [
        None, True, False]  # no word: qrl-train's default
    assert Row.parse("none-tok64-thd").thd and not Row.parse("none-tok64").thd
    for bad, match in (("half-mb4", "full or none"), ("full-mb4-tok8", "exactly one"),
                       ("none", "exactly one"), ("none-mb4-fast", "unknown word")):
        with pytest.raises(ValueError, match=match):
            Row.parse(bad)


def test_pick_takes_the_fastest_row_that_fits(tmp_path):
    rows = [{"row": "full-mb4-oldlp-norope", "time_recompute_s": 1, "time_train_s": 1,
             "peak_reserved_gib": 80},  # the earlier code: never picked
            {"row": "full-mb4", "time_recompute_s": 7, "time_train_s": 20, "peak_reserved_gib": 80},
            {"row": "none-mb8", "time_recompute_s": 5, "time_train_s": 12,
             "peak_reserved_gib": 125},  # too big for the engine's resume
            {"row": "none-mb4", "time_recompute_s": 6, "time_train_s": 15, "peak_reserved_gib": 100},
            {"row": "full-mb16", "error": "OOM: ..."}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert pick(path, 110.0) == ("--micro-batch-size 4", "", "")
    assert pick(path, 130.0) == ("--micro-batch-size 8", "", "")
    with pytest.raises(SystemExit, match="no row"):
        pick(path, 50.0)


def _switch_body(rank, world_size, port):
    from megatron.core.transformer.transformer_block import TransformerBlock

    from bench.train_mfu import _apply, _configs, micro_batches, parse_args, rollout_batch
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.losses.megatron_adapter import PolicyLossFunc
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.rl.trainer import PolicyTrainer, build_policy

    calls = []
    inner = TransformerBlock._checkpointed_forward

    def spy(self, *a, **k):
        calls.append(1)
        return inner(self, *a, **k)

    TransformerBlock._checkpointed_forward = spy  # this child process only
    init_cpu_distributed(rank, world_size, port, tp=1, seed=1234)
    try:
        with cpu_device_mode():
            cfg = json.loads((ROOT / "megatron_qrl/data/configs/tiny_qwen3.json").read_text())
            arch = arch_from_dict(cfg, source="tiny")
            configs = _configs()
            batch = rollout_batch(parse_args(["--prompts", "2", "--n", "2", "--new-tokens",
                                              "8"]), arch.vocab_size)
            out = {}
            for name in ("full-mb2", "none-mb2"):
                torch.manual_seed(7)
                trainer = PolicyTrainer(build_policy(arch, 1e-3))
                row = Row.parse(name)
                _apply(trainer.policy, row, fused_rope=False)
                loss_fn = PolicyLossFunc(configs["loss"], configs["error_tokens"])
                (group,) = micro_batches(row, batch, 1)
                for mb, lp in zip(group, trainer.log_probs(group, loss_fn)):
                    mb["old_log_probs"] = lp
                before = len(calls)
                metrics, norm = trainer.train_step(group, loss_fn)
                out[name] = {"calls": len(calls) - before, "norm": norm, "loss": metrics["loss"]}
        return out
    finally:
        destroy_cpu_distributed()


def test_recompute_switch_reaches_megatron_and_keeps_the_maths():
    (out,) = run_distributed(_switch_body, 1)
    assert out["full-mb2"]["calls"] > 0 and out["none-mb2"]["calls"] == 0
    assert out["full-mb2"]["norm"] == pytest.approx(out["none-mb2"]["norm"], rel=1e-5)
    assert out["full-mb2"]["loss"] == pytest.approx(out["none-mb2"]["loss"], rel=1e-5, abs=1e-7)


def test_cpu_smoke(tmp_path):
    out = tmp_path / "t.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/train_mfu.py"), "--device", "cpu", "--model", "tiny",
         "--prompts", "2", "--n", "4", "--new-tokens", "12",
         "--rows", "full-mb4-oldlp-norope,none-mb2-lp1000-prox0,none-mb8,none-tok40,"
         "none-mb2-prox1,none-mb2,none-mb2-lp1000-prox0-thd",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["row"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "do not split" in rows["none-mb8"]["error"]  # 8 samples, 2 updates
    check = rows["log_prob_check"]
    assert check["max_abs_dlogp"] < 1e-5 and check["max_abs_dentropy"] < 1e-5
    assert check["max_abs_dgrad"] < 1e-5 < check["max_abs_grad"]
    for name in ("full-mb4-oldlp-norope", "none-mb2-lp1000-prox0", "none-tok40"):
        r = rows[name]
        assert r["time_train_s"] > 0 and r["time_recompute_s"] > 0 and r["real_tokens"] > 0
    full = rows["none-mb2-lp1000-prox0"]  # every micro batch recomputed
    assert full["micro_batches"] == 4 and full["recomputed_tokens"] == full["trained_tokens"]
    for name in ("none-mb2-prox1", "none-mb2"):  # 2 updates: the second half only (default)
        assert 2 * rows[name]["recomputed_tokens"] == rows[name]["trained_tokens"]
    assert rows["none-tok40"]["trained_tokens"] <= full["trained_tokens"]
    thd = rows["none-mb2-lp1000-prox0-thd"]  # packed: the positions run are the samples' own
    assert thd["trained_tokens"] == thd["recomputed_tokens"] < full["trained_tokens"]
    assert "| none-tok40 |" in proc.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "bench/train_mfu.py"), "--rows", "x-mb1"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "full or none" in bad.stderr


def test_cpu_smoke_stacked_experts_without_te(tmp_path):
    """The ``st`` row (stacked experts) on the tiny Qwen3-MoE through the local spec (no
    Transformer Engine here): built with ``StackedGroupedMLP``, times and tokens as the
    sequential row's, and its rl_step.py flags name ``--qrl-train-moe-experts stacked``."""
    out = tmp_path / "t.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/train_mfu.py"), "--device", "cpu", "--model",
         "tiny_qwen3_moe", "--transformer-impl", "local", "--prompts", "2", "--n", "4",
         "--new-tokens", "12", "--rows", "none-mb2-st,none-mb2", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["row"]: r for r in map(json.loads, out.read_text().splitlines())}
    st, seq = rows["none-mb2-st"], rows["none-mb2"]
    assert (st["experts"], seq["experts"]) == ("StackedGroupedMLP", "SequentialMLP")
    assert st["time_train_s"] > 0 and st["trained_tokens"] == seq["trained_tokens"]
    assert st["transformer_impl"] == "local"
    assert Row.parse("none-mb16-st-pf-rf").rl_step_args() == (
        "--micro-batch-size 16", "--moe-permute-fusion --moe-router-fusion",
        "--qrl-train-moe-experts stacked")
    assert Row.parse("none-mb4-st-a2a").rl_step_args()[1] == (
        "--moe-token-dispatcher-type alltoall")
    with pytest.raises(ValueError, match="ag and a2a"):
        Row.parse("none-mb4-ag-a2a")


def test_kernel_profile_reads_the_profiler_events():
    a, b = torch.randn(300, 300), torch.randn(300, 300)
    out = _kernel_profile(lambda: [a @ b for _ in range(5)], device="cpu")
    assert out["busy_frac"] > 0 and out["wall_ms"] > 0
    assert any("mm" in name for name in out["top_ms"]) and len(out["top_ms"]) <= 6
