"""Ray modes under torchrun: a 2-rank TP=2 trainer (gloo) whose rank 0 drives a Ray engine actor.

Rank 0 joins the worker's Ray cluster (``RAY_ADDRESS``; ``local_ray`` of tests/conftest.py) and
holds the engine actor; rank 1 never imports Ray. The Ray runs must reproduce the same 2-rank
job in ``--qrl-mode single`` (rank 0's in-process engine) metric for metric, bit for bit: the
rollouts, their broadcast, the gathered weight sync and the training are the same
computations, only the engine's process differs (it runs with rank 0's torch thread count). A ``ray.kill`` of the actor
before the 2nd rollout, and again in its re-sync, restarts it twice, re-syncs the trainer's
current weights (gathered from both ranks again, rank 1 called in from its wait for the
rollout) and still reproduces the run — with the weights broadcast on a driver <-> actor
group (the disaggregated default; rank 0 under torchrun hosts its store), through the object
store and as ipc handles to shared buckets (the colocated default, also run colocated).

The construction path of ``--qrl-rollout-engine sglang`` in a Ray actor (no GPU / SGLang
here): the EngineSpec, the actor's Ray options (1 GPU) and ``start_job_engine``'s arguments
inside the actor, with a fake ``SGLangEngine`` class injected.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_qrl.compat.distributed import free_port
from megatron_qrl.rl.ray_modes import actor_options, engine_gpus, engine_spec, placement_layout
from megatron_qrl.rollout.ray_actor import EngineSpec
from megatron_qrl.rollout_sglang import SGLangOptions
from megatron_qrl.rollout_sglang.factory import build_engine
from tests.helpers import HELPERS

ROOT = Path(__file__).resolve().parents[2]
JOB = ["--qrl-preset", "tiny-cpu", "--qrl-sft-steps", "2", "--qrl-prompts-per-step", "2",
       "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
       "--qrl-micro-batch-size", "4", "--qrl-updates-per-step", "1", "--qrl-save-interval", "0",
       "--qrl-lr", "1e-3", "--qrl-no-progress", "--qrl-steps", "2"]
TP2 = ["--", "--tensor-model-parallel-size", "2", "--sequence-parallel",
       "--group-query-attention", "--num-query-groups", "2"]
TIMING = ("time_rollout_s", "time_recompute_s", "time_train_s", "time_sync_s", "time_step_s")


def _records(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def _torchrun(out: Path, *qrl: str, ray_address: str | None = None) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(HELPERS / "rl_ray_helper.py"), *JOB, *qrl, "--qrl-output-dir", str(out), *TP2]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return _records(out)


@pytest.mark.slow
def test_tp2_ray_modes_match_single_and_survive_a_killed_actor(tmp_path, local_ray):
    single = _torchrun(tmp_path / "single", "--qrl-mode", "single")
    assert [r["phase"] for r in single] == ["sft"] * 2 + ["rl"] * 2
    address = local_ray.address()
    for transport in ("broadcast", "objectstore", "ipc"):
        calls = tmp_path / f"calls-{transport}.jsonl"
        disagg = _torchrun(tmp_path / f"d-{transport}", "--qrl-mode", "disaggregated",
                           "--kill", "generate:2,update_weights:3",
                           "--qrl-ray-weight-transport", transport,
                           "--calls", str(calls), ray_address=address)
        assert disagg == single, transport
        (log,) = [json.loads(line) for line in calls.read_text().splitlines()]
        # generate #2 and its re-sync (update #3) die: the 3rd actor got the re-sync of
        # v3, served step 3's generate, then the sync of v4 (a broadcast killed in the
        # re-sync drained the gathered stream on rank 0, so rank 1 stays in step)
        assert log == {"calls": ["update_weights", "generate", "update_weights"],
                       "restarts": 2}, transport
    co = _torchrun(tmp_path / "c", "--qrl-mode", "colocated", ray_address=address)  # ipc
    assert co == single


def _rollout_cfg(engine: str = "sglang", **sglang):
    # parsed on this GPU-less host with the reference engine, then switched (as a GPU host
    # would parse it): the flag check refuses sglang without CUDA
    from megatron_qrl.rl.cli import parse_configs

    configs, _, _ = parse_configs(["--qrl-train-forward", "bf16", "--qrl-routing-replay", "off",
                                   "--qrl-rollout-format", "fp8"])
    cfg = configs["rollout"]
    cfg.engine, cfg.sglang = engine, SGLangOptions(**sglang)
    return cfg


def test_sglang_actor_spec_and_options():
    cfg = _rollout_cfg(mem_fraction=0.3, sync="disk", sync_dir="/tmp/qrl-sync")
    hf = {"model_type": "qwen3", "num_hidden_layers": 2}
    spec = engine_spec(cfg, hf, 7)
    assert spec.kind == "sglang" and spec.format == "fp8" and spec.seed == 7
    assert spec.sglang is cfg.sglang and spec.num_threads is None  # the options, whole
    assert spec.num_gpus == 1 and engine_gpus(cfg) == 1
    for mode in ("disaggregated", "colocated"):
        layout = placement_layout(mode, 1, engine_gpus=engine_gpus(cfg))
        assert layout.engine_resources == {"CPU": 1.0, "GPU": 1}
        assert actor_options(layout, spec) == {"num_cpus": 1.0, "num_gpus": 1, "max_restarts": 0}
    # the trainer's GPUs are torchrun's: the disaggregated trainer bundle asks for none
    assert placement_layout("disaggregated", 2, engine_gpus=1).bundles[1] == {"CPU": 1.0}
    with pytest.raises(RuntimeError, match="engine_gpus=1"):
        actor_options(placement_layout("disaggregated", 1), spec)  # a CPU-only bundle
    # an engine of TP 2 (the fleet's --qrl-rollout-engine-tp) asks for 2 GPUs: not in 1
    tp2 = EngineSpec("sglang", hf, "fp8", sglang_kwargs={"tp_size": 2})
    assert tp2.num_gpus == 2
    with pytest.raises(RuntimeError, match="needs 2 GPU"):
        actor_options(placement_layout("disaggregated", 1, engine_gpus=1), tp2)
    with pytest.raises(ValueError, match="tp_size"):
        EngineSpec("sglang", hf, "fp8", sglang_kwargs={"tp_size": 0})
    ref = engine_spec(_rollout_cfg("reference"), hf, 0)
    assert ref.kind == "reference" and ref.num_gpus == 0 and engine_gpus(_rollout_cfg("reference")) == 0
    assert ref.num_threads == torch.get_num_threads()  # CPU results as in single mode


def test_sglang_actor_builds_the_job_engine(monkeypatch):
    # what the actor process runs: start_job_engine's config-only dir + dummy load format
    import megatron_qrl.rollout_sglang.engine as sglang_engine
    from megatron_qrl.data import CharTokenizer, tiny_moe_config

    built = {}

    class FakeSGLangEngine:
        def __init__(self, model_path, spec_name, options=None, **kwargs):
            built.update(path=Path(model_path), spec=spec_name, options=options, kwargs=kwargs)

    monkeypatch.setattr(sglang_engine, "SGLangEngine", FakeSGLangEngine)
    hf = tiny_moe_config(CharTokenizer().vocab_size)
    cfg = _rollout_cfg(mem_fraction=0.25, sync="tensor", flat_buckets=False, prefetch_buckets=2)
    engine = build_engine(engine_spec(cfg, hf, 11))
    assert isinstance(engine, FakeSGLangEngine) and built["spec"] == "fp8"
    assert built["kwargs"] == {"load_format": "dummy", "random_seed": 11}
    # the options reach the engine whole (it resolves them per sync path)
    assert built["options"] == cfg.sglang
    # a pickled spec (what Ray sends the actor) carries them unchanged
    import pickle

    assert pickle.loads(pickle.dumps(engine_spec(cfg, hf, 11))).sglang == cfg.sglang
    written = json.loads((built["path"] / "config.json").read_text())
    assert written["num_hidden_layers"] == hf["num_hidden_layers"]
    assert written["torch_dtype"] == "bfloat16" and "quantization_config" in written
    # a checkpoint directory (programmatic use) still starts SGLangEngine from it
    build_engine(EngineSpec("sglang", hf, "int8", sglang_kwargs={"model_path": "/ckpt"}))
    assert built["path"] == Path("/ckpt") and built["spec"] == "int8" and built["kwargs"] == {}
    assert built["options"] == SGLangOptions()
