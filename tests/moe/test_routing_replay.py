"""Routing replay: the trainer routes to the rollout's experts, gates stay its own; EP=2 == EP=1."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.mp_utils import run_distributed
from tests.helpers.te_quant_fixtures import build, hf_state, ids, quiet_torch_trace, tiny_hf


def test_routing_agreement_closed_form():
    from megatron_qrl.moe import routing_agreement, tokens_from_batch

    trainer = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # [tokens=2, layers=2, k=2]
    rollout = torch.tensor([[[1, 0], [2, 5]], [[6, 7], [7, 6]]])
    # layer 0: token0 2/2, token1 0/2 -> 0.5; layer 1: token0 1/2, token1 2/2 -> 0.75
    assert torch.allclose(routing_agreement(trainer, rollout), torch.tensor([0.5, 0.75]))
    b = torch.arange(2 * 3 * 1 * 1).reshape(2, 3, 1, 1)  # [batch, seq, L, k]
    assert tokens_from_batch(b)[:, 0, 0].tolist() == [0, 3, 1, 4, 2, 5]  # token = s * batch + b


def _forced(own: torch.Tensor, num_experts: int) -> torch.Tensor:
    """For every token/layer the top_k experts with the LOWEST ids not chosen by the router."""
    k = own.shape[-1]
    taken = torch.zeros(*own.shape[:-1], num_experts, dtype=torch.bool).scatter(-1, own, True)
    order = torch.where(taken, num_experts, torch.arange(num_experts))
    return order.sort(-1).values[..., :k]


def _router_io(model):
    seen = {}
    for i, layer in enumerate(model.decoder.layers):
        layer.mlp.router.register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(i, (args[0], out)))
    return seen


def _replay_model(mode: str, **overrides):
    from megatron_qrl.moe import RoutingReplay, replay_spec_hook

    hf, arch = tiny_hf("moe")
    replay = RoutingReplay(mode, arch.num_experts, arch.moe_top_k)
    return arch, replay, build(arch, hf_state(hf), replay_spec_hook(replay), **overrides)


def test_replay_forces_recorded_experts_and_gates_flow():
    from megatron_qrl.models.runtime import single_process_megatron
    from megatron_qrl.moe import recorded_ids, routing_agreement

    with quiet_torch_trace(), single_process_megatron():
        arch, replay, model = _replay_model("recompute", moe_aux_loss_coeff=0.0)
        seen = _router_io(model)
        x = ids()
        pos = torch.arange(x.shape[1])[None].expand_as(x)
        model.train()
        own_logits = model(x, pos, attention_mask=None).detach()
        own = recorded_ids(replay, arch.num_layers)
        forced = _forced(own, arch.num_experts)
        with replay.use(forced, phase="recompute"):
            out = model(x, pos, attention_mask=None)
            out.float().pow(2).mean().backward()
        for i, (hidden, (probs, routing_map)) in seen.items():
            chosen = routing_map.nonzero()[:, 1].reshape(-1, arch.moe_top_k)
            assert torch.equal(chosen, forced[:, i].sort(-1).values)
            logits = hidden.reshape(-1, arch.hidden_size).float() @ \
                model.decoder.layers[i].mlp.router.weight.float().t()
            gates = torch.softmax(logits.gather(1, forced[:, i]), -1)  # norm_topk_prob
            assert torch.allclose(probs.gather(1, forced[:, i]), gates, atol=1e-6)
        # the router's own choice is still recorded (layer 0 sees the same input as before, so
        # it chooses as before and never agrees with the forced experts; layer 1 input changed)
        assert torch.equal(recorded_ids(replay, arch.num_layers)[:, 0], own[:, 0])
        assert routing_agreement(recorded_ids(replay, arch.num_layers), forced)[0] == 0
        assert all(layer.mlp.router.weight.grad.abs().max() > 0 for layer in model.decoder.layers)
        assert (out.detach() - own_logits).abs().max() > 1e-2
        with replay.use(forced, phase="update"):  # mode=recompute: the update routes freely
            model(x, pos, attention_mask=None)
        assert torch.equal(seen[0][1][1].nonzero()[:, 1].reshape(-1, 2), own[:, 0].sort(-1).values)
        replay.mode = "all"
        with replay.use(None, phase="update"):
            replay.set_micro_batch(forced)  # as forward_step_func does per micro-batch
            model(x, pos, attention_mask=None)
        assert torch.equal(seen[0][1][1].nonzero()[:, 1].reshape(-1, 2), forced[:, 0].sort(-1).values)
        assert replay.expert_ids is None  # restored on exit
        with pytest.raises(ValueError, match="top_k=2"), replay.use(forced[..., :1], "recompute"):
            pass
        bad = copy.copy(model.decoder.layers[0].mlp.router.config)
        bad.moe_expert_capacity_factor = 1.0
        from megatron_qrl.moe import check_replay_config
        with pytest.raises(ValueError, match="token dropping off"):
            check_replay_config(bad)


def _ep_worker(rank, world_size, port, tensors, forced, x):
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.moe import RoutingReplay, recorded_ids, replay_spec_hook
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook, compose_hooks
    from megatron_qrl.te_quant.attribution import megatron_logits
    from tests.helpers.te_quant_fixtures import tiny_cfg

    init_cpu_distributed(rank, world_size, port, ep=world_size, etp=1)
    try:
        with quiet_torch_trace(), cpu_device_mode():
            arch = arch_from_dict(tiny_cfg("moe"))
            replay = RoutingReplay("all", arch.num_experts, arch.moe_top_k)
            hook = compose_hooks(aligned_spec_hook(AlignedForwardState("int8")),
                                 replay_spec_hook(replay))
            model = build(arch, tensors, hook, layout=ParallelLayout(ep=world_size))
            with replay.use(forced, phase="update"):
                logits = megatron_logits(model.eval(), x)
            return logits, recorded_ids(replay, arch.num_layers)
    finally:
        destroy_cpu_distributed()


@pytest.mark.slow
def test_ep2_replay_equals_ep1():
    hf, arch = tiny_hf("moe")
    tensors = hf_state(hf)
    x = ids()
    tokens = x.numel()
    gen = torch.Generator().manual_seed(5)
    forced = torch.stack([torch.randperm(arch.num_experts, generator=gen)[:arch.moe_top_k]
                          for _ in range(tokens * arch.num_layers)]).reshape(tokens, arch.num_layers, -1)
    ep1 = run_distributed(_ep_worker, 1, tensors, forced, x)[0]
    ep2 = run_distributed(_ep_worker, 2, tensors, forced, x)
    for logits, own in ep2:
        assert (logits - ep1[0]).abs().max().item() <= 1e-5
        assert torch.equal(own, ep1[1])


def test_replay_router_work_does_not_grow_with_tokens():
    """The replayed top-k is tensor work (one gather of the gates at the recorded ids): the
    router dispatches the same torch ops for 16 tokens as for 512 — no per-token Python."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_qrl.models.runtime import single_process_megatron

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    with quiet_torch_trace(), single_process_megatron():
        arch, replay, model = _replay_model("all", moe_aux_loss_coeff=0.0)
        router = model.decoder.layers[0].mlp.router
        counts = []
        for tokens in (16, 512):
            g = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, 1, arch.hidden_size, generator=g)
            route = torch.rand(tokens, arch.num_layers, arch.num_experts,
                               generator=g).argsort(-1)[..., :arch.moe_top_k]
            with replay.use(route, "update"), Ops() as ops:
                _, routing_map = router(x)
            assert torch.equal(routing_map.nonzero()[:, 1].reshape(tokens, -1),
                               route[:, 0].sort(-1).values)
            counts.append(ops.n)
    assert counts[0] == counts[1], counts


def test_fused_router_replays_unfused_and_runs_fused_otherwise():
    """``moe_router_fusion``: a replaying forward takes the unfused top-k (the fused kernel has
    no replay hook) and equals the unfused router's replay; a forward that does not replay
    runs TE's fused top-k (without TE here: megatron's error names it); the model's shared
    config keeps its setting."""
    import importlib.util

    from megatron_qrl.models.runtime import single_process_megatron

    with quiet_torch_trace(), single_process_megatron():
        x = ids()
        pos = torch.arange(x.shape[1])[None].expand_as(x)
        out = []
        for fused in (True, False):
            arch, replay, model = _replay_model("all", moe_router_fusion=fused)
            route = torch.rand(x.numel(), arch.num_layers, arch.num_experts,
                               generator=torch.Generator().manual_seed(1)
                               ).argsort(-1)[..., :arch.moe_top_k]
            with replay.use(route, "update"), torch.no_grad():
                out.append(model(x, pos, attention_mask=None))
            assert model.config.moe_router_fusion == fused
        assert torch.equal(out[0], out[1])
        if importlib.util.find_spec("transformer_engine") is None:
            arch, replay, model = _replay_model("all", moe_router_fusion=True)
            with pytest.raises(ValueError, match="fused_topk_with_score_function"):
                model(x, pos, attention_mask=None)


def test_replay_ids_are_range_checked_on_the_host_only():
    """Host ids are range-checked where they are set; device ids are not read there (a check
    of their values would wait for the device once per micro batch): the trainer checks a
    batch's ids on the host before its micro batches move (``PolicyTrainer._run``). A meta
    tensor stands in for device ids: reading its values raises."""
    from types import SimpleNamespace as NS

    from megatron_qrl.moe import RoutingReplay
    from megatron_qrl.rl.trainer import PolicyTrainer

    replay = RoutingReplay("all", num_experts=4, top_k=2)
    bad = torch.tensor([[[0, 4]], [[1, 2]]])
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"), replay.use(bad, "update"):
        pass
    with replay.use(torch.empty(2, 1, 2, dtype=torch.long, device="meta"), "update"):
        assert replay.active  # set without reading the values
    trainer = NS(stage=None, pack_multiple=lambda: None,
                 policy=NS(plan=NS(replay=replay, kv=None), config=None))
    mb = {"tokens": torch.zeros(1, 2, dtype=torch.long),
          "routed_experts": torch.tensor([[[[0, 1]], [[-1, -1]]]])}  # -1: never routed
    bad_mb = {**mb, "routed_experts": torch.tensor([[[[0, 1]], [[5, 1]]]])}
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        PolicyTrainer._run(trainer, [mb, bad_mb], loss_fn=None, forward_only=True)


def test_replay_without_recording_runs_no_topk_and_same_bits():
    """``use(..., record=False)`` (the trainer's forwards that measure no routing agreement):
    a replaying router runs no top-k of its own, and the logits and every gradient are the
    same bits as with recording. Mutation caught: the own top-k computed regardless."""
    from megatron_qrl.models.runtime import single_process_megatron
    from megatron_qrl.utils.op_census import OpCensus

    with quiet_torch_trace(), single_process_megatron():
        arch, replay, model = _replay_model("all")
        x = ids()
        pos = torch.arange(x.shape[1])[None].expand_as(x)
        route = torch.rand(x.numel(), arch.num_layers, arch.num_experts,
                           generator=torch.Generator().manual_seed(2)).argsort(-1)[..., :arch.moe_top_k]
        out = {}
        for record in (True, False):
            model.zero_grad()
            census = OpCensus()
            with replay.use(route, "update", record=record), census.phase("step"):
                logits = model(x, pos, attention_mask=None)
                logits.float().square().mean().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            out[record] = (logits.detach(), grads, census.phases["step"].ops["topk"],
                           dict(replay.recorded))
        assert torch.equal(out[True][0], out[False][0])
        assert out[True][1].keys() == out[False][1].keys() and out[True][1]
        for name, g in out[True][1].items():
            assert torch.equal(g, out[False][1][name]), name
        assert out[True][2] >= arch.num_layers and out[False][2] == 0
        assert len(out[True][3]) == arch.num_layers and out[False][3] == {}
        assert replay.record  # restored after the block


def test_forwards_that_neither_replay_nor_measure_routing_leave_the_ids_out(monkeypatch):
    """The engine's expert ids reach the schedule (host check, copy to the device, megatron
    token order) only in the forwards that read them: replaying routers (``all``; ``recompute``
    in the recompute) or a routing-agreement measurement. An RL step's later updates without
    replay carried ``[batch, seq, layers, top_k]`` int64 ids per micro batch that nothing read
    (bench/path_census.py). Mutation caught: the ids kept in every forward."""
    from types import SimpleNamespace as NS

    import megatron.core.pipeline_parallel as pp

    from megatron_qrl.moe import RoutingReplay
    from megatron_qrl.rl.trainer import PolicyTrainer

    seen: list[list[str]] = []

    def schedule(**kw):
        seen.append(sorted(k for mb in kw["data_iterator"] for k in mb))
        return []

    monkeypatch.setattr(pp, "get_forward_backward_func", lambda: schedule)
    mb = {"tokens": torch.zeros(1, 2, dtype=torch.long),
          "routed_experts": torch.tensor([[[[0, 1]], [[5, 1]]]])}  # 5: out of range for 4
    cases = (("off", False, None, False), ("off", True, None, False),
             ("recompute", False, None, False), ("recompute", True, [], True),
             ("all", False, None, True), ("off", False, [], True))
    for mode, forward_only, sink, reads in cases:
        trainer = NS(stage=None, pack_multiple=lambda: None,
                     policy=NS(plan=NS(replay=RoutingReplay(mode, num_experts=4, top_k=2),
                                       kv=None, aligned=None), config=None, ddp=None))
        assert trainer.policy.plan.replay.reads_ids(
            "recompute" if forward_only else "update", sink is not None) == reads
        if reads:  # read, so range-checked on the host
            with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
                PolicyTrainer._run(trainer, [mb], None, forward_only, sink)
            PolicyTrainer._run(trainer, [{**mb, "routed_experts": mb["routed_experts"] % 4}],
                               None, forward_only, sink)
            assert "routed_experts" in seen[-1], (mode, forward_only, sink)
        else:
            PolicyTrainer._run(trainer, [mb], None, forward_only, sink)
            assert seen[-1] == ["tokens"], (mode, forward_only, sink)
    assert "routed_experts" in mb  # the caller's micro batch is left as it was
