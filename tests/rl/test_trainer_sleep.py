"""The trainer asleep while the engine decodes (--qrl-trainer-sleep, rl.trainer_sleep).

On CPU the same code path runs as on a GPU (storages copied into host buffers and released
to 0 bytes, then restored), so these tests prove: after a sleep no trainer storage holds a
byte; after the wake every Parameter, view and optimizer tensor is the same Python object
with the same bits; a qrl-train run with the sleep on gives the same metrics, bit for bit, as
with it off; the driver sleeps / wakes / releases / resumes in the order that keeps the
engine and the full trainer from sharing the GPU.
"""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.rl.cli import main, parse_configs
from megatron_qrl.rl.trainer_sleep import TrainerSleep, trainer_tensors
from tests.rl.run_records import read_records
from tests.rl.test_engine_memory_single import RecordingEngine


def _policy_after_a_step(bf16: bool, distributed: bool):
    """A tiny dense policy after one SFT optimizer step (Adam moments exist)."""
    from megatron_qrl.data import CharTokenizer, tiny_dense_config
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.rl.batch import sft_batch, split_batch
    from megatron_qrl.rl.steps import _sft_loss
    from megatron_qrl.rl.trainer import PolicyTrainer, TrainerOptions, build_policy

    tok = CharTokenizer()
    torch.manual_seed(0)
    arch = arch_from_dict(tiny_dense_config(tok.vocab_size), source="tiny")
    trainer = PolicyTrainer(build_policy(arch, 1e-3, bf16=bf16, options=TrainerOptions(
        transformer_impl="local", distributed_optimizer=distributed)))
    batch = sft_batch([tok.encode("1+2=")] * 4, [[*tok.encode("3"), tok.eos_id]] * 4)
    trainer.train_step(split_batch(batch, 2), _sft_loss, per_token_loss=False)
    return trainer


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone() if t.numel() else t.detach().clone()


@pytest.mark.parametrize("bf16,distributed", [(False, False), (True, False), (True, True)])
def test_sleep_releases_every_storage_and_wake_restores_bits_and_identities(bf16, distributed):
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        trainer = _policy_after_a_step(bf16, distributed)
        policy = trainer.policy
        before = trainer_tensors(policy.ddp, policy.optimizer)
        assert before["state"] and before["grads"] and before["params"]
        ids = {role: [id(t) for t in ts] for role, ts in before.items()}
        kept = {role: [_bits(t) for t in ts] for role, ts in before.items() if role != "grads"}
        grad_store = {t.untyped_storage()._cdata for t in before["grads"]}
        opt_state = policy.optimizer.state_dict()
        sleeper = TrainerSleep.of_policy(policy)

        stats = sleeper.sleep(keep_params=True)
        assert sleeper.asleep_roles() == {"grads", "state"}
        weights = {t.untyped_storage()._cdata for t in before["params"]}  # views count there
        assert all(t.untyped_storage().nbytes() == 0 for t in before["state"] + before["grads"]
                   if t.untyped_storage()._cdata not in weights)
        assert all(p.untyped_storage().nbytes() > 0 for p in policy.ddp.module.parameters())
        assert stats.bytes_copied > 0 and stats.bytes_released > stats.bytes_copied
        sleeper.sleep()  # the weights too
        assert all(t.untyped_storage().nbytes() == 0 for ts in before.values() for t in ts)
        assert sleeper.asleep_roles() == {"params", "grads", "state"}

        sleeper.wake()
        assert not sleeper.asleep
        after = trainer_tensors(policy.ddp, policy.optimizer)
        assert {role: [id(t) for t in ts] for role, ts in after.items()} == ids
        for role, bits in kept.items():
            for t, b in zip(after[role], bits):
                assert torch.equal(_bits(t), b), role
        for t in after["grads"]:  # released; train_step zeroes them before its backward anyway
            assert t.untyped_storage()._cdata in grad_store and not t.any()
        for p in policy.ddp.module.parameters():  # still views into the DDP grad buffer
            assert p.main_grad.untyped_storage()._cdata in grad_store
        _assert_same(policy.optimizer.state_dict(), opt_state)


@pytest.mark.parametrize("bf16,distributed", [(True, False), (True, True)])
def test_deferred_wake_leaves_the_state_to_state_ready(bf16, distributed):
    """``wake(defer_state=True)``: weights and gradients back at once, the optimizer state
    (fp32 masters, Adam moments) still asleep on the CPU until ``state_ready``; then every
    bit and identity as before. A ``sleep`` right after a deferred wake (no optimizer step
    between) keeps the state too."""
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        trainer = _policy_after_a_step(bf16, distributed)
        policy = trainer.policy
        before = trainer_tensors(policy.ddp, policy.optimizer)
        kept = {role: [_bits(t) for t in ts] for role, ts in before.items() if role != "grads"}
        opt_state = policy.optimizer.state_dict()
        sleeper = TrainerSleep.of_policy(policy)
        for rounds in (1, 2):
            sleeper.sleep()
            sleeper.wake(defer_state=True)
            assert sleeper.state_pending and sleeper.asleep_roles() == {"state"}
            assert all(p.untyped_storage().nbytes() > 0 for p in policy.ddp.module.parameters())
            if rounds == 1:  # to sleep again before anything read the state
                continue
            sleeper.state_ready()
            assert not sleeper.state_pending and not sleeper.asleep
            sleeper.state_ready()  # a no-op once ready
        after = trainer_tensors(policy.ddp, policy.optimizer)
        for role, bits in kept.items():
            for t, b in zip(after[role], bits):
                assert torch.equal(_bits(t), b), role
        _assert_same(policy.optimizer.state_dict(), opt_state)


def _assert_same(a, b) -> None:
    if torch.is_tensor(a):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


JOB = ["--qrl-preset", "tiny-cpu", "--qrl-model", "tiny-dense", "--qrl-train-forward", "bf16",
       "--qrl-routing-replay", "off", "--qrl-sft-steps", "1", "--qrl-steps", "3",
       "--qrl-prompts-per-step", "2", "--qrl-rollout-n-samples-per-prompt", "2",
       "--qrl-rollout-max-new-tokens", "3", "--qrl-micro-batch-size", "2",
       "--qrl-save-interval", "2", "--qrl-no-progress"]
TIMES = {"time_rollout_s", "time_recompute_s", "time_train_s", "time_sync_s", "time_sleep_s",
         "time_step_s",
         "time_wake_s", "trainer_gpu_gib_asleep"}


def test_run_with_sleep_equals_run_without_bit_for_bit(tmp_path):
    """Metrics step by step (losses, rewards, KL, grad norms, samples) and the checkpoints."""
    for name in ("on", "off"):
        assert main([*JOB, "--qrl-trainer-sleep", name, "--qrl-output-dir",
                     str(tmp_path / name)]) == 0
    on, off = read_records(tmp_path / "on"), read_records(tmp_path / "off")
    assert [r["step"] for r in on] == [0, 1, 2, 3]
    for a, b in zip(on, off):
        assert {k: v for k, v in a.items() if k not in TIMES} == \
            {k: v for k, v in b.items() if k not in TIMES}
    rl_on = [r for r in on if r["phase"] == "rl"]
    assert all(r["time_sleep_s"] > 0 and r["time_wake_s"] > 0 for r in rl_on)
    assert all("time_sleep_s" not in r for r in off)
    a, b = (torch.load(tmp_path / n / "checkpoints" / "step_000004.pt", weights_only=False)
            for n in ("on", "off"))
    _assert_same(a["trainer"], b["trainer"])  # saved after a wake: the full state


def test_step_phases_are_disjoint_and_cover_the_step(tmp_path, monkeypatch):
    """rollout + recompute + train + sync + sleep + wake == ``time_step_s``: a slow sleep of
    the optimizer state before the sync (made 0.4 s here) and a slow wake land in
    ``time_sleep_s`` / ``time_wake_s`` only, never in the train or rollout time."""
    import time as _time

    sleep, wake = TrainerSleep.sleep, TrainerSleep.wake

    def slow_sleep(self, keep_params=False):
        stats = sleep(self, keep_params)
        if keep_params:
            _time.sleep(0.4)
            stats.seconds += 0.4
        return stats

    def slow_wake(self, defer_state=False):
        stats = wake(self, defer_state)
        _time.sleep(0.4)
        stats.seconds += 0.4
        return stats

    monkeypatch.setattr(TrainerSleep, "sleep", slow_sleep)
    monkeypatch.setattr(TrainerSleep, "wake", slow_wake)
    assert main([*JOB, "--qrl-trainer-sleep", "on", "--qrl-output-dir", str(tmp_path)]) == 0
    rl = [r for r in read_records(tmp_path) if r["phase"] == "rl"]
    assert rl
    for r in rl:
        parts = sum(r[k] for k in ("time_rollout_s", "time_recompute_s", "time_train_s",
                                   "time_sync_s", "time_sleep_s", "time_wake_s"))
        assert r["time_sleep_s"] >= 0.4 and r["time_wake_s"] >= 0.4
        assert abs(parts - r["time_step_s"]) < 0.15, r  # a double count would be >= 0.4
        assert r["time_train_s"] < r["time_step_s"] - 0.8


def test_driver_order_engine_never_beside_the_whole_trainer(tmp_path, monkeypatch):
    """The engine starts beside a sleeping trainer and releases; the optimizer state sleeps
    before each engine resume + weight sync and stays asleep through the rollout (the weights
    stay: the engine's memory was resumed beside them), and the wake comes after the engine's
    release."""
    from megatron_qrl.models.runtime import single_process_megatron
    from megatron_qrl.rl.driver import run_job

    calls: list[str] = []
    sleep, wake = TrainerSleep.sleep, TrainerSleep.wake

    def logged_sleep(self, keep_params=False):
        calls.append("sleep-state" if keep_params else "sleep")
        return sleep(self, keep_params)

    def logged_wake(self, defer_state=False):
        calls.append("wake")
        return wake(self, defer_state)

    monkeypatch.setattr(TrainerSleep, "sleep", logged_sleep)
    monkeypatch.setattr(TrainerSleep, "wake", logged_wake)

    class Engine(RecordingEngine):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.calls = calls

    configs, flags, _ = parse_configs([*JOB[:-3], "--qrl-steps", "2", "--qrl-save-interval",
                                       "-1", "--qrl-trainer-sleep", "on", "--qrl-output-dir",
                                       str(tmp_path)])
    configs["rollout"].engine = "sglang"  # parsed as reference here (no GPU), run as SGLang
    with single_process_megatron():
        run_job(configs, flags, progress=False, log=lambda _m: None,
                engine_factory=lambda ro, hf, seed: Engine(hf, ro.format, seed))
    step = ["sleep-state", "generate", "release", "wake", "sleep-state", "resume"]
    assert calls == ["sleep", "release", "wake",  # the engine's start
                     "sleep-state", "resume", "update1", *step, "update2", *step, "update3",
                     "wake"]


def test_refused_combinations_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main([*JOB, "--qrl-trainer-sleep", "on", "--qrl-mode", "disaggregated"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--qrl-trainer-sleep on with --qrl-mode disaggregated" in err[-1]
    assert "Traceback" not in "\n".join(err)
    # an SGLang engine needs a GPU to parse: the job rule on the built configs
    configs = parse_configs([*JOB, "--qrl-trainer-sleep", "on"])[0]
    configs.rollout.engine = "sglang"
    assert configs.job.problem(configs) is None
    configs.rollout.sglang = configs.rollout.sglang.replace(release_memory=False)
    assert "--no-qrl-rollout-sglang-release-memory" in configs.job.problem(configs)
    configs.run.trainer_sleep = "auto"
    assert configs.job.problem(configs) is None


def test_auto_is_off_without_an_sglang_engine_on_a_gpu():
    from megatron_qrl.rl.trainer_sleep import sleep_line, trainer_sleep_on

    configs = parse_configs(JOB)[0]
    assert configs.run.trainer_sleep == "auto"
    assert not trainer_sleep_on(configs)  # the reference engine
    configs.rollout.engine = "sglang"
    assert trainer_sleep_on(configs) == torch.cuda.is_available()
    configs.run.trainer_sleep = "on"
    assert trainer_sleep_on(configs)
    assert "trainer sleep on" in sleep_line(True, configs)
    assert "mem fraction 0.5" in sleep_line(True, configs)
