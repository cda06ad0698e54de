"""An engine that dies in the MIDDLE of a sharded weight sync.

qrl-train under torchrun, trainer EP = 2 (gloo), a fleet of 2 reference engines in Ray actors:
every EP rank sends its own experts into its own weight group (``megatron_qrl.rl.ep_sync``).
In the sync after the first RL step one engine actor's process exits after the first tensor
it received (``--exit-in-sharded-update 2`` of the test helper): both senders' streams are
cut, the fleet restarts that engine in its bundle and re-syncs the whole fleet from both
senders (groups formed anew). The run must equal the same job without the death, record for
record (batches, rewards, losses, grad norms; every sync's fingerprints verified on every
engine), with one restart, still no expert all-gathered onto rank 0, and rank 1 sending its
experts once more (the re-sync). The job without the death is the gathering-sync job of
test_rl_ep_sync.py (``ep2_ray_runs``, run once per worker), which that module shows equal,
record for record, to the sharded sync.
"""

import pytest


@pytest.mark.slow
def test_an_engine_dying_mid_sharded_sync_is_restarted_and_the_run_unchanged(ep2_ray_runs):
    res = ep2_ray_runs("gather", "died")
    (clean, _, clean_raw), (died, dlog, raw) = res["gather"], res["died"]
    assert [r["phase"] for r in clean] == ["rl", "rl"]
    assert sum(v for k, v in clean_raw[-1].items() if k.endswith("_restarts")) == 0
    assert sum(v for k, v in raw[-1].items() if k.endswith("_restarts")) == 1
    assert died == clean  # same batches, rewards, losses, grad norms, bit for bit
    # the sharded path throughout: no expert gathered, rank 1 sent its experts in the
    # initial sync and the 2 steps' syncs (the first of them cut), and once more in the
    # fleet's re-sync
    assert dlog[0]["ep_gather_bytes"] == dlog[1]["ep_gather_bytes"] == 0
    assert dlog[1]["sharded_sends"] == 3 + 1
