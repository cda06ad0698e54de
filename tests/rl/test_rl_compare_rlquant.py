"""--qrl-compare rlquant: the variant set, the one command end to end (RL runs, then every final
policy evaluated at its deployed precision, PTQ with ModelOpt calibration), the report."""

import json
import os
import subprocess
import sys

from megatron_qrl.rl.cli import COMPARE_SETS, _compare_base, parse_configs
from megatron_qrl.rl.compare import RLQUANT_VARIANTS, variant_argv
from megatron_qrl.rl.compare_rlquant import DEPLOYMENTS, held_out, table, write_report
from megatron_qrl.rl.compare_sets import VARIANT_SETS
from tests.helpers import RL_RUN_HELPER

BASE = ["--qrl-preset", "tiny-cpu", "--qrl-steps", "7"]


def test_rlquant_variants_are_the_papers_runs(tmp_path):
    assert COMPARE_SETS == tuple(VARIANT_SETS)
    want = {"bf16 grpo": ("bf16", "bf16", 0), "qaft int8": ("int8", "aligned", 0),
            "qaft w4a16": ("w4a16", "aligned", 0), "qlora nf4": ("bf16", "bf16", 8)}
    for label, extra in RLQUANT_VARIANTS:
        configs, _, _ = parse_configs(variant_argv(BASE, extra, tmp_path / "v"))
        got = (configs["rollout"].format, configs["train"].forward, configs["lora"].rank)
        assert got == want[label], label
        assert configs["loss"].kind == "ppo_clip"
        assert configs["loss"].aggregation == "seq_mean_token_mean"
    qlora = parse_configs(variant_argv(BASE, dict(RLQUANT_VARIANTS)["qlora nf4"], tmp_path))[0]
    assert (qlora["lora"].base_format, qlora["lora"].alpha, qlora["run"].lr) == ("nf4", 16.0, 1e-4)
    assert {v for _, v, _, _ in DEPLOYMENTS} == set(want)
    for argv in (["--qrl-compare", "rlquant", "--qrl-seeds", "1,2"],
                 ["--qrl-compare=rlquant"], ["--qrl-compare"]):
        assert _compare_base([*BASE, *argv]) == BASE
    assert _compare_base(["--qrl-compare", *BASE]) == BASE


def test_held_out_prompts_are_not_rl_prompts():
    configs = parse_configs(BASE)[0]
    from megatron_qrl.rl.driver import prepare_job

    train = prepare_job(configs).records
    ev = held_out(configs, train, 64)
    assert len(ev) == 64 and not {r.prompt for r in ev} & {r.prompt for r in train}


def test_table_gives_mean_std_and_paired_difference(tmp_path):
    res = {"1": {"bf16 grpo": {"task": 0.5, "held_out": 0.1},
                 "ptq rtn w4a16": {"task": 0.4, "held_out": 0.1}},
           "2": {"bf16 grpo": {"task": 0.7, "held_out": 0.3},
                 "ptq rtn w4a16": {"task": 0.7, "held_out": 0.1}}}
    md = table(res)
    assert "| bf16 grpo | 0.6000 ± 0.141 | +0.0000 ± 0.000 | 0.5000 | 0.7000 | 0.2000 ± 0.141 |" in md
    assert "| ptq rtn w4a16 | 0.5500 ± 0.212 | -0.0500 ± 0.071 | 0.4000 | 0.7000 |" in md
    assert "qaft" not in md
    md_path, png = write_report(res, tmp_path)
    assert md_path.read_text() == md and png.read_bytes()[:4] == b"\x89PNG"


def test_the_one_command_runs_trains_evaluates_and_reports(tmp_path):
    """RL for every variant, then PTQ (RTN, AWQ, SmoothQuant) of the full-precision policy
    and every policy at its deployed format, evaluated in the reference engine."""
    out = tmp_path / "rlq"
    small = ["--qrl-steps", "2", "--qrl-sft-steps", "2", "--qrl-task-num-prompts", "16",
             "--qrl-prompts-per-step", "2", "--qrl-rollout-n-samples-per-prompt", "2",
             "--qrl-rollout-max-new-tokens", "4", "--qrl-save-interval", "1",
             "--qrl-micro-batch-size", "2", "--qrl-updates-per-step", "1",
             "--qrl-no-progress"]
    proc = subprocess.run([sys.executable, str(RL_RUN_HELPER), "--qrl-preset", "tiny-cpu",
                           "--qrl-compare", "rlquant", "--qrl-seeds", "3", *small,
                           "--qrl-output-dir", str(out)], capture_output=True, text=True,
                          timeout=1200, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "seed3" / "rlquant_eval.json").read_text())
    assert sorted(res) == sorted(lab for lab, *_ in DEPLOYMENTS)
    assert all(0.0 <= v[k] <= 1.0 for v in res.values() for k in ("task", "held_out"))
    assert "awq" in proc.stdout and "Smoothed" in proc.stdout
    assert (out / "rlquant.png").is_file()
    md = (out / "rlquant.md").read_text()
    assert all(f"| {lab} |" in md for lab, *_ in DEPLOYMENTS)
