"""Host syncs and op counts of one train micro batch of the MoE trainer (bench/op_census.py).

The census (``megatron_qrl.utils.op_census``) runs the trainer's own path on the CPU and counts
the ops that would make a GPU's host wait. Per path (plain stacked experts, routing replay,
the aligned forward's fake fp8 / fp8_block) our code issues no host sync in a micro batch; the
routing-agreement metric of an RL step's first update and the step's metrics are read once per
``train_step``; the aligned forward's Q(W) refresh (after each optimizer step) is read once, at
the end of the micro batches that ran it, whatever the layer count; the only per-micro-batch
syncs left are megatron-core's own (its all-gather
dispatcher and unfused permute, three per MoE layer); replay and the aligned forward add at
most a fixed number of ops per layer over the plain path. Counts, not times.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.op_census import VARIANTS, census_of, model_config  # noqa: E402

UPSTREAM_PER_LAYER = 3
"""megatron-core 0.16.1, local spec: token_dispatcher.py:295 ``.cpu()``, :304 and
moe_utils.py:369 ``masked_select``."""
EXTRA_OPS_PER_LAYER = {"replay": 2, "aligned-fp8": 76, "aligned-fp8_block": 64}
"""Ops per decoder layer (forward + backward) over the plain path, steady state."""
Q_W_CHECKS_PER_REFRESH = 1
"""The aligned forward's once-per-step Q(W) refresh, whatever the layer count: the finiteness of
every quantized linear's weight, recorded as device bools by the refresh and read in one host
sync (``te_quant.state.AlignedForwardState.check_finite`` at the end of ``PolicyTrainer._run``,
quant/finite_checks.py), not one per linear (quant/spec_core.py: six per layer before)."""


def test_census_tells_device_reads_from_host_reads():
    from megatron_qrl.utils.op_census import OpCensus

    census = OpCensus()
    dev, host = torch.arange(6.0), torch.arange(3)
    census.mark_device([dev])
    with census.phase("p"):
        y = dev * 2
        y.sum().item()                       # 1: _local_scalar_dense
        y.tolist()                           # 2: .tolist()
        y[y > 2]                             # 3: boolean-mask index
        torch.repeat_interleave(y.long())    # 4: no output_size
        y.long().repeat_interleave(2)        # int repeats: no sync
        host.tolist()                        # host tensor: no sync
        int(host.sum())
        bool((y.cpu() > 0).all())            # 5: .cpu(); its result is a host tensor
        host.to(y.device)                    # a host -> device copy
    whats = [s.what for s in census.syncs("p")]
    assert whats == ["_local_scalar_dense", ".tolist()", "index with a boolean mask",
                     "repeat_interleave without output_size", ".cpu()"]
    assert len(census.phases["p"].h2d) == 1
    assert all(s.frame.startswith("tests/bench/test_op_census.py:") for s in census.syncs("p"))


def _census(variant: str, layers: int):
    return census_of(VARIANTS[variant], model_config(layers, 8, 2), samples=2, seq=16)[0]


@pytest.fixture(scope="module")
def censuses(megatron):
    out = {(v, n): _census(v, n) for v in ("plain", *EXTRA_OPS_PER_LAYER) for n in (1, 2)}
    out[("lora-sequential", 2)] = _census("lora-sequential", 2)
    return out


def _ours(census, phase):
    return [f"{s.what} at {s.frame}" for s in census.syncs(phase, "ours")]


@pytest.mark.parametrize("variant", ["plain", *EXTRA_OPS_PER_LAYER, "lora-sequential"])
def test_no_host_sync_of_ours_in_a_micro_batch(censuses, variant):
    """Fails on the old code (1a18f9e: ``int(keep.sum())``, two boolean-mask indexings and
    ``float(...)`` in ``rl.micro_forward.routing_counts`` per micro batch; one ``float()`` per
    metric and micro batch in ``rl.trainer.average_metrics``) and on the value check put back
    in ``RoutingReplay.set_micro_batch`` (one per micro batch on the CPU). The Q(W) refresh's
    one read fails on the code that checked each linear's weight at once (12 reads at two
    layers) and on ``check_finite`` left out of ``PolicyTrainer._run`` (none in the phase)."""
    census = censuses[(variant, 2)]
    assert _ours(census, "fwd+bwd again") == []
    reads = _ours(census, "fwd+bwd +agreement")  # one read per train_step, not per micro batch
    assert len(reads) == 1 and "rl/trainer.py" in reads[0], reads
    for phase in ("fwd+bwd again", "fwd+bwd +agreement"):
        assert len(census.syncs(phase, "upstream")) == 2 * UPSTREAM_PER_LAYER, phase
    step = _ours(census, "optimizer")  # the guard-free step and its metrics: one read
    assert len(step) == 1 and "rl/guard.py" in step[0], step
    want = Q_W_CHECKS_PER_REFRESH if variant.startswith("aligned") else 0
    for layers, phase in ((2, "fwd+bwd"), (1, "fwd+bwd"), (2, "recompute")):
        refresh = _ours(censuses.get((variant, layers), census), phase)
        if phase == "recompute":  # beside the routing agreement's read
            refresh = [r for r in refresh if "quant/" in r]
        assert len(refresh) == want and all("quant/finite_checks.py" in r for r in refresh), \
            (layers, phase, refresh)


def _per_layer(censuses, variant, phase="fwd+bwd again"):
    return censuses[(variant, 2)].total_ops(phase) - censuses[(variant, 1)].total_ops(phase)


@pytest.mark.parametrize("variant", list(EXTRA_OPS_PER_LAYER))
def test_replay_and_aligned_add_few_ops_per_layer(censuses, variant):
    extra = _per_layer(censuses, variant) - _per_layer(censuses, "plain")
    assert 0 <= extra <= EXTRA_OPS_PER_LAYER[variant], extra


def test_census_leaves_the_numbers_alone(megatron):
    """The loss and every gradient of a census run equal a plain run's, bit for bit
    (compared after one warm-up run: the first run after ``census_of``'s optimizer step
    differs from later ones in the last bits, census or not)."""
    from bench.op_census import micro_batch
    from megatron_qrl.losses.megatron_adapter import PolicyLossFunc
    from megatron_qrl.utils.op_census import OpCensus

    cfg = model_config(1, 8, 2)
    _, trainer = census_of(VARIANTS["replay"], cfg, samples=2, seq=16)
    from megatron_qrl.rl.cli import parse_configs

    configs = parse_configs(["--qrl-loss-kind", "tis"])[0]
    loss_fn = PolicyLossFunc(configs["loss"], configs["error_tokens"])
    out = []
    for census in (None, None, OpCensus()):
        trainer.policy.ddp.zero_grad_buffer()
        mb = micro_batch(cfg, 2, 16, seed=7)
        if census is None:
            store = trainer._run([mb], loss_fn, False)
        else:
            census.mark_device(list(trainer.module.parameters()))
            with census.phase("p"):
                store = trainer._run([mb], loss_fn, False)
        grads = [p.main_grad.clone() for p in trainer.module.parameters()]
        out.append((store[0]["loss"].clone(), grads))
    _, (l0, g0), (l1, g1) = out
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert any(a.abs().max() > 0 for a in g0)


ALIGNED = [v for v in EXTRA_OPS_PER_LAYER if v.startswith("aligned")]
LINEARS_PER_LAYER = 4
"""Aligned linears of a Qwen3-MoE layer: attention qkv and proj, experts fc1 and fc2."""


@pytest.mark.parametrize("variant", ALIGNED)
def test_q_w_refreshed_once_per_optimizer_step(censuses, variant):
    """Q(W) of every aligned linear (the stacked experts' included) is refreshed by the first
    forward after an optimizer step — the update's or the log-prob recompute's, whichever runs
    first — and by no other micro batch, recompute or step. Mutation caught: the cache key
    without the state's version (``_qrl_key``) — never refreshed after a step; with a fresh
    object per call — refreshed every micro batch."""
    r = censuses[(variant, 2)].refreshes
    assert r["fwd+bwd"] == r["recompute"] == 2 * LINEARS_PER_LAYER, r
    assert all(r[p] == 0 for p in ("fwd+bwd again", "fwd+bwd +agreement", "optimizer",
                                   "recompute again")), r


@pytest.mark.parametrize("variant", ALIGNED)
def test_aligned_micro_batch_reads_the_expert_weights_as_plain(censuses, variant):
    """Between refreshes the fake aligned forward reads the cached stacked Q(W) exactly as the
    plain forward reads its weights: no pass over the expert weights per micro batch or
    recompute beyond the plain path's."""
    for phase in ("fwd+bwd again", "recompute again"):
        got = censuses[(variant, 2)].phases[phase].passes["expert weights"]
        assert got == censuses[("plain", 2)].phases[phase].passes["expert weights"], phase


def test_replaying_update_runs_no_own_topk(censuses):
    """An update that replays and measures no routing agreement runs one top-k per MoE layer
    fewer than the plain path (the router's own, not needed: the rollout's experts are
    used); one that measures it (an RL step's first update, the recompute) records as before.
    Fails on the code before ``RoutingReplay.use(record=...)``."""
    def topk(variant, phase):
        return censuses[(variant, 2)].phases[phase].ops["topk"]

    assert topk("replay", "fwd+bwd again") == topk("plain", "fwd+bwd again") - 2
    assert topk("replay", "fwd+bwd +agreement") == topk("plain", "fwd+bwd +agreement")
    assert topk("replay", "recompute again") == topk("plain", "recompute again")
