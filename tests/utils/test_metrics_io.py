"""Metrics logger (metrics.jsonl, PNG, compare table) and atomic writes."""

from __future__ import annotations

import json
import os

import pytest

from megatron_qrl.utils.io import (
    atomic_directory,
    atomic_torch_save,
    atomic_write_json,
    atomic_write_text,
)
from megatron_qrl.utils.metrics import (
    REQUIRED_KEYS,
    MetricsLogger,
    compare_runs,
    read_metrics,
    summarize_run,
)


def rec(step, phase="rl", reward=0.5, **extra):
    base = {"step": step, "phase": phase, "reward_mean": reward, "mismatch_kl": 0.01 * step,
            "clip_frac": 0.1, "error_token_rate": 0.0, "time_rollout_s": 1.0,
            "time_train_s": 2.0, "time_sync_s": 0.5}
    return base | extra


def test_atomic_file_writes_leave_no_temp(tmp_path):
    p = atomic_write_text(tmp_path / "a" / "x.txt", "one")
    atomic_write_text(p, "two")
    assert p.read_text() == "two"
    atomic_write_json(tmp_path / "j.json", {"b": 1, "a": 2})
    assert json.loads((tmp_path / "j.json").read_text()) == {"a": 2, "b": 1}
    import torch

    atomic_torch_save({"w": torch.ones(2)}, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt")["w"].sum() == 2
    assert sorted(os.listdir(tmp_path)) == ["a", "c.pt", "j.json"]
    assert os.listdir(tmp_path / "a") == ["x.txt"]


def test_atomic_directory_replaces_or_keeps_old(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as d:
        (d / "f").write_text("v1")
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as d:
            (d / "f").write_text("half")
            raise RuntimeError("crash mid-write")
    assert (target / "f").read_text() == "v1"
    with atomic_directory(target) as d:
        (d / "f").write_text("v2")
    assert (target / "f").read_text() == "v2"
    assert os.listdir(tmp_path) == ["ckpt"]
    with pytest.raises(FileExistsError):
        with atomic_directory(target, overwrite=False):
            pass


def test_logger_writes_validated_jsonl_and_png(tmp_path):
    import torch

    with MetricsLogger(tmp_path, tensorboard=True) as log:
        log.log(rec(0, "sft", mismatch_kl=None, clip_frac=None))
        log.log(rec(1, reward=torch.tensor(0.25), extra_metric=3))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["reward_mean"] == 0.25 and rows[1]["extra_metric"] == 3
    assert all(set(REQUIRED_KEYS) <= set(r) for r in rows)
    png = (tmp_path / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(FileExistsError, match="--qrl-resume"):
        MetricsLogger(tmp_path)


@pytest.mark.parametrize("bad, needle", [
    ({k: v for k, v in rec(0).items() if k != "clip_frac"}, "lacks required key"),
    (rec(0, phase="warmup"), "phase must be one of"),
    (rec(-1), "step must be an integer >= 0"),
    (rec(0, reward=float("nan")), "reward_mean=nan is not finite"),
    (rec(0, clip_frac="high"), "clip_frac must be a number"),
    (rec(0, other=[1]), "other has type list"),
])
def test_logger_rejects_bad_records(tmp_path, bad, needle):
    log = MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises((ValueError, TypeError), match=needle):
        log.log(bad)
    log.close(plot=False)


def test_logger_steps_increase_and_resume_truncates(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    for s in range(4):
        log.log(rec(s))
    with pytest.raises(ValueError, match="step 2 is not after the last logged step 3"):
        log.log(rec(2))
    log.close(plot=False)
    log = MetricsLogger(tmp_path, tensorboard=False, resume_from_step=2)
    assert log.last_step == 1
    log.log(rec(2, reward=0.9))
    log.close(plot=False)
    assert [(r["step"], r["reward_mean"]) for r in read_metrics(tmp_path)] == [
        (0, 0.5), (1, 0.5), (2, 0.9)]


def test_summary_and_compare_table(tmp_path):
    a = [rec(0, "sft", reward=0.0)] + [rec(s, reward=0.1 * s, prox_behav_ratio_max=1.0 + s)
                                       for s in range(1, 8)]
    b = [rec(s, reward=1.0, error_token_rate=0.5) for s in range(3)]
    summ = summarize_run(a, final_window=2)
    assert summ["final reward"] == pytest.approx((0.6 + 0.7) / 2)
    assert summ["mean KL(behav||prox)"] == pytest.approx(0.01 * sum(range(1, 8)) / 7)
    assert summ["max ratio prox/behav"] == 8.0
    assert summarize_run(b)["max ratio prox/behav"] is None
    run_b = tmp_path / "run_b"
    with MetricsLogger(run_b, tensorboard=False) as log:
        for r in b:
            log.log(r)
    md, png = compare_runs({"int8+acr": a, "bf16": run_b}, tmp_path, final_window=2)
    lines = md.read_text().splitlines()
    assert lines[0].startswith("| run | final reward | mean KL(behav||prox) | max ratio")
    assert lines[2].startswith("| int8+acr | 0.65 |") and "| 8 |" in lines[2]
    assert lines[3] == "| bf16 | 1 | 0.01 | n/a | 0.1 | 0.5 |"
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_atomic_writes_get_the_umask_modes_not_mkstemps(tmp_path, monkeypatch):
    """mkstemp / mkdtemp make 0600 / 0700 entries; checkpoints and metrics on a shared
    cluster must get the modes a plain open / mkdir gives (0666 / 0777 minus the umask)."""
    import torch

    import megatron_qrl.utils.io as io_mod

    monkeypatch.setattr(io_mod, "_UMASK", 0o022)
    f = atomic_write_text(tmp_path / "m.json", "{}")
    t = atomic_torch_save({"a": torch.zeros(1)}, tmp_path / "c.pt")
    with atomic_directory(tmp_path / "ckpt") as d:
        (d / "x").write_text("1")
    assert oct(f.stat().st_mode & 0o777) == oct(0o644)
    assert oct(t.stat().st_mode & 0o777) == oct(0o644)
    assert oct((tmp_path / "ckpt").stat().st_mode & 0o777) == oct(0o755)
