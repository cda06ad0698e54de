"""qrl-train under torchrun, trainer EP = 2 (gloo), a fleet of 2 reference engines in Ray actors.

Every EP rank sends its own experts to the engines (``megatron_qrl.rl.ep_sync``): the run
must equal the same job on the gathering sync (``--gather-experts`` in the test helper)
record for record (batches, rewards, losses, grad norms; engine fingerprints are verified
against the combined manifests in every sync), rank 0 must all-gather 0 bytes over the EP
group in its weight streams (the gathering path: every expert of rank 1), and rank 1 must
send its experts itself. An engine killed before the 2nd rollout is restarted and re-synced
from both senders (new groups for the new membership), and the run is still the same. The jobs
are tests/helpers/ep2_runs.py's, shared with test_rl_ep_sync_death.py (``ep2_ray_runs``).
"""

import pytest


@pytest.mark.slow
def test_ep2_ranks_send_their_own_experts_and_match_the_gathering_sync(ep2_ray_runs):
    res = ep2_ray_runs("gather", "sharded")
    (gathered, glog, _), (sharded, slog, raw) = res["gather"], res["sharded"]
    assert [r["phase"] for r in gathered] == ["rl", "rl"]
    assert sharded == gathered  # same batches, rewards, losses, grad norms, bit for bit
    # the gathering sync pulls rank 1's experts onto rank 0; the sharded one pulls nothing
    assert glog[0]["ep_gather_bytes"] > 0 and glog[0]["sharded_sends"] == 0
    assert slog[0]["ep_gather_bytes"] == 0 and slog[1]["ep_gather_bytes"] == 0
    # rank 1 sent its own experts: the initial sync, the re-sync of the restarted engine,
    # and the syncs after the 2 steps (rank 0's sends go through the fleet's groups)
    assert slog[1]["sharded_sends"] == 4
    assert sum(v for k, v in raw[-1].items() if k.endswith("_restarts")) == 1
    print(f"\nEP=2 qrl-train: rank 0 all-gathered {glog[0]['ep_gather_bytes']} B of experts "
          f"over EP (gathering sync) vs {slog[0]['ep_gather_bytes']} B (sharded)")


@pytest.mark.parametrize("ep, lora, shardable, expect", [
    (2, False, True, True),
    (1, False, True, False),    # no expert parallelism: nothing to shard
    (2, True, True, False),     # LoRA sends the base once, then adapters (its own path)
    (2, False, False, False),   # SGLang engines in the actors: the gathering sync
    (None, False, True, False),  # one process
])
def test_the_one_rule(monkeypatch, ep, lora, shardable, expect):
    import torch.distributed as dist

    from megatron_qrl.models.streaming import ShardGroups
    from megatron_qrl.rl.ep_sync import sharded_sync_applies
    from megatron_qrl.rollout.transports.fleet import FleetBroadcast

    group = object()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: ep)

    class Fleet:
        broadcast = FleetBroadcast(shardable=shardable)

    groups = ShardGroups(ep=group) if ep is not None else None
    assert sharded_sync_applies(Fleet(), groups, lora) is expect
    assert sharded_sync_applies(object(), groups, lora) is False  # one engine actor / objectstore
