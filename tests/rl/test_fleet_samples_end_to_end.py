"""The fleet's promise end to end through ``qrl-train``: the same ``--qrl-seed`` gives the same
samples (rewards, sampled texts, every metric but the timings and the fleet's per-engine
counters) with 1, 2 and 3 reference engines in ``--qrl-mode disaggregated`` and with the
in-process engine of ``--qrl-mode single`` (megatron_qrl.rollout.groups: every engine samples
prompt group ``k`` from the same per-group seed).

In-process (fast): a lone reference engine asked for a step's batch with the driver's
``SamplingParams(seed, group_size=n)`` gives exactly the batch of a fleet of 2 and 3 engines.

End to end: the worker's local Ray cluster of 4 CPUs (3 engine actors + the trainer's bundle;
``local_ray`` of tests/conftest.py); each job is a
subprocess joining it through ``RAY_ADDRESS`` (tests/helpers/rl_ray_helper.py); each Ray run
prints the weight transport its ``auto`` resolved to.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_qrl.rollout.base import SamplingParams, WeightManifest
from megatron_qrl.rollout.fleet import EngineFleet
from megatron_qrl.rollout.reference import ReferenceEngine
from tests.helpers import HELPERS
from tests.rollout.test_rollout_fleet import CFG, packed  # noqa: F401 - the int8 weights

TINY = ["--qrl-preset", "tiny-cpu", "--qrl-sft-steps", "1", "--qrl-prompts-per-step", "3",
        "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
        "--qrl-micro-batch-size", "4", "--qrl-updates-per-step", "1", "--qrl-lr", "1e-3",
        "--qrl-no-progress", "--qrl-steps", "2", "--no-qrl-tensorboard"]
VARYING = ("time_", "fleet/", "trainer_peak_gib", "trainer_reserved_gib", "alloc_retries")


def test_a_lone_engine_samples_each_group_as_a_fleet_does(packed):  # noqa: F811
    n = 3
    prompts = [p for p in ([5, 6, 7], [9, 10, 11, 12], [3], [20, 21]) for _ in range(n)]
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=11, group_size=n)

    def engine():
        return ReferenceEngine(CFG, "int8", seed=0)

    outs = []
    for e in (engine(), EngineFleet([engine] * 2, group_size=n),
              EngineFleet([engine] * 3, group_size=n)):
        e.update_weights(WeightManifest().record(iter(packed)), version=1)
        outs.append(e.generate(prompts, sampling))
    for other in outs[1:]:
        assert torch.equal(other.output_ids, outs[0].output_ids)
        assert torch.equal(other.logprobs, outs[0].logprobs)
        assert torch.equal(other.mask, outs[0].mask)


@pytest.fixture(scope="module")
def cluster(local_ray):
    return local_ray.address()


def _run(cluster: str, out: Path, *extra: str, helper: str = "rl_ray_helper.py") -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_ADDRESS=cluster)
    proc = subprocess.run([sys.executable, str(HELPERS / helper), *TINY, "--qrl-output-dir",
                           str(out), *extra], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if helper == "rl_ray_helper.py":  # the run says which transport `auto` chose
        assert "[qrl-train] weight transport: " in proc.stdout, proc.stdout[-2000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VARYING)} for r in recs]


@pytest.mark.slow
def test_one_two_and_three_engines_sample_the_same(cluster, tmp_path):
    runs = {n: _run(cluster, tmp_path / f"engines{n}", "--qrl-mode", "disaggregated",
                    "--qrl-rollout-num-engines", str(n)) for n in (1, 2, 3)}
    single = _run(cluster, tmp_path / "single", "--qrl-mode", "single",
                  helper="rl_run_helper.py")
    assert [r["phase"] for r in single] == ["sft", "rl", "rl"]
    assert {r["sample"] for r in single if r["phase"] == "rl"}  # texts are compared too
    for n in (1, 2, 3):
        assert runs[n] == single, n
