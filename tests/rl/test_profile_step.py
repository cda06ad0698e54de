"""--qrl-profile-step / --qrl-profile-trace: one RL step's trainer phases under torch.profiler,
on the tiny job (CPU; tests/rl/test_rl_driver.py's job made smaller). What the numbers say on
a GPU (kernel time, the caching allocator's cudaMalloc) is bench/rl_step.py's to measure."""

import json
from pathlib import Path

import pytest

from megatron_qrl.rl.cli import parse_configs
from tests.rl.test_rl_driver import _run


def test_the_profiled_step_records_its_trainer_phases_and_no_other_step_does(tmp_path):
    """Catches: the profile taken on another step (or every step), the recompute / train
    ranges missing (the summary's ``ranges_ms``), the summary or the trace not written, a
    profile key that is not a scalar (metrics.jsonl refuses it)."""
    recs = _run(tmp_path, "--qrl-steps", "2", "--qrl-sft-steps", "1", "--qrl-profile-step", "2",
                "--qrl-profile-trace")
    rl = [r for r in recs if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert not any(k.startswith("profile_") for k in rl[0])
    p = rl[1]
    summary = json.loads(Path(p["profile_summary"]).read_text())
    assert Path(p["profile_summary"]) == tmp_path / "profile_step2.summary.json"
    assert set(summary["ranges_ms"]) == {"qrl.recompute", "qrl.train"}
    assert 0 < p["profile_train_s"] <= p["profile_wall_s"] and p["profile_recompute_s"] > 0
    assert p["profile_gpu_busy_s"] is None and p["profile_device_allocs"] == 0  # the CPU
    assert Path(summary["trace"]) == tmp_path / "profile_step2.json"
    assert json.loads(Path(summary["trace"]).read_text())["traceEvents"]


def test_a_profile_step_below_minus_one_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--qrl-profile-step must be an integer >= -1"):
        parse_configs(["--qrl-profile-step", "-2"])
