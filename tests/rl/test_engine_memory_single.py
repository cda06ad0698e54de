"""Single mode with an in-process SGLang engine: its memory is released after each rollout
(before recompute + train) and resumed before the next weight sync, as the Ray colocated engine
does; with --no-qrl-rollout-sglang-release-memory (or the reference engine) never."""

from __future__ import annotations

import time

import pytest

from megatron_qrl.rl.cli import parse_configs
from tests.helpers.rl_engine_double import TinyEngine
from tests.rl.run_records import read_records


class RecordingEngine(TinyEngine):
    """The driver-test engine that logs the calls the driver makes, in order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []
        self.released = False

    def update_weights(self, named_tensors, version: int) -> None:
        assert not self.released, "weights sent to a released engine"
        self.calls.append(f"update{version}")
        super().update_weights(named_tensors, version)
        self.last_sync = {"buckets": version, "write_s": 0.25, "engine_writes": True,
                          "verified": "digest"}  # as the SGLang engine keeps it

    def generate(self, prompts, sampling):
        assert not self.released, "generate on a released engine"
        self.calls.append("generate")
        return super().generate(prompts, sampling)

    def release_memory(self) -> None:
        self.calls.append("release")
        self.released = True
        time.sleep(self.delay)

    def resume_memory(self) -> None:
        self.calls.append("resume")
        self.released = False
        time.sleep(self.delay)

    delay = 0.0
    """Seconds each release / resume takes (the step's record must report them)."""


def _run(tmp_path, *extra: str) -> list[str]:
    from megatron_qrl.rl.driver import run_job

    configs, flags, _ = parse_configs([
        "--qrl-preset", "tiny-cpu", "--qrl-model", "tiny-dense", "--qrl-train-forward", "bf16",
        "--qrl-routing-replay", "off", "--qrl-sft-steps", "1", "--qrl-steps", "2",
        "--qrl-prompts-per-step", "2", "--qrl-rollout-n-samples-per-prompt", "2",
        "--qrl-rollout-max-new-tokens", "3", "--qrl-micro-batch-size", "2",
        "--qrl-save-interval", "-1", "--qrl-output-dir", str(tmp_path), *extra])
    configs["rollout"].engine = "sglang"  # parsed as reference here (no GPU), run as SGLang
    engines: list[RecordingEngine] = []

    def factory(rollout_cfg, hf_config, seed):
        engines.append(RecordingEngine(hf_config, rollout_cfg.format, seed))
        return engines[-1]

    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        run_job(configs, flags, engine_factory=factory, progress=False, log=lambda _m: None)
    assert not list(tmp_path.glob("checkpoints/step_*.pt")), "--qrl-save-interval -1 saved"
    return engines[0].calls


@pytest.mark.slow
def test_release_after_rollout_resume_before_sync(tmp_path, monkeypatch):
    monkeypatch.setattr(RecordingEngine, "delay", 0.3)
    assert _run(tmp_path / "on") == ["update1", "generate", "release", "resume", "update2",
                                     "generate", "release", "resume", "update3"]
    rl = [r for r in read_records(tmp_path / "on") if r["phase"] == "rl"]
    for r in rl:  # the release in the rollout's time, the resume in the sync's, each reported
        assert 0.3 <= r["time_engine_release_s"] <= r["time_rollout_s"]
        assert 0.3 <= r["time_engine_resume_s"] <= r["time_sync_s"]
    # the engine's account of each step's sync, its numbers and how it was verified
    assert [(r["sync_buckets"], r["sync_write_s"], r["sync_verified"]) for r in rl] == [
        (2, 0.25, "digest"), (3, 0.25, "digest")]
    assert not any("sync_engine_writes" in r for r in rl)
    monkeypatch.setattr(RecordingEngine, "delay", 0.0)
    assert _run(tmp_path / "off", "--no-qrl-rollout-sglang-release-memory") == [
        "update1", "generate", "update2", "generate", "update3"]
