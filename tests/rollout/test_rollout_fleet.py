"""The rollout fleet (megatron_qrl.rollout.fleet / transports.fleet / fleet_layout).

Pure: impossible engine layouts are one clear error naming the flag; a fleet of 1, 2, 3
in-process reference engines gives the same batch for the same seed (sampling seeded per
prompt group). Ray (the worker's local cluster, 3 reference-engine actors shared by the
fleets): N = 1, 2, 3 actors synced over ONE gloo group give identical batches, and the
driver's broadcasts are as many for 3 engines as for 1 (each bucket sent once); an actor
killed mid-rollout and one whose process exits mid-sync are restarted (alone / with a fleet
re-sync) and the batch equals the unkilled one.
"""

import os
import threading
from pathlib import Path

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.hf_reference import hf_tensors
from megatron_qrl.rollout.base import SamplingParams, WeightManifest, WeightSyncError
from megatron_qrl.rollout.fleet import EngineFleet, group_seed, merge_outputs
from megatron_qrl.rollout.fleet_layout import fleet_layout
from megatron_qrl.rollout.ray_actor import EngineActor, EngineSpec, RayEngine
from megatron_qrl.rollout.reference import ReferenceEngine, build_hf_model
from megatron_qrl.rollout.supervisor import EngineDiedError
from megatron_qrl.rollout_sglang.factory import build_engine

CFG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64,
       "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64,
       "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
       "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
       "max_position_embeddings": 64, "tie_word_embeddings": False}
G = 2  # samples per prompt group
PROMPTS = [p for p in ([5, 6, 7], [9, 10, 11, 12], [3], [20, 21]) for _ in range(G)]
SAMPLING = SamplingParams(max_new_tokens=4, temperature=1.0, seed=11)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def packed():
    torch.manual_seed(0)
    model = build_hf_model(CFG, torch.float32, "cpu")
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0, 0.2)
    return list(get_spec("int8").pack_state_dict(hf_tensors(model)))


def _sync(fleet, packed, version):
    """What the driver's sync does: record, send, verify on every engine, check the version."""
    manifest = WeightManifest()
    fleet.update_weights(manifest.record(iter(packed)), version)
    fleet.verify(manifest)
    assert fleet.weight_version() == version
    return manifest


def _same(a, b):
    assert a.prompt_ids == b.prompt_ids and a.finish_reasons == b.finish_reasons
    for x, y in ((a.output_ids, b.output_ids), (a.logprobs, b.logprobs), (a.mask, b.mask),
                 (a.routed_experts, b.routed_experts)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_engines=0), "--qrl-rollout-num-engines"),
    (dict(num_engines=2, engine_tp=2), "reference engine is one process"),
    (dict(num_engines=2, engine_tp=4, engine_ep=3, engine_kind="sglang"), "must divide"),
    (dict(num_engines=2, engine_tp=8, engine_kind="sglang", gpus_per_node=4),
     "bundle of 8 GPUs"),
    (dict(num_engines=4, engine_tp=2, engine_kind="sglang", cluster_gpus=8, trainer_gpus=4),
     "lower --qrl-rollout-num-engines to <= 2"),
    (dict(num_engines=3, engine_tp=2, engine_kind="sglang", mode="colocated", trainer_gpus=4),
     "tile the trainer's GPUs"),
    (dict(num_engines=3, engine_kind="sglang", mode="colocated", trainer_gpus=2),
     "multiple of the trainer's 2 GPUs"),
    (dict(num_engines=2, engine_kind="sglang", mode="colocated", trainer_gpus=1,
          mem_fraction=0.5), "--qrl-rollout-sglang-mem-fraction"),
])
def test_impossible_layouts_are_one_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fleet_layout(**kwargs)


def test_possible_layouts():
    one_gpu = fleet_layout(2, engine_kind="sglang", mode="colocated", trainer_gpus=1,
                           mem_fraction=0.3)
    assert one_gpu.engines_per_gpu == 2 and one_gpu.bundles == ({"CPU": 1.0, "GPU": 0.5},) * 2
    tp2 = fleet_layout(3, engine_tp=2, engine_ep=2, engine_kind="sglang", cluster_gpus=8,
                       trainer_gpus=2, gpus_per_node=8)
    assert tp2.total_gpus == 6 and tp2.bundles == ({"CPU": 1.0, "GPU": 2.0},) * 3
    assert fleet_layout(3).bundles == ({"CPU": 1.0},) * 3


def test_group_seeds_and_merge():
    assert len({group_seed(b, k) for b in range(3) for k in range(5)}) == 15
    assert all(0 <= group_seed(7, k) < 2**63 for k in range(4))
    eng = ReferenceEngine(CFG, "bf16")
    eng.update_weights(get_spec("bf16").pack_state_dict(hf_tensors(eng.model)), 0)
    parts = [eng.generate(PROMPTS[i:i + G], SAMPLING) for i in range(0, len(PROMPTS), G)]
    merged = merge_outputs(parts)
    t = merged.output_ids.shape[1]
    for i, p in enumerate(parts):  # each group's rows, right-padded to the longest
        rows = slice(i * G, (i + 1) * G)
        w = p.output_ids.shape[1]
        assert torch.equal(merged.output_ids[rows, :w], p.output_ids)
        assert not merged.mask[rows, w:t].any()
        assert torch.equal(merged.routed_experts[rows, :p.routed_experts.shape[1]],
                           p.routed_experts)


def test_in_process_fleets_of_1_2_3_agree(packed):
    outs = []
    for n in (1, 2, 3):
        fleet = EngineFleet([lambda s=i: ReferenceEngine(CFG, "int8", seed=s)
                             for i in range(n)], group_size=G)
        _sync(fleet, packed, 1)
        outs.append(fleet.generate(PROMPTS, SAMPLING))
        assert sum(fleet.metrics()[f"fleet/engine{i}_groups"] for i in range(n)) == 4
    for o in outs[1:]:
        _same(outs[0], o)
    with pytest.raises(ValueError, match="n-samples-per-prompt"):
        fleet.generate(PROMPTS[:3], SAMPLING)
    # the manifest is checked on every engine, the error names the engine
    manifest = _sync(fleet, packed, 2)
    name = packed[0][0]
    fleet.members[2].engine._packed[name] = torch.zeros(1)
    with pytest.raises(WeightSyncError, match=f"fleet engine 2: .*{name}"):
        fleet.verify(manifest)


class Dying(ReferenceEngine):
    """An in-process engine whose ``plan`` says in which of its calls it "dies"; the calls
    are counted over the engine's restarts (the plan's ``"n"``), so a restarted engine that
    serves more groups (dispatch follows the threads' timing) does not die again. The plan's
    ``"first"`` (an Event) makes the engine's generate wait until another engine has
    served: dispatch follows the threads' timing, so without it one engine may take every
    group and the other's planned death never comes."""

    def __init__(self, plan, log):
        super().__init__(CFG, "int8")
        self.plan, self.log, self.n = plan, log, plan.setdefault("n", {})

    def _maybe_die(self, what):
        if what == "generate" and "after" in self.plan:
            assert self.plan["after"].wait(60), "the other engine never served a group"
        if what == "generate" and "first" in self.plan:
            self.plan["first"].set()
        self.n[what] = self.n.get(what, 0) + 1
        self.log.append(what)
        if self.n[what] in self.plan.get(what, ()):
            raise EngineDiedError(f"engine died in {what} #{self.n[what]}")

    def generate(self, prompts, sampling):
        self._maybe_die("generate")
        return super().generate(prompts, sampling)

    def update_weights(self, named_tensors, version):
        items = list(named_tensors)  # half-way through the stream, then gone
        self._maybe_die("update")
        super().update_weights(iter(items), version)


def test_in_process_deaths_restart_one_engine_and_keep_the_batch(packed):
    ref = EngineFleet([lambda: ReferenceEngine(CFG, "int8")], group_size=G)
    _sync(ref, packed, 1)
    expect = ref.generate(PROMPTS, SAMPLING)
    served = threading.Event()  # engine 1 serves once engine 0 has taken a group
    plans = [{"generate": {1}, "first": served},  # engine 0 dies in its 1st group,
             {"update": {2}, "after": served}]  # engine 1 in sync 2
    logs = [[], []]
    fleet = EngineFleet([lambda i=i: Dying(plans[i], logs[i]) for i in range(2)], group_size=G)
    fleet.bind_resync(lambda v: _sync(fleet, packed, v))
    _sync(fleet, packed, 1)
    _same(fleet.generate(PROMPTS, SAMPLING), expect)
    assert [m.restarts for m in fleet.members] == [1, 0]
    _sync(fleet, packed, 2)  # engine 1 dies mid-sync: restarted, the fleet re-synced
    assert [m.restarts for m in fleet.members] == [1, 1] and fleet.weight_version() == 2
    _same(fleet.generate(PROMPTS, SAMPLING), expect)
    plans[0]["generate"] = set(range(100))  # dies every time: gives up, naming the flag
    fleet.members[0].engine = Dying(plans[0], logs[0])
    with pytest.raises(EngineDiedError, match="--qrl-engine-max-restarts 2"):
        fleet.generate(PROMPTS, SAMPLING)


# ---- Ray ------------------------------------------------------------------------------
class ExitingActor(EngineActor):
    """An engine actor whose process exits after the first bucket of its ``exit_at``-th
    broadcast weight update."""

    def __init__(self, *args, exit_at=0):
        super().__init__(*args)
        self.exit_at, self.n_updates = exit_at, 0

    def update_weights_broadcast(self, version):
        from megatron_qrl.rollout.broadcast import receive_stream

        self.n_updates += 1
        if self.n_updates == self.exit_at:
            next(receive_stream(self.weight_group, self.weight_device))
            os._exit(1)
        super().update_weights_broadcast(version)


@pytest.fixture(scope="module")
def ray_cluster(local_ray):
    """The worker's local Ray cluster (its actors import this module: the repository is on
    their ``PYTHONPATH``)."""
    local_ray.address()
    import ray

    return ray


def _new(ray, cls=EngineActor, **kw):
    spec = EngineSpec("reference", CFG, "int8", seed=0, num_threads=1)
    actor = ray.remote(cls).options(num_cpus=0, max_restarts=0).remote(spec, build_engine, **kw)
    return RayEngine(actor, bucket_bytes=8192, transport="broadcast", backend="gloo",
                     timeout_s=20)


def _fleet(ray, engines, **kw):
    """A fleet over ``engines`` (used as they are) whose restarts start plain actors."""
    from megatron_qrl.rollout.transports.fleet import FleetBroadcast

    made = {i: e for i, e in enumerate(engines)}
    return EngineFleet([lambda i=i: made.pop(i, None) or _new(ray) for i in range(len(engines))],
                       group_size=G, broadcast=FleetBroadcast("gloo", 20, 8192), **kw)


@pytest.fixture(scope="module")
def engines(ray_cluster):
    made = [_new(ray_cluster) for _ in range(3)]
    assert [e.weight_version() for e in made] == [-1] * 3  # started (slow on a busy host)
    yield made
    for e in made:
        e.shutdown()


def test_ray_fleets_agree_and_broadcast_each_bucket_once(engines, ray_cluster, packed,
                                                         monkeypatch):
    import megatron_qrl.rollout.broadcast as bc

    calls = []
    real = bc.broadcast_from_trainer
    monkeypatch.setattr(bc, "broadcast_from_trainer", lambda t, g: (calls.append(1), real(t, g)))
    ref = EngineFleet([lambda: ReferenceEngine(CFG, "int8")], group_size=G)
    _sync(ref, packed, 1)
    expect = ref.generate(PROMPTS, SAMPLING)
    sends = {}
    for n in (1, 2, 3):
        fleet = _fleet(ray_cluster, engines[:n])
        calls.clear()
        _sync(fleet, packed, 1)
        sends[n] = (len(calls), fleet.broadcast.broadcasts)
        _same(fleet.generate(PROMPTS, SAMPLING), expect)
        m = fleet.metrics()
        assert sum(m[f"fleet/engine{i}_tokens"] for i in range(n)) == int(expect.mask.sum())
        fleet.broadcast.close()
    buckets = sends[1][1]
    assert buckets > 1 and sends[1] == sends[2] == sends[3] == (3 * buckets + 1, buckets)


def test_ray_engine_killed_mid_rollout_and_mid_sync(engines, ray_cluster, packed):
    ray = ray_cluster
    ref = EngineFleet([lambda: ReferenceEngine(CFG, "int8")], group_size=G)
    _sync(ref, packed, 1)
    expect = ref.generate(PROMPTS, SAMPLING)

    class Killing(RayEngine):
        n = 0

        def generate(self, prompts, sampling):
            Killing.n += 1
            if Killing.n == 2:  # the engine's second group: it dies with the group in hand
                ray.kill(self.actor, no_restart=True)
            return super().generate(prompts, sampling)

    victim = engines[0]
    victim.__class__ = Killing
    fleet = _fleet(ray, [victim, _new(ray, ExitingActor, exit_at=2)])
    fleet.bind_resync(lambda v: _sync(fleet, packed, v))
    _sync(fleet, packed, 1)
    _same(fleet.generate(PROMPTS, SAMPLING), expect)
    assert [m.restarts for m in fleet.members] == [1, 0]
    assert fleet.members[0].engine is not victim
    # engine 1's process exits after the first bucket of the next sync: restarted, the
    # fleet re-synced (the other engine's stream was cut too), the batch unchanged
    first = fleet.members[1].engine
    _sync(fleet, packed, 1)
    assert [m.restarts for m in fleet.members] == [1, 1]
    assert fleet.members[1].engine is not first and fleet.weight_version() == 1
    _same(fleet.generate(PROMPTS, SAMPLING), expect)
    assert fleet.metrics()["fleet/engine1_restarts"] == 1.0
    fleet.shutdown()


def test_qrl_train_with_a_fleet_of_two(ray_cluster, tmp_path):
    """``qrl-train --qrl-mode colocated --qrl-rollout-num-engines 2`` end to end: two engine
    actors in their own bundles, per-engine metrics in every RL step's record."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_qrl.rl.cli", "--qrl-preset", "tiny-cpu",
         "--qrl-sft-steps", "0", "--qrl-steps", "1", "--qrl-prompts-per-step", "2",
         "--qrl-rollout-n-samples-per-prompt", "2", "--qrl-rollout-max-new-tokens", "3",
         "--qrl-micro-batch-size", "2", "--qrl-updates-per-step", "1",
         "--qrl-save-interval", "0", "--qrl-no-progress",
         "--qrl-mode", "colocated", "--qrl-rollout-num-engines", "2",
         "--qrl-output-dir", str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert rec["fleet/engine0_groups"] + rec["fleet/engine1_groups"] == 2
    assert rec["fleet/engine0_restarts"] == rec["fleet/engine1_restarts"] == 0


def test_bench_fleet_sums_the_engines(tmp_path, monkeypatch):
    """``bench/rollout_throughput.py --engines N``: N children at once, the fleet's tok/s is
    the sum of theirs, each child ran 1/N of every batch behind the shared barrier."""
    from bench._fleet import BARRIER_ENV, ENGINES_ENV, barrier, run_fleet

    seen = []

    def run_one(env, tag):
        seen.append((env[ENGINES_ENV], Path(env[BARRIER_ENV]).is_dir(), tag))
        i = int(tag.split()[-1])
        return {"variant": "bf16", "startup_s": 1 + i,
                "bs4": {"out_tokens": 8, "wall_s": 1.0 + i, "prefill_s": 0.1,
                        "decode_tok_s": 10.0 * (i + 1)}}

    res = run_fleet(run_one, {}, 2, [8])
    assert sorted(seen) == [("2", True, "engine 0"), ("2", True, "engine 1")]
    assert res["bs8"] == {"out_tokens": 16, "wall_s": 2.0, "prefill_s": 0.1,
                          "decode_tok_s": 30.0, "per_engine_tok_s": [10.0, 20.0]}
    assert "bs4" not in res and res["engines"] == 2 and res["startup_s"] == 2
    monkeypatch.setenv(BARRIER_ENV, str(tmp_path))
    monkeypatch.setenv(ENGINES_ENV, "1")
    barrier("bs8")  # the last engine to arrive passes at once
    assert len(list((tmp_path / "bs8").iterdir())) == 1
