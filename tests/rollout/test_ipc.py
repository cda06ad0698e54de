"""The ``ipc`` weight transport of the Ray engine actor (megatron_qrl.rollout.ipc / ray_actor).

The worker's local Ray cluster (``local_ray`` of tests/conftest.py); the reference engine in a real actor, the
buckets shared through CPU shared memory (the CUDA IPC path runs in tests/gpu/test_ipc_sglang.py).
An ipc sync leaves the actor holding exactly what a broadcast sync leaves (fingerprints, and
the rollouts generated from them), a byte flipped in a shared bucket is caught by the
manifest check, the driver fills bucket k while the actor loads k - 1 (and has freed k - 2), an engine
error mid-stream arrives at once and leaves the transport usable,
an actor killed mid-sync is an EngineDiedError after which the supervisor restarts and
re-syncs it, an actor on another node is one error naming the flag, and ``auto`` picks ipc
for a colocated engine (broadcast otherwise; ipc where it cannot work is refused).
"""

import time

import pytest
import torch

from megatron_qrl.rl.ray_modes import RayRolloutEngine, RaySession
from megatron_qrl.rollout import ipc
from megatron_qrl.rollout.base import SamplingParams, WeightManifest, WeightSyncError
from megatron_qrl.rollout.ray_actor import EngineSpec, RayEngine, pick_transport
from megatron_qrl.rollout.supervisor import EngineDiedError
from tests.rl.test_rl_ray import _kill, _packed, _recorded

SAMPLING = SamplingParams(max_new_tokens=3, seed=5)
BUCKET = 128 * 1024
"""Bucket size: about 10 buckets of the tiny MoE's 1.1 MB of int8 weights (its largest tensor is
64 KiB), several in flight, each a round trip to the actor."""
PROMPTS = [[1, 2, 3], [4, 5]]


@pytest.fixture(scope="module")
def ray(local_ray):
    local_ray.address()
    import ray

    return ray


def _spec(cfg, fmt="int8"):
    return EngineSpec("reference", cfg, fmt, seed=0, num_threads=1)


def _sync_and_read(session, cfg, packed, transport):
    """Sync ``packed`` as version 1 over ``transport``; the actor's fingerprints and a
    rollout from the weights it holds."""
    session.weight_transport = transport
    engine = RayRolloutEngine(lambda: session.new_actor(_spec(cfg)), colocated=True)
    engine.actor.bucket_bytes = BUCKET
    manifest = WeightManifest()
    engine.update_weights(manifest.record(iter(packed)), version=1)
    assert engine.actor.transport == transport and engine.actor.buckets_sent > 2
    engine.verify(manifest)
    held, out = engine.held_checksums(), engine.generate(PROMPTS, SAMPLING)
    engine.shutdown()
    return held, manifest.checksums, out


def test_ipc_holds_what_broadcast_holds(ray):
    cfg, packed = _packed()
    with RaySession("colocated") as session:
        via_ipc = _sync_and_read(session, cfg, packed, "ipc")
        via_broadcast = _sync_and_read(session, cfg, packed, "broadcast")
    assert via_ipc[0] == via_broadcast[0] and via_ipc[1] == via_broadcast[1]
    assert set(via_ipc[0]) >= {name for name, _ in packed}
    assert torch.equal(via_ipc[2].output_ids, via_broadcast[2].output_ids)
    assert torch.equal(via_ipc[2].logprobs, via_broadcast[2].logprobs)


def test_corrupted_bucket_is_caught(ray, monkeypatch):
    cfg, packed = _packed()
    flatten, buckets = ipc.flatten, []

    def flipping(named):  # the 3rd bucket's first byte changes after the manifest saw it
        flat, meta = flatten(named)
        buckets.append(meta[0][0])
        if len(buckets) == 3:
            flat[0] ^= 0x5A
        return flat, meta

    monkeypatch.setattr(ipc, "flatten", flipping)
    with RaySession("colocated", weight_transport="ipc") as session:
        engine = RayRolloutEngine(lambda: session.new_actor(_spec(cfg)), colocated=True)
        engine.actor.bucket_bytes = BUCKET
        manifest = WeightManifest()
        engine.update_weights(manifest.record(iter(packed)), version=1)
        assert engine.weight_version() == 1
        with pytest.raises(WeightSyncError, match=buckets[2].replace(".", r"\.")):
            engine.verify(manifest)
        engine.shutdown()


def test_at_most_two_buckets_in_flight(ray, monkeypatch):
    """The driver fills bucket k while the actor loads k - 1, and has let go of k - 2."""
    import gc
    import weakref

    cfg, packed = _packed()
    flatten, made, alive_at_fill = ipc.flatten, [], []

    def tracked(named):
        gc.collect()
        alive_at_fill.append([k for k, ref in enumerate(made) if ref() is not None])
        flat, meta = flatten(named)
        made.append(weakref.ref(flat))
        return flat, meta

    monkeypatch.setattr(ipc, "flatten", tracked)
    with RaySession("colocated", weight_transport="ipc") as session:
        engine = session.new_actor(_spec(cfg))
        engine.bucket_bytes = BUCKET
        engine.update_weights(iter(packed), 1)
        assert engine.weight_version() == 1
        engine.shutdown()
    assert len(made) > 4
    assert alive_at_fill == [[]] + [[k - 1] for k in range(1, len(made))]


def test_engine_error_mid_stream_and_a_killed_actor(ray):
    cfg, packed = _packed()
    consumed: list[str] = []

    with RaySession("colocated", weight_transport="ipc", weight_timeout_s=60) as session:
        engine = session.new_actor(_spec(cfg))
        assert isinstance(engine, RayEngine) and engine.transport == "ipc"
        engine.bucket_bytes = BUCKET
        start = time.monotonic()  # the engine's error arrives at once, not at the timeout
        with pytest.raises(WeightSyncError, match="unexpected"):
            engine.update_weights(iter([("bogus.weight", torch.zeros(3))] + packed), 1)
        assert time.monotonic() - start < 30
        engine.update_weights(iter(packed), 2)  # the group is still in step
        assert engine.weight_version() == 2
        _kill(engine.actor)  # a dead actor: EngineDiedError, the stream drained
        with pytest.raises(EngineDiedError, match="ipc_peer|update_weights|ipc handles"):
            engine.update_weights(_recorded(iter(packed), consumed), 3)
        assert consumed == [name for name, _ in packed]
        engine.shutdown()


def test_actor_killed_mid_sync_restarts_and_resyncs(ray):
    cfg, packed = _packed()
    with RaySession("colocated", weight_transport="ipc", weight_timeout_s=60) as session:
        engine = RayRolloutEngine(lambda: session.new_actor(_spec(cfg)), colocated=True)
        engine.actor.bucket_bytes = BUCKET
        engine.update_weights(iter(packed), 1)
        expect = engine.generate(PROMPTS, SAMPLING)
        first = engine.actor

        def killed_half_way(stream):  # the actor dies with half of the sync handed over
            for i, item in enumerate(stream):
                if i == len(packed) // 2 and engine.actor is first:
                    _kill(first.actor)
                yield item

        resyncs = []

        def resync(version):
            resyncs.append(version)
            manifest = WeightManifest()
            engine.update_weights(manifest.record(iter(packed)), version)
            engine.verify(manifest)

        engine.bind_resync(resync)
        engine.update_weights(killed_half_way(iter(packed)), 2)
        assert engine.restarts == 1 and resyncs == [2] and engine.actor is not first
        assert engine.weight_version() == 2 and engine.actor.transport == "ipc"
        again = engine.generate(PROMPTS, SAMPLING)
        assert torch.equal(again.output_ids, expect.output_ids)
        assert torch.equal(again.logprobs, expect.logprobs)
        engine.shutdown()


def test_an_actor_on_another_node_is_refused(ray):
    class Remote:  # answers ipc_peer like an actor on another node
        class ipc_peer:  # noqa: N801 - the actor method's name
            @staticmethod
            def remote():
                return ray.put(("f" * 56, []))

    engine = RayEngine(Remote(), transport="ipc")
    with pytest.raises(ValueError, match="--qrl-ray-weight-transport ipc.*node.*broadcast"):
        engine.update_weights(iter([]), 1)


def test_pick_transport():
    assert pick_transport("auto", True, True, "sglang") == "ipc"
    assert pick_transport("auto", True, True, "reference") == "ipc"
    assert pick_transport("auto", True, False, "reference") == "ipc"  # CPU: same memory
    assert pick_transport("auto", True, False, "sglang") == "broadcast"
    assert pick_transport("auto", False, False, "sglang") == "broadcast"
    assert pick_transport("auto", False, False, "reference") == "broadcast"
    assert pick_transport("objectstore", True, True, "sglang") == "objectstore"
    assert pick_transport("ipc", False, False, "reference") == "ipc"  # one node, CPU engine
    for args in ((False, False, "sglang"), (False, False, "reference", 2),
                 (True, False, "sglang")):
        with pytest.raises(ValueError, match="--qrl-ray-weight-transport ipc.*broadcast"):
            pick_transport("ipc", *args)
    with pytest.raises(ValueError, match="--qrl-ray-weight-transport"):
        pick_transport("nccl", True, True, "sglang")


def test_auto_under_a_sharded_sync_is_broadcast():
    """Under torchrun every EP rank sends its own experts (``FleetSession.sharded_sync``):
    ``auto`` is ``broadcast`` even where ``ipc`` would be chosen; an explicit choice stands."""
    from megatron_qrl.rl.ray_fleet import FleetSession
    from megatron_qrl.rl.ray_modes import RaySession

    assert pick_transport("auto", True, True, "sglang", sharded=True) == "broadcast"
    assert pick_transport("objectstore", True, True, "sglang", sharded=True) == "objectstore"
    assert pick_transport("ipc", True, True, "reference", sharded=True) == "ipc"
    assert RaySession("colocated").sharded_sync() is False
    assert FleetSession.sharded_sync is not RaySession.sharded_sync  # torchrun: the gloo tests


def test_ipc_flag_reaches_the_session(ray):
    from megatron_qrl.rl.cli import _ray_session, parse_configs

    cfg, _ = _packed()
    for flags, mode, transport in (([], "colocated", "ipc"), ([], "disaggregated", "broadcast"),
                                   (["--qrl-ray-weight-transport", "ipc"], "disaggregated",
                                    "ipc")):
        configs, _, _ = parse_configs(flags)
        with _ray_session(mode, configs, True) as session:
            engine = session.engine_factory(configs["rollout"], cfg, 0)
            assert engine.actor.transport == transport
            engine.shutdown()
    configs, _, _ = parse_configs(["--qrl-ray-weight-transport", "ipc", "--qrl-train-forward",
                                   "bf16", "--qrl-routing-replay", "off"])
    configs["rollout"].engine = "sglang"
    with RaySession("disaggregated", weight_transport="ipc") as session:
        with pytest.raises(ValueError, match="--qrl-ray-weight-transport ipc.*disaggregated"):
            session.engine_factory(configs["rollout"], {}, 0)
