"""Stops and resumes of qrl-train: SIGTERM / SIGINT, the save schedule, metrics.jsonl.

- A real ``qrl-train`` (tiny-cpu, reference engine) sent SIGTERM after its first metrics line
  stops after that step: exit 143, one line naming the checkpoint and ``--qrl-resume``, no
  traceback; the resumed run ends with the metrics and the summary line of the
  uninterrupted run; a resume whose metrics.jsonl lost a step is one line naming
  ``--qrl-resume-allow-missing-metrics``.
- SIGINT is recorded, not raised, while the steps run (rl.stop.StopRequest).
- ``--qrl-save-interval N`` saves every N SFT steps too.
- metrics.jsonl: a short write (full disk) leaves no torn line; a torn last line found at
  resume is dropped with a warning.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_qrl.utils.metrics import MetricsLogger, read_metrics
from tests.helpers import HELPERS

TIMING = ("time_",)
RUN = ["--qrl-preset", "tiny-cpu", "--qrl-sft-steps", "2", "--qrl-prompts-per-step", "2",
       "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
       "--qrl-micro-batch-size", "8", "--qrl-updates-per-step", "1", "--qrl-lr", "1e-3",
       "--qrl-no-progress", "--qrl-steps", "3", "--no-qrl-tensorboard"]


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(HELPERS / "rl_run_helper.py"), *RUN, "--qrl-output-dir",
            str(out), *extra]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("QRL_DEBUG", None)
    return env


def _records(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)}
            for r in read_metrics(out)]


def _summary(stdout: str) -> list[str]:
    return [ln for ln in stdout.splitlines() if "RL accuracy" in ln]


@pytest.mark.slow
def test_sigterm_stops_with_a_checkpoint_and_the_resumed_run_equals_the_whole_one(tmp_path):
    whole = subprocess.run(_cmd(tmp_path / "whole"), capture_output=True, text=True,
                           timeout=600, env=_env())
    assert whole.returncode == 0, whole.stderr[-3000:]

    out = tmp_path / "stopped"
    proc = subprocess.Popen(_cmd(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env())
    deadline = time.monotonic() + 300
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("qrl-train: stopped by SIGTERM")]
    assert len(lines) == 1, stderr[-3000:]
    done = len(read_metrics(out))
    assert 1 <= done < 5
    ckpt = out / "checkpoints" / f"step_{done:06d}.pt"
    assert f"checkpoint at {ckpt}" in lines[0] and "--qrl-resume" in lines[0]
    assert not (out / ".qrl-train.lock").exists()

    kept = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(kept[1:]) + "\n")  # step 0 lost
    refused = subprocess.run(_cmd(out, "--qrl-resume"), capture_output=True, text=True,
                             timeout=600, env=_env())
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "--qrl-resume-allow-missing-metrics" in refused.stderr.splitlines()[-1]
    (out / "metrics.jsonl").write_text("\n".join(kept) + "\n" + '{"step": 9, "pha')  # torn

    resumed = subprocess.run(_cmd(out, "--qrl-resume"), capture_output=True, text=True,
                             timeout=600, env=_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "torn record" in resumed.stdout + resumed.stderr
    assert _records(out) == _records(tmp_path / "whole")
    assert _summary(resumed.stdout) == _summary(whole.stdout) != []


def test_sigint_is_recorded_not_raised_while_steps_run():
    from megatron_qrl.rl.stop import StopRequest

    with StopRequest(log=lambda _m: None) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # the handler runs between bytecodes of this thread
        assert stop.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.slow
def test_save_interval_saves_during_sft(tmp_path, monkeypatch):
    import megatron_qrl.rl.driver as driver
    from megatron_qrl.models.runtime import single_process_megatron
    from megatron_qrl.rl.cli import parse_configs

    saved: list[int] = []
    real = driver.save_driver_checkpoint

    def recording(out, next_step, *a, **kw):
        saved.append(next_step)
        return real(out, next_step, *a, **kw)

    monkeypatch.setattr(driver, "save_driver_checkpoint", recording)
    configs, flags, _ = parse_configs([*RUN, "--qrl-sft-steps", "5", "--qrl-steps", "1",
                                       "--qrl-save-interval", "2",
                                       "--qrl-output-dir", str(tmp_path / "run")])
    with single_process_megatron():
        driver.run_job(configs, flags, progress=False, log=lambda _m: None)
    assert saved == [2, 4, 5, 6]


def test_a_short_write_leaves_no_torn_line(tmp_path, monkeypatch):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    rec = {"step": 0, "phase": "sft", "reward_mean": None, "mismatch_kl": None,
           "clip_frac": None, "error_token_rate": None, "time_rollout_s": 0.0,
           "time_train_s": 1.0, "time_sync_s": 0.0}
    logger.log(rec)
    real = os.write

    def half(fd, data):  # a full disk: part of the line reaches the file
        return real(fd, data[: len(data) // 2])

    monkeypatch.setattr(os, "write", half)
    with pytest.raises(OSError):
        logger.log({**rec, "step": 1})
    monkeypatch.undo()
    logger.close(plot=False)
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(ln)["step"] for ln in text.splitlines()] == [0]


def test_a_torn_last_line_is_dropped_with_a_warning_at_resume(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "phase": "sft"}\n{"step": 1, "ph')
    said: list[str] = []
    assert read_metrics(tmp_path, warn=said.append) == [{"step": 0, "phase": "sft"}]
    assert len(said) == 1 and "line 2" in said[0] and "torn" in said[0]
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "ph\n{"step": 1, "phase": "sft"}\n')
    with pytest.raises(ValueError, match="line 1: invalid JSON"):  # not the last: damage
        read_metrics(tmp_path)
