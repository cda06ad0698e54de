"""The trainer-side sync a weight version takes is chosen in one place
(megatron_qrl.rl.sync_plan.SyncPlan): a LoRA run whose base is frozen syncs adapters, a
sharded sync sends each EP rank's experts, anything else gathers to rank 0; AQN's step is
the version's RL step. The syncs themselves run end to end in tests/rl/test_rl_driver.py,
test_lora_driver.py and test_rl_ep_sync.py."""

from __future__ import annotations

from megatron_qrl.models.lora import LoraState
from megatron_qrl.models.lora_config import LoraConfig
from megatron_qrl.quant import get_spec
from megatron_qrl.rl.ep_sync import ShardedSync
from megatron_qrl.rl.lora_sync import LoraSync
from megatron_qrl.rl.sync_plan import SYNC_STRATEGIES, SyncPlan


def _plan(lora: bool, sharded: bool, active: bool) -> SyncPlan:
    spec = get_spec("int8")
    state = LoraState(LoraConfig(rank=4)) if lora else None
    if state is not None:
        state.active = active
    return SyncPlan(None, None, spec, None, 0, sft_steps=3, steps=5,
                    lora=LoraSync(LoraConfig(rank=4)) if lora else None, lora_plan=state,
                    sharded=ShardedSync(None, spec, None, 0) if sharded else None)


def test_one_rule_picks_the_sync():
    picks = {(lora, sharded, active): _plan(lora, sharded, active).strategy()
             for lora in (False, True) for sharded in (False, True) for active in (False, True)}
    assert set(picks.values()) == set(SYNC_STRATEGIES)
    for (lora, sharded, active), how in picks.items():
        assert how == ("lora" if lora and active else "sharded" if sharded else "gathered")


def test_aqn_step_is_the_versions_rl_step():
    plan = _plan(False, False, False)
    assert [plan.aqn_at(v)["aqn_step"] for v in (0, 3, 4, 7, 9)] == [0, 0, 1, 4, 4]
    assert plan.aqn_at(5)["total_steps"] == 5


def test_a_restarted_engine_gets_the_lora_base_again():
    plan = _plan(True, False, True)
    plan.lora.base_sent = True
    plan.engine_restarted()
    assert plan.lora.base_sent is False


def test_an_engine_writing_into_itself_gets_the_parameters_as_views(monkeypatch):
    """The gathered sync streams views of the trainer's parameters (no copy per sync) only to
    an engine that quantizes into its own memory and checks its own update (it reads each
    tensor during the sync and keeps none); any other engine gets copies. Mutation caught:
    views for every engine (the reference engine would then hold the live parameters)."""
    from megatron_qrl.rl import sync_plan

    asked = []

    class Trainer:
        def hf_tensors(self, views=False, persistent=False):
            asked.append((views, persistent))
            return iter(())

    class Engine:
        def __init__(self, into, own, holds=False):
            self.quantizes_into, self.verifies_own_update = into, own
            self.holds_stream_tensors = holds

    monkeypatch.setattr(sync_plan, "sync_weights", lambda *a, **k: None)
    for engine in (Engine(False, False), Engine(False, True), Engine(True, True),
                   Engine(True, True, holds=True), Engine(False, False, holds=True)):
        SyncPlan(Trainer(), engine, get_spec("fp8"), None, 0, sft_steps=0, steps=1).send(1)
    # persistent q / k / v buffers only for an engine that holds the stream's tensors
    # (mutation caught: buffers for every engine given views: memory for nothing)
    assert asked == [(False, False), (False, False), (True, False), (True, True),
                     (False, False)]


def test_a_sleeping_trainer_keeps_no_tensor_held_by_the_engine():
    """The trainer's weights leave the GPU during a sleep, and memory shared by CUDA IPC stays
    allocated while the importer holds it: an SGLang engine beside a sleeping trainer opens
    the trainer's tensors anew each sync (the run log says so); without the sleep, or for
    another engine, the rollout config is the one given. Mutation caught: the config passed
    through unchanged for a sleeping trainer."""
    from megatron_qrl.config.run import RolloutConfig
    from megatron_qrl.rl.driver import engine_rollout_config

    ro = RolloutConfig(format="fp8", engine="sglang")
    assert ro.sglang.hold_trainer_tensors
    asleep = engine_rollout_config(ro, trainer_sleeps=True)
    assert not asleep.sglang.hold_trainer_tensors and ro.sglang.hold_trainer_tensors
    assert asleep.format == ro.format and asleep.sglang.sync == ro.sglang.sync
    assert engine_rollout_config(ro, trainer_sleeps=False) is ro
    ref = RolloutConfig(format="fp8")
    assert engine_rollout_config(ref, trainer_sleeps=True) is ref
    line = asleep.sglang.__class__(sync="direct", hold_trainer_tensors=False).resolve(
        "fp8").describe_sync()
    assert "every handle opened anew each sync" in line
