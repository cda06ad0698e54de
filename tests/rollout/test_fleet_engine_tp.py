"""Fleet engines of engine TP / EP > 1, checked on the CPU (the runs need several GPUs).

Layouts a model cannot take are one clear error naming the flag (SGLang 0.5.17's start-up
assertions, raised up front); possible ones become the SGLang engine arguments of every
actor (``tp_size`` / ``ep_size`` / DP attention) and bundles of ``tp`` GPUs; the weight
groups span the senders and every engine TP rank; a one-GPU machine says that engine TP 2
needs a multi-GPU node.
"""

import pytest

from megatron_qrl.config import QrlArgumentError
from megatron_qrl.rollout.fleet_layout import engine_parallel, fleet_layout
from megatron_qrl.rollout.ray_actor import EngineSpec
from megatron_qrl.rollout.weight_groups import weight_group_plan

QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 32,
                 "num_key_value_heads": 4, "num_experts": 128, "moe_intermediate_size": 768,
                 "intermediate_size": 6144, "hidden_size": 2048}
DENSE = {"architectures": ["Qwen3ForCausalLM"], "num_attention_heads": 6,
         "num_key_value_heads": 3, "intermediate_size": 96}


@pytest.mark.parametrize("cfg, kw, match", [
    (DENSE, dict(tp=4), "6 attention heads do not split over 4 ranks"),
    (DENSE, dict(tp=2), "3 KV heads neither split over nor replicate evenly on 2"),
    (DENSE | {"num_attention_heads": 24, "num_key_value_heads": 4}, dict(tp=6),
     "4 KV heads neither split over nor replicate evenly on 6"),
    (QWEN3_30B_A3B, dict(tp=8, ep=3), "must divide --qrl-rollout-engine-tp 8"),
    (QWEN3_30B_A3B | {"num_experts": 60}, dict(tp=8, ep=8), "60 experts do not split.*8"),
    (QWEN3_30B_A3B | {"moe_intermediate_size": 102}, dict(tp=8, ep=2),
     "FFN width 102 does not split over tp/ep = 4"),
    (QWEN3_30B_A3B | {"num_attention_heads": 12}, dict(tp=8),
     "12 attention heads.*--qrl-rollout-engine-dp-attention"),
    (DENSE, dict(tp=3, ep=3), "--qrl-rollout-engine-ep 3: the model has no experts"),
    (DENSE, dict(tp=3, dp_attention=True), "DP attention is for MoE"),
    (QWEN3_30B_A3B, dict(tp=1, dp_attention=True), "--qrl-rollout-engine-tp > 1"),
    (DENSE | {"intermediate_size": 100}, dict(tp=3), "FFN width 100 does not split over 3"),
])
def test_impossible_engine_splits_are_one_clear_error(cfg, kw, match):
    with pytest.raises(ValueError, match=match):
        engine_parallel(cfg, **kw)


def test_engine_splits_become_sglang_arguments():
    p = engine_parallel(QWEN3_30B_A3B, 8, 8)
    assert p.sglang_args() == {"tp_size": 8, "ep_size": 8} and p.moe_tp == 1
    p = engine_parallel(QWEN3_30B_A3B, 4, 2)  # 4 KV heads over 4 ranks, experts TP 2 x EP 2
    assert (p.attn_tp, p.moe_tp) == (4, 2)
    # 8 ranks replicate the 4 KV heads; DP attention puts attention on one rank each
    assert engine_parallel(QWEN3_30B_A3B, 8).sglang_args() == {"tp_size": 8, "ep_size": 1}
    p = engine_parallel(QWEN3_30B_A3B | {"num_attention_heads": 12}, 8, 8, dp_attention=True)
    assert p.attn_tp == 1 and p.sglang_args() == {"tp_size": 8, "ep_size": 8,
                                                  "enable_dp_attention": True, "dp_size": 8}
    assert engine_parallel(DENSE, 3).sglang_args() == {"tp_size": 3, "ep_size": 1}


def test_fleet_engine_spec_gives_every_actor_its_split():
    from megatron_qrl.config.run import RolloutConfig
    from megatron_qrl.rl.ray_fleet import fleet_engine_spec

    cfg = RolloutConfig(engine="sglang", num_engines=2, engine_tp=4, engine_ep=2,
                        n_samples_per_prompt=2)
    layout = fleet_layout(2, 4, 2, "sglang", cluster_gpus=16, trainer_gpus=8,
                          gpus_per_node=8)
    assert layout.bundles == ({"CPU": 1.0, "GPU": 4.0},) * 2
    spec = fleet_engine_spec(layout, cfg, QWEN3_30B_A3B, seed=3)
    assert spec.sglang_kwargs == {"tp_size": 4, "ep_size": 2} and spec.num_gpus == 4
    colocated = fleet_layout(2, 4, 2, "sglang", "colocated", trainer_gpus=8)
    assert colocated.bundles == ({"CPU": 1.0, "GPU": 4.0},) * 2  # tiles the trainer's 8
    with pytest.raises(ValueError, match="experts do not split"):
        fleet_engine_spec(layout, cfg, QWEN3_30B_A3B | {"num_experts": 7}, seed=3)
    ref = RolloutConfig(num_engines=2, n_samples_per_prompt=2)
    assert fleet_engine_spec(fleet_layout(2), ref, QWEN3_30B_A3B, 0).sglang_kwargs == {}
    with pytest.raises(ValueError, match="1 for the reference engine"):
        EngineSpec("reference", {}, "bf16", sglang_kwargs={"tp_size": 2})
    with pytest.raises(ValueError, match="needs --qrl-rollout-engine-tp > 1"):
        RolloutConfig(engine="sglang", engine_dp_attention=True)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_one_gpu_machine_says_engine_tp_2_needs_more_gpus(mode):
    """The H200 of this project has one GPU: engine TP 2 is refused before Ray places
    anything, saying why (multi-GPU runs: bench/README.md)."""
    from megatron_qrl.config.run import RolloutConfig
    from megatron_qrl.rl.ray_fleet import session_layout

    with pytest.raises(ValueError, match="engine TP > 1 needs a multi-GPU node"):
        fleet_layout(1, 2, 1, "sglang", mode, cluster_gpus=1, trainer_gpus=1,
                     gpus_per_node=1)
    cfg = RolloutConfig(engine="sglang", engine_tp=2, n_samples_per_prompt=2)
    with pytest.raises(ValueError, match="--qrl-rollout-engine-tp 2: .* multi-GPU node"):
        session_layout(mode, cfg, cluster_gpus=1, gpus_per_node=1)  # what FleetSession asks


def test_single_mode_refuses_engine_tp(monkeypatch):
    import megatron_qrl.rl.cli as cli
    from megatron_qrl.rl.cli import parse_configs

    real = cli.validate_qrl_args  # as on a Hopper GPU (the SGLang engine needs one)
    monkeypatch.setattr(cli, "validate_qrl_args", lambda a: real(a, gpu_capability=(9, 0)))
    with pytest.raises(QrlArgumentError, match="--qrl-rollout-engine-tp 2.*--qrl-mode colocated"):
        parse_configs(["--qrl-preset", "tiny-cpu", "--qrl-rollout-engine", "sglang",
                       "--qrl-rollout-engine-tp", "2"])


def test_weight_groups_span_the_senders_and_every_engine_tp_rank():
    plan = weight_group_plan([1, 2, 4], senders=2)
    assert plan.group_world_size == 1 + 7 and plan.total_ranks == 2 + 7
    assert [plan.offset(i) for i in range(3)] == [1, 2, 4]
    assert [list(plan.ranks(i)) for i in range(3)] == [[1], [2, 3], [4, 5, 6, 7]]
    assert plan.group_name("g", 1) == "g-s1" and weight_group_plan([2]).group_name("g", 0) == "g"
    for bad in (([], 1), ([0], 1), ([2], 0)):
        with pytest.raises(ValueError, match="weight groups"):
            weight_group_plan(*bad)


def test_sharded_streams_send_non_experts_first_and_each_layer_whole(monkeypatch):
    """A sender's stream must be the non-expert tensors, then each layer's experts together
    (the receivers take turns between the senders per layer); anything else is refused
    before the engines could see a layer split."""
    import torch

    import megatron_qrl.rollout.broadcast as bc
    from megatron_qrl.rollout import weight_groups as wg
    from megatron_qrl.rollout.transports.sharded import send_segments

    heads = []
    monkeypatch.setattr(bc, "broadcast_from_trainer", lambda t, g: heads.append(t.tolist()))
    monkeypatch.setattr(wg, "broadcast_from_trainer", lambda t, g: heads.append(t.tolist()))
    e = "model.layers.{}.mlp.experts.{}.down_proj.weight"
    one = torch.zeros(2)
    assert send_segments([(e.format(0, 2), one), (e.format(1, 2), one)], None, "cpu", 64) == 2
    ends = [h for h in heads if h in ([0, 0], [0, 1])]
    assert ends == [[0, 0]] * 3 + [[0, 1]]  # an empty non-expert segment, 2 layers, the end
    for bad in ([("model.norm.weight", one), (e.format(0, 2), one), ("lm_head.weight", one)],
                [(e.format(0, 2), one), (e.format(1, 2), one), (e.format(0, 3), one)]):
        with pytest.raises(ValueError, match="comes back after the stream moved on"):
            send_segments(bad, None, "cpu", 64)


def test_flags_are_checked_against_a_known_model():
    """With the model's config known (--qrl-checkpoint), an impossible engine split is one of
    the flag errors at parse time, before any trainer or Ray work."""
    import argparse

    from megatron_qrl.config import add_qrl_args, validate_qrl_args

    parser = argparse.ArgumentParser()
    add_qrl_args(parser)
    args = parser.parse_args(["--qrl-rollout-engine", "sglang", "--qrl-rollout-engine-tp", "8",
                              "--qrl-rollout-engine-ep", "8"])
    hopper = (9, 0)
    with pytest.raises(QrlArgumentError, match="60 experts do not split"):
        validate_qrl_args(args, gpu_capability=hopper,
                          model_config=QWEN3_30B_A3B | {"num_experts": 60})
    configs = validate_qrl_args(args, gpu_capability=hopper, model_config=QWEN3_30B_A3B)
    assert (configs["rollout"].engine_tp, configs["rollout"].engine_ep) == (8, 8)
