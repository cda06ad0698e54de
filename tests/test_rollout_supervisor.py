"""Engine restart on death: re-sync current weights, retry, nothing from the failed attempt."""

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.hf_reference import hf_tensors
from megatron_qrl.rollout import SamplingParams, WeightManifest
from megatron_qrl.rollout.reference import ReferenceEngine
from megatron_qrl.rollout.supervisor import EngineDiedError, EngineSupervisor
from tests.test_rollout_reference import CFG, PROMPTS, random_source


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
