"""The Ray modes of qrl-train: the rollout engine in a Ray actor (megatron_qrl.rl.ray_modes).

The worker's local Ray cluster (``local_ray`` of tests/conftest.py). In-process, over the
three weight transports (``broadcast``: a driver <-> actor gloo group; ``objectstore``;
``ipc``: handles to shared CPU buckets, more in tests/rollout/test_ipc.py): bucketed weight
sync + manifest verification through the actor, a tampered manifest names the tensor, a killed
actor is an EngineDiedError (a killed one mid-broadcast too, with the stream drained and
the group destroyed; the restarted actor gets a new group), an engine error inside a
broadcast sync arrives at once and leaves the group usable, placement of the engine actor.
Subprocess jobs (``tests/helpers/rl_ray_helper.py`` connects to the worker's cluster through
RAY_ADDRESS): disaggregated == single metrics with
the same seed, colocated release/resume order (actor call log), a ``ray.kill``ed actor
mid-run (before a generate, in a weight update, in its re-sync, in the verification
read-back) or an actor process that ``os._exit``s half-way through an update restarts,
re-syncs and reproduces the unkilled run (the weight-sync deaths with every transport); the
colocated runs take the ``auto`` transport (ipc) and equal single mode; a colocated ``--qrl-resume`` reproduces the
uninterrupted run; ``--qrl-compare`` colocated writes the single-mode table; NVFP4 (float8
scales) weights cross the object store.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_qrl.rl.compare import VARIANTS, slug
from megatron_qrl.rl.ray_modes import RayRolloutEngine, RaySession, placement_layout
from megatron_qrl.rollout.base import SamplingParams, WeightManifest, WeightSyncError
from megatron_qrl.rollout.ray_actor import EngineSpec, RayEngine
from megatron_qrl.rollout.supervisor import EngineDiedError
from megatron_qrl.sync.transport import cut
from tests.helpers import HELPERS


def _kill(handle, timeout: float = 60.0) -> None:
    """``ray.kill`` and wait until the actor is dead: the kill is asynchronous, so a call made
    right after it can still be served (a flake under a loaded machine, 2026-12-01)."""
    import time

    import ray

    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            continue
        time.sleep(0.05)
    raise AssertionError(f"the Ray actor survived ray.kill for {timeout} s")

TINY = ["--qrl-preset", "tiny-cpu", "--qrl-sft-steps", "4", "--qrl-prompts-per-step", "2",
        "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
        "--qrl-micro-batch-size", "4", "--qrl-updates-per-step", "2", "--qrl-save-interval", "0",
        "--qrl-lr", "1e-3", "--qrl-no-progress", "--qrl-steps", "2"]
TIMING = ("time_rollout_s", "time_recompute_s", "time_train_s", "time_sync_s", "time_step_s")
BUCKET = 128 * 1024
"""Bucket size of the in-process syncs: about 10 buckets of the tiny MoE's 1.1 MB of int8
weights (its largest tensor is 64 KiB)."""


@pytest.fixture(scope="module")
def ray():
    """The ``ray`` module; only the cases that start Ray skip where it is not installed."""
    return pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster(ray, local_ray):
    return local_ray.address()


def _records(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


JOB_TIMEOUT_S = 600
"""A job's limit: alone one takes ~1 min; beside the other xdist worker on 2 cores one ran past
300 s (three actor restarts, each a fresh Ray worker importing torch)."""


def _job(cluster: str, out: Path, *extra: str, helper: str = "rl_ray_helper.py",
         metrics: bool = True) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_ADDRESS=cluster)
    proc = subprocess.Popen([sys.executable, str(HELPERS / helper), *TINY, "--qrl-output-dir",
                             str(out), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        _, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # a hang: every thread's stack (the helpers register
        proc.send_signal(signal.SIGUSR1)  # faulthandler on SIGUSR1) before it is killed
        time.sleep(3)
        proc.kill()
        _, stderr = proc.communicate()
        pytest.fail(f"{helper} {' '.join(extra)} ran past {JOB_TIMEOUT_S} s; its stacks and stderr:\n"
                    + stderr[-12000:])
    assert proc.returncode == 0, stderr[-3000:]
    _LAST["stderr"] = stderr
    return _records(out) if metrics else []


_LAST: dict[str, str] = {}
"""The last job's stderr (:func:`_job`)."""


def _deaths() -> str:
    """The supervisor's restart warnings of the last job: why each restart happened (the
    message of an assertion on the restart count)."""
    return "\n".join(line for line in _LAST.get("stderr", "").splitlines()
                     if "rollout engine died" in line) or "(no restart warnings)"


@pytest.fixture(scope="module")
def single_run(cluster, tmp_path_factory):
    return _job(cluster, tmp_path_factory.mktemp("single") / "run", "--qrl-mode", "single",
                helper="rl_run_helper.py")


def _recorded(stream, names: list[str]):
    """``stream`` unchanged; each tensor's name appended to ``names`` as the sync consumes it."""
    for item in stream:
        names.append(item[0])
        yield item


def _packed(fmt: str = "int8"):
    from megatron_qrl.data import CharTokenizer, tiny_moe_config
    from megatron_qrl.quant import get_spec
    from megatron_qrl.quant.hf_reference import hf_tensors
    from megatron_qrl.rollout.reference import build_hf_model

    cfg = tiny_moe_config(CharTokenizer().vocab_size)
    torch.manual_seed(0)
    model = build_hf_model(cfg, torch.float32, "cpu")
    return cfg, list(get_spec(fmt).pack_state_dict(hf_tensors(model)))


def test_placement_layout():
    one = placement_layout("disaggregated", 1)
    assert one.strategy == "PACK" and len(one.bundles) == 2 and one.engine_bundle == 0
    assert placement_layout("disaggregated", 3, engine_gpus=1).strategy == "STRICT_SPREAD"
    assert placement_layout("disaggregated", 3, engine_gpus=1).bundles[0] == {"CPU": 1.0, "GPU": 1}
    co = placement_layout("colocated", 4, engine_gpus=1, trainer_gpus=1)
    assert co.bundles == [{"CPU": 1.0, "GPU": 1}] and co.strategy == "PACK"
    with pytest.raises(ValueError, match="--qrl-mode"):
        placement_layout("single", 1)
    sizes = [len(b) for b, _ in cut(((f"t{i}", torch.zeros(4)) for i in range(5)), 40)]
    assert sizes == [2, 2, 1]  # 16-byte tensors in 40-byte buckets


def _group_names() -> set[str]:
    from torch.distributed import distributed_c10d as c10d

    return set(c10d._world.pg_names.values())


@pytest.mark.parametrize("transport", ["broadcast", "objectstore", "ipc"])
def test_actor_sync_verify_kill_and_placement(ray, cluster, transport):
    cfg, packed = _packed()
    with RaySession("disaggregated", weight_transport=transport) as session:
        spec = EngineSpec("reference", cfg, "int8", seed=0, num_threads=1)
        engine = RayRolloutEngine(lambda: session.new_actor(spec), colocated=False)
        engine.actor.bucket_bytes = BUCKET
        manifest = WeightManifest()
        engine.update_weights(manifest.record(iter(packed)), version=3)
        assert engine.actor.buckets_sent > 1 and engine.weight_version() == 3
        first_group = engine.actor.group_name
        assert (first_group in _group_names()) == (transport != "objectstore")
        engine.verify(manifest)  # the actor holds exactly what was sent
        name = packed[1][0]
        manifest.checksums[name] = "float32[1]:0"
        with pytest.raises(WeightSyncError, match=name.replace(".", r"\.")):
            engine.verify(manifest)
        assert engine.actor.placement_group_id() == session.pg.id.hex()
        table = ray.util.placement_group_table(session.pg)
        assert table["strategy"] == "PACK" and len(table["bundles"]) == 2
        sampling = SamplingParams(max_new_tokens=3, seed=5)
        first = engine.generate([[1, 2, 3]] * 2, sampling)
        _kill(engine.actor.actor)
        with pytest.raises(EngineDiedError, match="generate"):
            engine.actor.generate([[1, 2, 3]] * 2, sampling)
        # the supervisor restarts the actor and re-syncs through the driver's sync
        resyncs = []
        engine.bind_resync(lambda v: (resyncs.append(v), engine.update_weights(iter(packed), v)))
        again = engine.generate([[1, 2, 3]] * 2, sampling)
        assert torch.equal(again.output_ids, first.output_ids)
        assert torch.equal(again.logprobs, first.logprobs)
        assert engine.restarts == 1 and resyncs == [3] and engine.weight_version() == 3
        if transport != "objectstore":  # the new actor has a new group, the old one is gone
            assert engine.actor.group_name not in (None, first_group)
            assert first_group not in _group_names()
        engine._resync = None  # a driver that never bound its sync gets a clear error
        _kill(engine.actor.actor)
        with pytest.raises(RuntimeError, match="bind_resync"):
            engine.generate([[1, 2, 3]] * 2, sampling)
        engine.shutdown()


@pytest.mark.parametrize("transport", ["broadcast", "objectstore", "ipc"])
def test_nvfp4_weights_reach_the_actor(cluster, transport):
    # torch cannot pickle float8 / float4 tensors (NVFP4 scales): in the object store they
    # travel as bytes; the broadcast sends every tensor as bytes
    import pickle

    cfg, packed = _packed("nvfp4")
    assert {t.dtype for _, t in packed} >= {torch.float8_e4m3fn}
    with pytest.raises(Exception, match="dtype"):
        pickle.loads(pickle.dumps(next(t for _, t in packed if t.dtype == torch.float8_e4m3fn)))
    with RaySession("colocated", weight_transport=transport) as session:
        engine = RayRolloutEngine(lambda: session.new_actor(
            EngineSpec("reference", cfg, "nvfp4", seed=0, num_threads=1)), colocated=True)
        manifest = WeightManifest()
        engine.update_weights(manifest.record(iter(packed)), version=1)
        engine.verify(manifest)  # every tensor arrived bit-exact, with its dtype
        engine.shutdown()


def test_engine_capacity_crosses_the_actor(ray, cluster):
    """The engine's limits reach the driver through the actor proxy (the start line and each
    rollout's record of the Ray modes need them); the reference engine reports none."""
    from megatron_qrl.rollout.capacity import EngineCapacity
    from megatron_qrl.rollout.ray_actor import EngineActor
    from tests.helpers.rl_engine_double import pooled_engine

    cfg, _ = _packed()
    spec = EngineSpec("reference", cfg, "int8", seed=0, num_threads=1)
    engine = RayRolloutEngine(lambda: RayEngine(ray.remote(EngineActor).options(
        num_cpus=0).remote(spec, pooled_engine)), colocated=True)
    assert engine.capacity() == EngineCapacity(max_running_requests=3, kv_pool_tokens=10_000)
    engine.shutdown()
    with RaySession("colocated") as session:
        reference = RayRolloutEngine(lambda: session.new_actor(spec), colocated=True)
        assert reference.capacity() is None
        reference.shutdown()


def test_broadcast_failures(ray, cluster):
    import time

    cfg, packed = _packed()
    consumed: list[str] = []

    with RaySession("disaggregated", weight_timeout_s=60) as session:
        spec = EngineSpec("reference", cfg, "int8", seed=0, num_threads=1)
        engine = session.new_actor(spec)
        assert isinstance(engine, RayEngine) and engine.backend == "gloo"
        engine.bucket_bytes = BUCKET
        # an engine error mid-stream: the actor reads the rest, its error arrives at once
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="unexpected"):
            engine.update_weights(iter([("bogus.weight", torch.zeros(3))] + packed), 1)
        assert time.monotonic() - start < 30  # not the group's 60 s timeout
        engine.update_weights(iter(packed), 2)  # the group is still in step
        assert engine.weight_version() == 2
        # an actor killed before a sync: EngineDiedError, the stream drained (under torchrun
        # every trainer rank gathers it), the actor and its group gone after shutdown
        group = engine.group_name
        _kill(engine.actor)
        with pytest.raises(EngineDiedError, match="update_weights|broadcast"):
            engine.update_weights(_recorded(iter(packed), consumed), 3)
        assert consumed == [name for name, _ in packed]
        engine.shutdown()
        assert engine.group is None and group not in _group_names()
    with pytest.raises(ValueError, match="--qrl-ray-weight-transport"):
        RaySession("colocated", weight_transport="nccl")


def test_actor_death_mid_send_aborts_the_group(ray, cluster, monkeypatch):
    """NCCL does not notice a dead peer: with ``abort_on_death`` (on for NCCL groups) a
    watcher aborts the group when the actor dies, so the blocked send fails at once instead
    of at the group timeout. The send here blocks until its group is aborted, as an NCCL
    broadcast to a dead peer would."""
    import threading
    import time

    import megatron_qrl.rollout.transports.broadcast as broadcast

    class BlockingGroup:
        def __init__(self):
            self.aborted = threading.Event()

        def abort(self):
            self.aborted.set()

    def blocking_send(bucket, group, device):
        if not group.aborted.wait(60):
            return
        raise RuntimeError("NCCL communicator was aborted")

    cfg, packed = _packed()
    with RaySession("disaggregated", weight_timeout_s=60) as session:
        engine = session.new_actor(EngineSpec("reference", cfg, "int8", seed=0, num_threads=1))
        engine.abort_on_death = True
        engine.group, engine.group_name = BlockingGroup(), "blocking"
        monkeypatch.setattr(broadcast, "send_frame", blocking_send)
        monkeypatch.setattr(engine, "destroy_group", lambda: None)
        _kill(engine.actor)
        start = time.monotonic()
        with pytest.raises(EngineDiedError, match="aborted"):
            engine.update_weights(iter(packed), 1)
        assert time.monotonic() - start < 20 and engine.group.aborted.is_set()


RAY_FLAGS = ["--qrl-ray-weight-transport", "objectstore", "--qrl-engine-max-restarts", "5",
             "--qrl-ray-weight-timeout-s", "42"]


def test_ray_flags_parse_and_validate():
    from megatron_qrl.config import QrlArgumentError
    from megatron_qrl.rl.cli import parse_configs

    run = parse_configs([])[0]["run"]
    assert (run.ray_weight_transport, run.ray_weight_timeout_s, run.engine_max_restarts) == (
        "auto", 300.0, 2)
    configs, flags, _ = parse_configs(RAY_FLAGS)
    assert flags["qrl_ray_weight_transport"] == "objectstore"
    for bad in (["--qrl-engine-max-restarts", "-1"], ["--qrl-ray-weight-timeout-s", "0"]):
        with pytest.raises(QrlArgumentError, match=bad[0]):
            parse_configs(bad)


def test_ray_flags_reach_the_session(cluster):
    from megatron_qrl.rl.cli import _ray_session, parse_configs

    configs, _, _ = parse_configs(RAY_FLAGS)
    cfg, _ = _packed()
    with _ray_session("colocated", configs, True) as session:
        engine = session.engine_factory(configs["rollout"], cfg, 0)
        assert engine.supervisor.max_restarts == 5
        assert (engine.actor.transport, engine.actor.timeout_s) == ("objectstore", 42.0)
        engine.shutdown()


def test_sglang_engine_needs_a_gpu_bundle(cluster):
    # --qrl-rollout-engine sglang in a Ray mode: the actor asks for 1 GPU; a session opened
    # without one says so, and a CPU-only cluster cannot place the GPU bundle (clear error)
    from megatron_qrl.rl.cli import parse_configs

    configs, _, _ = parse_configs(["--qrl-train-forward", "bf16", "--qrl-routing-replay", "off"])
    configs["rollout"].engine = "sglang"
    with RaySession("colocated") as session, pytest.raises(RuntimeError, match="engine_gpus=1"):
        session.engine_factory(configs["rollout"], {}, 0)
    with pytest.raises(RuntimeError, match="GPU"):
        with RaySession("disaggregated", pg_timeout_s=2, engine_gpus=1):
            pass


@pytest.fixture(scope="module")
def killed_run(cluster, tmp_path_factory):
    """A disaggregated job whose actor is ``ray.kill``ed before the 2nd generate: its records
    and the last actor's call log. The same job without the kill (disaggregated, one engine,
    == single mode) runs in tests/rl/test_fleet_samples_end_to_end.py."""
    out = tmp_path_factory.mktemp("killed")
    calls = out / "calls.jsonl"
    records = _job(cluster, out / "k", "--qrl-mode", "disaggregated", "--kill-at", "2",
                   "--calls", str(calls))
    return records, [json.loads(line) for line in calls.read_text().splitlines()]


@pytest.mark.slow
def test_disaggregated_matches_single(single_run, killed_run):
    disagg, _ = killed_run  # the restart re-syncs; every step equals the single-mode run
    assert [r["phase"] for r in disagg] == ["sft"] * 4 + ["rl"] * 2
    assert disagg == single_run


@pytest.mark.slow
def test_colocated_releases_memory_around_training(cluster, single_run, tmp_path):
    calls = tmp_path / "calls.jsonl"
    co = _job(cluster, tmp_path / "c", "--qrl-mode", "colocated", "--calls", str(calls))
    assert co == single_run
    (log,) = [json.loads(line) for line in calls.read_text().splitlines()]
    # sync(v4) -> step 4: generate, release, [train], resume, sync(v5) -> step 5 ... sync(v6)
    step = ["generate", "release_memory", "resume_memory", "update_weights"]
    assert log == {"calls": ["update_weights", *step, *step], "restarts": 0}


@pytest.mark.slow
def test_colocated_trainer_sleep_equals_single_mode(cluster, single_run, tmp_path):
    """--qrl-trainer-sleep on, colocated: the same records as the single-mode run; the actor
    starts beside the sleeping trainer and releases before it wakes (rl.trainer_sleep)."""
    calls = tmp_path / "calls.jsonl"
    co = _job(cluster, tmp_path / "c", "--qrl-mode", "colocated", "--qrl-trainer-sleep", "on",
              "--calls", str(calls))
    sleep_keys = ("time_sleep_s", "time_wake_s", "trainer_gpu_gib_asleep")
    assert all(r["time_wake_s"] > 0 for r in co if r["phase"] == "rl")
    assert [{k: v for k, v in r.items() if k not in sleep_keys} for r in co] == single_run
    (log,) = [json.loads(line) for line in calls.read_text().splitlines()]
    step = ["generate", "release_memory", "resume_memory", "update_weights"]
    assert log == {"calls": ["release_memory", "resume_memory", "update_weights", *step, *step],
                   "restarts": 0}


@pytest.mark.slow
def test_killed_actor_restarts_and_reproduces_the_run(single_run, killed_run):
    killed, (log,) = killed_run
    assert killed == single_run
    # the new actor got the re-sync of v5, served step 5's generate, then the sync of v6
    assert log == {"calls": ["update_weights", "generate", "update_weights"], "restarts": 1}


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["broadcast", "objectstore", "ipc"])
def test_actor_death_during_weight_sync_restarts_and_reproduces_the_run(cluster, single_run,
                                                                        tmp_path, transport):
    # sync of v5 (update #2) is killed, so is its re-sync (update #3: a death inside a
    # re-sync counts against the same call's budget); the verification read-back of the
    # sync of v6 (held_checksums #4) is killed too
    calls = tmp_path / "calls.jsonl"
    killed = _job(cluster, tmp_path / "k", "--qrl-mode", "disaggregated", "--kill",
                  "update_weights:2,update_weights:3,held_checksums:4", "--calls", str(calls),
                  "--qrl-ray-weight-transport", transport)
    assert killed == single_run
    (log,) = [json.loads(line) for line in calls.read_text().splitlines()]
    # the last actor is fresh: it only served the re-sync of v6
    assert log == {"calls": ["update_weights"], "restarts": 3}, _deaths()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["broadcast", "objectstore", "ipc"])
def test_actor_process_exit_mid_update_colocated(cluster, single_run, tmp_path, transport):
    # every actor process exits half-way through its 2nd weight update: the first one in the
    # sync of v5, its replacement (re-sync v5 = its 1st) in the sync of v6
    calls = tmp_path / "calls.jsonl"
    co = _job(cluster, tmp_path / "x", "--qrl-mode", "colocated", "--exit-in-update", "2",
              "--calls", str(calls), "--qrl-ray-weight-transport", transport)
    assert co == single_run
    (log,) = [json.loads(line) for line in calls.read_text().splitlines()]
    assert log == {"calls": ["update_weights"], "restarts": 2}, _deaths()


@pytest.mark.slow
def test_colocated_resume_reproduces_the_uninterrupted_run(cluster, single_run, tmp_path):
    # saves after RL step 4 (the end of a 1-step run), resumes for the 2-step budget
    part = tmp_path / "part"
    _job(cluster, part, "--qrl-mode", "colocated", "--qrl-steps", "1")
    resumed = _job(cluster, part, "--qrl-mode", "colocated", "--qrl-resume")
    assert [r["step"] for r in resumed] == list(range(6))
    assert resumed[:4] == single_run[:4]  # the SFT steps are kept, not duplicated
    assert resumed[5] == single_run[5]  # the resumed step reproduces the uninterrupted run
    # (step 4 ran with a 1-step budget: --qrl-steps sets the AQN schedule, like single mode)


@pytest.mark.slow
def test_compare_colocated_writes_the_single_mode_table(cluster, tmp_path):
    budget = ["--qrl-compare", "--qrl-steps", "1", "--qrl-sft-steps", "2"]
    _job(cluster, tmp_path / "s", "--qrl-mode", "single", *budget, helper="rl_run_helper.py",
         metrics=False)
    _job(cluster, tmp_path / "c", "--qrl-mode", "colocated", *budget, metrics=False)
    single, co = (tmp_path / "s" / "compare.md").read_text(), (tmp_path / "c" / "compare.md").read_text()
    assert all(f"| {label} |" in single for label, _ in VARIANTS)
    # the Ray modes leave the LoRA variants out (no adapter serving in the engine actor yet);
    # every other row is the single mode's, byte for byte
    lora = {label for label, extra in VARIANTS if "--qrl-lora-rank" in extra}
    assert lora and not any(f"| {label} |" in co for label in lora)
    assert [ln for ln in single.splitlines() if not any(f"| {x} |" in ln for x in lora)] \
        == co.splitlines()
    assert (tmp_path / "c" / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for label in ("bf16", "int8 aligned+acr", "w4a16 aligned+tbpo"):
        runs = [_records(tmp_path / m / slug(label)) for m in ("s", "c")]
        assert runs[0] == runs[1] and [r["phase"] for r in runs[0]] == ["rl"]
