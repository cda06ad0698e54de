"""TensorBoard scalars of MetricsLogger: equal to metrics.jsonl per step, resume, no package.

Event files are read back with tensorboard's own ``EventAccumulator``; one short
``qrl-train`` run (tests/helpers/rl_run_helper.py, test engine double) checks the driver's logger.
"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_qrl.utils import metrics
from megatron_qrl.utils.metrics import MetricsLogger, read_metrics
from megatron_qrl.utils.optional import available
from tests.helpers import RL_RUN_HELPER
from tests.utils.test_metrics_io import rec

_TB, _TB_WHY = available("tensorboard.backend.event_processing.event_accumulator")
needs_tensorboard = pytest.mark.skipif(
    not _TB, reason=f"reads event files with tensorboard's EventAccumulator ({_TB_WHY})")
"""Only the cases that read event files need tensorboard; the missing-package path does not."""

HELPER = RL_RUN_HELPER


def scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}``; a step logged twice (not purged) is an error."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: steps {steps} logged twice"
        out[tag] = {e.step: e.value for e in events}
    return out


def from_jsonl(records: list[dict]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for r in records:
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                out.setdefault(k, {})[r["step"]] = v
    return out


def assert_same(tb: dict, want: dict) -> None:
    assert tb.keys() == want.keys()
    for tag in want:  # event files store float32
        assert tb[tag] == pytest.approx(want[tag], rel=1e-6, abs=1e-12), tag


@needs_tensorboard
def test_scalars_equal_jsonl_and_are_flushed_each_step(tmp_path):
    log = MetricsLogger(tmp_path)
    log.log(rec(0, "sft", reward=None, mismatch_kl=None, clip_frac=None, sft_loss=2.5))
    log.log(rec(1, reward=0.25, extra_metric=3, flag=True, note="text"))
    # flushed: readable while the logger is still open
    assert_same(scalars(tmp_path / "tensorboard"), from_jsonl(read_metrics(tmp_path)))
    log.log(rec(2, reward=0.75))
    log.close(plot=False)
    tb = scalars(tmp_path / "tensorboard")
    assert_same(tb, from_jsonl(read_metrics(tmp_path)))
    assert tb["reward_mean"] == {1: 0.25, 2: 0.75} and tb["sft_loss"] == {0: 2.5}
    assert "flag" not in tb and "note" not in tb and "phase" not in tb


@needs_tensorboard
def test_resume_rewrites_steps_once_and_a_custom_dir(tmp_path):
    tb_dir = tmp_path / "tb"
    with MetricsLogger(tmp_path, tensorboard_dir=tb_dir) as log:
        for s in range(5):  # the first run got to step 4, its checkpoint says next step 3
            log.log(rec(s, reward=0.1 * s))
    with MetricsLogger(tmp_path, tensorboard_dir=tb_dir, resume_from_step=3) as log:
        for s in range(3, 6):
            log.log(rec(s, reward=0.5 + s))
    tb = scalars(tb_dir)
    assert tb["reward_mean"] == pytest.approx({0: 0.0, 1: 0.1, 2: 0.2, 3: 3.5, 4: 4.5, 5: 5.5})
    assert_same(tb, from_jsonl(read_metrics(tmp_path)))
    assert not (tmp_path / "tensorboard").exists()


def test_off_switch_and_missing_package_logs_once(tmp_path, monkeypatch, caplog):
    with MetricsLogger(tmp_path / "off", tensorboard=False) as log:
        log.log(rec(0))
    assert not (tmp_path / "off" / "tensorboard").exists()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    monkeypatch.setattr(metrics, "_TB_MISSING_LOGGED", False)
    with caplog.at_level(logging.WARNING, logger=metrics.__name__):
        for run in ("a", "b"):
            with MetricsLogger(tmp_path / run) as log:
                log.log(rec(0))
                log.log(rec(1))
    lines = [r.getMessage() for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(lines) == 1 and "pip install tensorboard" in lines[0]
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [0, 1]
    assert not (tmp_path / "a" / "tensorboard").exists()


@pytest.mark.slow
@needs_tensorboard
def test_qrl_train_writes_the_jsonl_values_as_scalars(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(HELPER), "--double", "--qrl-preset", "tiny-cpu", "--qrl-sft-steps",
         "2", "--qrl-steps", "2", "--qrl-prompts-per-step", "2",
         "--qrl-rollout-n-samples-per-prompt", "2", "--qrl-rollout-max-new-tokens", "3",
         "--qrl-micro-batch-size", "4", "--qrl-updates-per-step", "1", "--qrl-no-progress",
         "--qrl-output-dir", str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tb = scalars(out / "tensorboard")
    assert_same(tb, from_jsonl(records))
    assert set(tb["reward_mean"]) == {2, 3} and set(tb["time_sync_s"]) == {0, 1, 2, 3}
