"""Engine restart on death: re-sync current weights, retry, nothing from the failed attempt."""

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.hf_reference import hf_tensors
from megatron_qrl.rollout import SamplingParams, WeightManifest
from megatron_qrl.rollout.reference import ReferenceEngine
from megatron_qrl.rollout.supervisor import EngineDiedError, EngineSupervisor
from tests.rollout.test_rollout_reference import CFG, PROMPTS, random_source


class DiesOnce(ReferenceEngine):
    """A reference engine whose process 'dies' part-way through its first generate()."""

    instances = 0

    def __init__(self, *a, die=True, **k):
        super().__init__(*a, **k)
        DiesOnce.instances += 1
        self.die = die

    def generate(self, prompts, sampling):
        if self.die:
            self.die = False
            self.model = None  # the process is gone: whatever it held is lost
            raise EngineDiedError("engine worker exited with signal 9")
        return super().generate(prompts, sampling)


@pytest.fixture(scope="module")
def weights():
    return random_source()


def _stream(model):
    return get_spec("int8").pack_state_dict(hf_tensors(model))


def test_a_killed_engine_is_restarted_resynced_and_the_step_retried(weights):
    DiesOnce.instances = 0
    created = []

    def factory():
        created.append(DiesOnce(CFG, "int8", die=not created))
        return created[-1]

    def resync(engine, version):
        manifest = WeightManifest()
        engine.update_weights(manifest.record(_stream(weights)), version)
        engine.verify(manifest)

    sup = EngineSupervisor(factory, resync)
    sup.update_weights(_stream(weights), 5)
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0, seed=11)
    out = sup.generate(PROMPTS, sampling)
    assert sup.restarts == 1 and len(created) == 2 and out.weight_version == 5
    healthy = ReferenceEngine(CFG, "int8")
    healthy.update_weights(_stream(weights), 5)
    want = healthy.generate(PROMPTS, sampling)
    assert torch.equal(out.output_ids, want.output_ids) and torch.equal(out.logprobs, want.logprobs)


def test_gives_up_after_max_restarts_with_every_failure_listed(weights):
    class AlwaysDies(ReferenceEngine):
        def generate(self, prompts, sampling):
            raise EngineDiedError("CUDA error: an illegal memory access")

    sup = EngineSupervisor(lambda: AlwaysDies(CFG, "int8"),
                           lambda e, v: e.update_weights(_stream(weights), v), max_restarts=1)
    sup.update_weights(_stream(weights), 1)
    with pytest.raises(EngineDiedError, match=r"died 2 times.*attempt 1.*attempt 2"):
        sup.generate(PROMPTS, SamplingParams(max_new_tokens=2))


def test_other_errors_are_not_swallowed(weights):
    sup = EngineSupervisor(lambda: ReferenceEngine(CFG, "int8"), lambda e, v: None)
    sup.update_weights(_stream(weights), 1)
    with pytest.raises(ValueError, match="stop strings need a decode"):
        sup.generate(PROMPTS, SamplingParams(stop=("x",)))
    assert sup.restarts == 0


class Faulty(ReferenceEngine):
    """A reference engine that 'dies' on the listed calls, numbered over all instances
    (``die_at = {("update_weights", 2), ...}``); a death mid-update has read part of the stream."""

    die_at: set = set()
    counts: dict = {}
    log: list = []  # (instance id, method) of every call that reached an engine

    def _maybe_die(self, method):
        Faulty.counts[method] = Faulty.counts.get(method, 0) + 1
        Faulty.log.append((id(self), method))
        if (method, Faulty.counts[method]) in Faulty.die_at:
            self.model = None  # the process is gone: whatever it held is lost
            raise EngineDiedError(f"engine worker exited in {method}")

    def update_weights(self, named_tensors, version):
        it = iter(named_tensors)
        Faulty.counts["u"] = Faulty.counts.get("u", 0) + 1
        if ("update_weights", Faulty.counts["u"]) in Faulty.die_at:
            next(it), next(it)  # it read part of the one-shot stream, then died
        self._maybe_die("update_weights")
        super().update_weights(it, version)

    def held_checksums(self):
        self._maybe_die("held_checksums")
        return super().held_checksums()


def _driver_like(weights, die_at, max_restarts=2):
    """A supervisor whose re-sync is the driver's sync: it goes back through the supervisor."""
    Faulty.die_at, Faulty.counts, Faulty.log = set(die_at), {}, []
    created, resyncs = [], []

    def factory():
        created.append(Faulty(CFG, "int8"))
        return created[-1]

    def sync(version):
        manifest = WeightManifest()
        sup.update_weights(manifest.record(_stream(weights)), version)
        sup.verify(manifest)
        return manifest

    def resync(engine, version):
        assert engine is created[-1]
        resyncs.append(version)
        sync(version)

    sup = EngineSupervisor(factory, resync, max_restarts=max_restarts)
    return sup, sync, created, resyncs


@pytest.mark.parametrize("die_at, restarts", [
    ({("update_weights", 2)}, 1),  # dies half-way through loading version 6
    ({("held_checksums", 2)}, 1),  # dies in the verification read-back of version 6
    ({("update_weights", 2), ("update_weights", 3)}, 2),  # ... and again in the re-sync
])
def test_a_death_during_a_sync_restarts_and_resyncs_that_version(weights, die_at, restarts):
    sup, sync, created, resyncs = _driver_like(weights, die_at)
    sync(5)
    manifest = sync(6)  # the caller's own verification passes on the new engine
    assert sup.restarts == restarts and len(created) == restarts + 1
    assert resyncs == [6] * restarts and sup.weight_version() == 6
    manifest.compare(created[-1].held_checksums())
    # the new engine starts fresh: it only ever saw the complete re-sync of version 6
    last = [m for i, m in Faulty.log if i == id(created[-1])]
    assert last[:2] == ["update_weights", "held_checksums"] and last.count("update_weights") == 1
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
    healthy = ReferenceEngine(CFG, "int8")
    healthy.update_weights(_stream(weights), 6)
    out, want = sup.generate(PROMPTS, sampling), healthy.generate(PROMPTS, sampling)
    assert torch.equal(out.output_ids, want.output_ids) and torch.equal(out.logprobs, want.logprobs)


def test_a_resync_that_keeps_dying_gives_up_listing_every_failure(weights):
    dies = {("update_weights", n) for n in (2, 3, 4)}
    sup, sync, created, _ = _driver_like(weights, dies, max_restarts=2)
    sync(5)
    with pytest.raises(EngineDiedError, match=r"died 3 times in one update_weights call.*"
                       r"attempt 1 \(update_weights\).*attempt 2 \(re-sync of version 6\).*"
                       r"attempt 3 \(re-sync of version 6\)"):
        sync(6)
    assert sup.restarts == 2 and len(created) == 3  # no nested restarts: one per failure


def test_the_sync_account_is_the_inner_engines(weights):
    """The RL step logs the supervised engine's account of its sync (rollout.base.sync_record),
    the engine of the moment after a restart. Catches: the supervisor's own (empty) account."""
    from megatron_qrl.rollout.base import sync_record

    engines = []

    def factory():
        engines.append(ReferenceEngine(CFG, "int8"))
        engines[-1].last_sync = {"buckets": len(engines), "verified": "receipt"}
        return engines[-1]

    sup = EngineSupervisor(factory, resync=lambda engine, version: None)
    assert sync_record(sup) == {"sync_buckets": 1, "sync_verified": "receipt"}
    sup.engine = factory()  # as a restart leaves it
    assert sync_record(sup)["sync_buckets"] == 2
