"""bench/rl_step.py: active-parameter count (closed form), per-variant flags, and the CPU smoke run of one RL step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.rl_step import active_params, split_variant_flags  # noqa: E402


def _cfg(name: str) -> dict:
    return json.loads((ROOT / "megatron_qrl/data/configs" / name).read_text())


def test_active_params_closed_form():
    c = _cfg("qwen3_30b_a3b.json")
    h, d, layers, v = c["hidden_size"], c["head_dim"], c["num_hidden_layers"], c["vocab_size"]
    attn = h * d * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"]) + 2 * d
    experts = c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"]
    per_layer = attn + 2 * h + c["num_experts"] * h + experts
    assert active_params(c) == layers * per_layer + h + v * h  # + final norm + lm_head
    four = _cfg("qwen3_4b.json")  # tied: the embedding counts once, as the output layer
    h, f = four["hidden_size"], four["intermediate_size"]
    per = h * 128 * (2 * 32 + 2 * 8) + 2 * 128 + 2 * h + 3 * h * f
    assert active_params(four) == 36 * per + h + four["vocab_size"] * h
    assert 3.9e9 < active_params(four) < 4.1e9 and 2.9e9 < active_params(c) < 3.2e9  # "A3B" counts the embedding too


def test_cpu_smoke_one_rl_step(tmp_path):
    from bench._runner import commit

    out = tmp_path / "rl_step.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/rl_step.py"), "--device", "cpu", "--model", "tiny",
         "--prompts", "2", "--n", "2", "--max-new-tokens", "6", "--micro-batch-size", "2",
         "--steps", "1", "--formats", "bf16,bf16@budget",
         "--variant-flags", "budget=--recompute-granularity selective",
         "--qrl", "--qrl-max-tokens-per-micro-batch 64", "--ckpt-root", str(tmp_path / "ck"),
         "--profile", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["bf16", "bf16@budget"]
    assert all(r["commit"] == commit() for r in rows)  # every benchmark row records its commit
    for r in rows:  # the step is the whole step: the four phases and nothing between them
        assert r["step_s"] >= sum(r[k] for k in ("time_rollout_s", "time_recompute_s",
                                                 "time_train_s", "time_sync_s"))
    for r in rows:  # --profile: the last step's trainer phases (catches: the flag not passed)
        assert set(r["profile"]["ranges_ms"]) == {"qrl.recompute", "qrl.train"}
        assert 0 < r["profile_train_s"] <= r["profile_wall_s"]
    for r in rows:
        assert all(r[k] > 0 for k in ("time_rollout_s", "time_recompute_s", "time_train_s",
                                      "time_sync_s", "trained_tokens"))
        assert 0 < r["train_recompute_share"] < 1
        assert r["trainer_mfu"] == round(6 * r["active_params"] * r["trained_tokens"]
                                         / r["time_train_s"] / 989e12, 4)
    assert "| bf16@budget |" in proc.stdout


def test_job_runs_under_the_models_preset(tmp_path):
    """The 4B step is the example's job (one update per step: no pi_prox recompute); before
    2026-12-02 it ran under tiny-cpu's two updates."""
    from bench.rl_step import _job, parse_args
    from megatron_qrl.config import effective_values
    from megatron_qrl.rl.cli import build_parser

    def updates(model, *extra):
        args = parse_args(["--model", model, *extra])
        cmd = _job(args, tmp_path, "fp8", "", tmp_path / "o")
        qrl = cmd[cmd.index("megatron_qrl.rl.cli") + 1:cmd.index("--")]
        v = effective_values(build_parser().parse_args(qrl))
        return v["qrl_preset"], v["qrl_updates_per_step"], v["qrl_lr"]

    assert updates("qwen3_4b") == ("qwen3-4b-1gpu", 1, 1e-6)
    assert updates("qwen3_30b_a3b") == ("qwen3-30b-a3b", 4, 1e-6)
    assert updates("tiny")[:2] == ("tiny-cpu", 2)
    assert updates("qwen3_4b", "--preset", "tiny-cpu")[:2] == ("tiny-cpu", 2)


def test_qrl_flags_and_megatron_flags_split():
    qrl, meg = split_variant_flags(
        "--qrl-train-forward aligned --use-distributed-optimizer --qrl-routing-replay all "
        "--recompute-modules moe_act layernorm --no-qrl-tensorboard")
    assert qrl == ["--qrl-train-forward", "aligned", "--qrl-routing-replay", "all",
                   "--no-qrl-tensorboard"]
    assert meg == ["--use-distributed-optimizer", "--recompute-modules", "moe_act", "layernorm"]
    assert split_variant_flags("") == ([], [])


def test_h200_rlstep_variant_flags_are_valid_qrl_flags():
    """Every ``--variant-flags`` of bench/h200.sh's RL-step phases parses and passes the
    combination checks on a Hopper GPU with an fp8 rollout (a device call is too scarce to
    lose on a misspelled flag). Catches: a flag renamed in the config but not in h200.sh
    (e.g. ``--qrl-train-aligned-wgrad`` spelled ``--qrl-train-wgrad``), a variant whose flags
    contradict each other."""
    import argparse
    import re

    from megatron_qrl.config.args import add_qrl_args, validate_qrl_args

    named = re.findall(r'--variant-flags "(\w+)=([^"]*)"', (ROOT / "bench/h200.sh").read_text())
    assert {"aligned", "replay", "alignedfake", "aligned8"} <= {n for n, _ in named}
    for name, flags in named:
        qrl, _ = split_variant_flags(flags)
        parser = add_qrl_args(argparse.ArgumentParser(allow_abbrev=False))
        try:
            args = parser.parse_args(["--qrl-rollout-format", "fp8", *qrl])
            validate_qrl_args(args, gpu_capability=(9, 0))
        except (SystemExit, Exception) as exc:
            raise AssertionError(f"bench/h200.sh variant {name!r} ({flags}): {exc}") from exc
