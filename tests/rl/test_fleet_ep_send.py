"""Trainer EP = 2 sends its experts rank by rank into the fleet's weight groups (gloo, CPU).

Five processes: trainer ranks 0 and 1 (megatron-core on CPU, expert parallel 2, the tiny
Qwen3-MoE loaded from an HF checkpoint) and three engine ranks — engine 0 of one TP rank,
engine 1 of two — in two weight groups (one per sender, each 1 + 3 ranks). Every engine rank
must receive exactly the full model's packed (int8) state, each tensor once; trainer rank 0
must neither send nor gather rank 1's experts (its sent names and bytes, and the bytes of
every all_gather it joins, are measured), and no rank all-gathers over the EP group.
"""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.quant import get_spec
from tests.helpers.mp_utils import free_port, run_distributed
from tests.helpers.tiny_hf import make_tiny_hf

SPEC = "int8"
ENGINE_TP = (1, 2)
BUCKET = 4096


def _groups(rank: int, ports: list[int]):
    """This process's weight groups: trainer rank s joins group s as its rank 0; engine TP
    rank r of engine i joins every group at ``plan.offset(i) + r``."""
    from megatron_qrl.rollout.broadcast import init_group
    from megatron_qrl.rollout.weight_groups import weight_group_plan

    plan = weight_group_plan(ENGINE_TP, senders=2)
    engine_ranks = [r for i in range(len(ENGINE_TP)) for r in plan.ranks(i)]
    joins = {s: 0 for s in range(2) if s == rank} if rank < 2 else {
        s: engine_ranks[rank - 2] for s in range(2)}
    return plan, {s: init_group("127.0.0.1", ports[s], plan.group_world_size, r,
                                plan.group_name("qrl-ep-test", s), "gloo", 120)
                  for s, r in joins.items()}


def _trainer(rank: int, hf_dir: str, mport: int, groups: dict, gather_experts: bool) -> dict:
    import torch.distributed as dist

    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.hf_config import load_hf_config
    from megatron_qrl.models.hf_io import HFCheckpointReader
    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.streaming import (
        groups_from_parallel_state,
        iter_hf_tensors,
        load_hf_weights,
    )
    from megatron_qrl.rl.ep_send import ep_sender, sharded_hf_stream
    from megatron_qrl.rollout.broadcast import send_stream
    from megatron_qrl.rollout.transports.sharded import send_segments

    init_cpu_distributed(rank, 2, mport, tp=1, ep=2, etp=1)
    gathered = []
    real_gather = dist.all_gather

    def counting_gather(parts, t, group=None, **kw):
        gathered.append((dist.get_process_group_ranks(group), sum(p.numel() * p.element_size()
                                                                   for p in parts)))
        return real_gather(parts, t, group=group, **kw)

    try:
        _, arch = load_hf_config(hf_dir)
        with cpu_device_mode():
            shard = groups_from_parallel_state()
            model = build_model(arch, ParallelLayout(tp=1, ep=2))
            load_hf_weights(model, arch, HFCheckpointReader(hf_dir).get, shard)
            sender = ep_sender(shard)
            dist.all_gather = counting_gather
            try:
                stream = (sharded_hf_stream(model, arch, shard, sender) if not gather_experts
                          else iter_hf_tensors(model, arch, shard))  # the old path
                sent = []
                packed = ((n, t) for n, t in get_spec(SPEC).pack_state_dict(stream)
                          if not sent.append((n, t.numel() * t.element_size())))
                if not gather_experts:
                    send_segments(packed, groups[sender.index], "cpu", BUCKET)
                elif rank == 0:  # the old path: rank 0 sends everything in one stream
                    send_stream(packed, groups[0], "cpu", BUCKET)
                else:
                    for _ in packed:
                        pass
            finally:
                dist.all_gather = real_gather
        return {"sender": (sender.index, sender.senders, sender.main), "sent": sent,
                "gathered": gathered, "n_local": arch.num_experts // 2}
    finally:
        destroy_cpu_distributed()


def _body(rank, world_size, port, hf_dir, ports, gather_experts):
    from megatron_qrl.rollout.broadcast import receive_stream
    from megatron_qrl.rollout.weight_groups import receive_sharded

    plan, groups = _groups(rank, ports)
    assert plan.total_ranks == world_size == 5
    if rank < 2:
        return _trainer(rank, hf_dir, port, groups, gather_experts)
    stream = (receive_stream(groups[0], "cpu") if gather_experts
              else receive_sharded([groups[0], groups[1]], "cpu"))
    return {"received": [(n, t.clone()) for n, t in stream]}


def _run(tmp_path, gather_experts=False):
    hf_dir = make_tiny_hf(tmp_path / "hf", "moe")
    ports = [free_port(), free_port()]
    return hf_dir, run_distributed(_body, 5, str(hf_dir), ports, gather_experts,
                                   timeout_s=600)


def _expected(hf_dir) -> dict[str, torch.Tensor]:
    from megatron_qrl.models.hf_io import HFCheckpointReader

    reader = HFCheckpointReader(hf_dir)
    return dict(get_spec(SPEC).pack_state_dict((n, reader.get(n)) for n in reader.names()))


def _expert_index(name: str) -> int | None:
    from megatron_qrl.quant.hf_names import parse

    p = parse(name)
    return None if p is None else p.expert


def _assert_layers_whole(names: list[str]) -> None:
    """Each decoder layer's expert tensors arrive together, each kind's experts in
    ascending order (what an in-place reload and the expert stacking need)."""
    from megatron_qrl.quant.hf_names import layer_prefix, parse
    from megatron_qrl.rollout.weight_groups import segment_key

    keys = [segment_key(n) for n in names]
    runs = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
    assert len(runs) == len(set(runs)) and runs[0] == "", runs
    kinds: dict[tuple, list[int]] = {}
    for n in names:
        p = parse(n)
        if p is not None and p.expert is not None:
            kinds.setdefault((layer_prefix(n), p.proj, p.leaf), []).append(p.expert)
    assert kinds and all(v == sorted(v) for v in kinds.values()), kinds


def test_ep_ranks_send_their_own_experts_to_every_engine_rank(tmp_path):
    hf_dir, results = _run(tmp_path)
    expect = _expected(hf_dir)
    for r in (2, 3, 4):  # every TP rank of every engine: the full state, each tensor once
        got = results[r]["received"]
        names = [n for n, _ in got]
        assert len(names) == len(set(names)) and set(names) == set(expect), r
        for n, t in got:
            assert t.dtype == expect[n].dtype and torch.equal(t, expect[n]), (r, n)
        _assert_layers_whole(names)
    t0, t1 = results[0], results[1]
    n_local = t0["n_local"]
    assert t0["sender"] == (0, 2, True) and t1["sender"] == (1, 2, False)
    experts0 = {_expert_index(n) for n, _ in t0["sent"]} - {None}
    experts1 = {_expert_index(n) for n, _ in t1["sent"]} - {None}
    assert experts0 == set(range(n_local)) and experts1 == set(range(n_local, 2 * n_local))
    assert all(_expert_index(n) is not None for n, _ in t1["sent"])  # rank 1: experts only
    # rank 0 sent the non-expert tensors and its own experts: total minus rank 1's bytes
    total = sum(t.numel() * t.element_size() for t in expect.values())
    sent0, sent1 = (sum(b for _, b in t["sent"]) for t in (t0, t1))
    assert sent0 + sent1 == total and 0 < sent1 < total
    # and gathered nothing: no all_gather over the EP group (TP = ETP = 1: none at all)
    assert t0["gathered"] == [] and t1["gathered"] == []
    print(f"\nEP=2 sharded sync: rank 0 sent {sent0} B, rank 1 {sent1} B of {total} B; "
          "rank 0 all-gathered 0 B")


def test_the_gathering_path_puts_every_expert_on_rank_0(tmp_path):
    """What the sharded send avoids (and what the test above would see if the experts were
    still gathered): rank 0 all-gathers rank 1's experts over EP and sends every expert."""
    hf_dir, results = _run(tmp_path, gather_experts=True)
    expect = _expected(hf_dir)
    t0 = results[0]
    assert {_expert_index(n) for n, _ in t0["sent"]} - {None} == set(range(2 * t0["n_local"]))
    assert sum(b for _, b in t0["sent"]) == sum(t.numel() * t.element_size()
                                                for t in expect.values())
    assert t0["gathered"] and all(ranks == [0, 1] for ranks, _ in t0["gathered"])
    for r in (2, 3, 4):
        assert {n for n, _ in results[r]["received"]} == set(expect)


@pytest.mark.parametrize("main, ranks0, etp_rank, expect", [
    (True, [0, 2], 0, (0, 2, True)),
    (False, [0, 2], 0, (1, 2, False)),   # EP rank 1 of rank 0's EP group
    (False, [1, 3], 0, (None, 2, False)),  # another expert data-parallel replica
    (False, [0, 2], 1, (None, 2, False)),  # expert-TP rank 1: its ETP rank 0 sends
])
def test_who_sends(monkeypatch, main, ranks0, etp_rank, expect):
    import torch.distributed as dist

    from megatron_qrl.models.streaming import ShardGroups
    from megatron_qrl.rl import ep_send

    ep, etp = object(), object()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: {None: 0 if main else 2, ep: 1,
                                                              etp: etp_rank}[group])
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: ranks0)
    got = ep_send.ep_sender(ShardGroups(ep=ep, etp=etp))
    assert (got.index, got.senders, got.main) == expect
