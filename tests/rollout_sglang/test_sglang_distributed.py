"""``SGLangOptions(sync="distributed")`` pieces that run without a GPU, on gloo: the trainer
joins the weight-update group while the "engine" side joins from another process (as
SGLang's ``init_weights_update_group`` does), a bucket broadcast under an engine request
is received by the in-place loader's :func:`receive_bucket`, and the layout checks.
The engine itself (NCCL, SGLang on a second GPU) is tests/gpu/test_sglang_inplace.py."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from megatron_qrl.rollout.base import WeightSyncError
from megatron_qrl.rollout.broadcast import init_group
from megatron_qrl.rollout.wire import flatten
from megatron_qrl.rollout_sglang.engine import _check_distributed_layout
from megatron_qrl.rollout_sglang.sync.distributed import (
    flat_buckets,
    open_group,
    run_alongside,
    send_bucket,
)
from megatron_qrl.rollout_sglang.sync.loader.packed import receive_bucket

BUCKET = [("a.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4)),
          ("a.weight_scale", torch.tensor([0.5, 2.0], dtype=torch.bfloat16)),
          ("b.weight", torch.tensor([1, -2, 3], dtype=torch.int8)),
          ("c.weight", torch.tensor([0.5, -1.0], dtype=torch.float8_e4m3fn))]


def _engine_side(host, port, world, name, meta, q):
    """What an engine scheduler does: join as rank 1, then receive one bucket."""
    try:
        init_group(host, port, world, 1, name, backend="gloo", timeout_s=60)
        got = receive_bucket({"group": name, "meta": meta}, torch.device("cpu"))
        q.put([(n, str(t.dtype), t.contiguous().view(torch.uint8).tolist()) for n, t in got])
    except BaseException as exc:  # reported to the parent
        q.put(repr(exc))


def test_group_and_bucket_broadcast_reach_the_inplace_loader():
    flat, meta = flatten(BUCKET)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []

    def engine_join(host, port, world, name):
        p = ctx.Process(target=_engine_side, args=(host, port, world, name, meta, q))
        p.start()
        procs.append(p)
        return True, "joined"

    group = open_group(engine_join, 1, torch.device("cpu"), backend="gloo", timeout_s=60)
    assert group.world_size == 2 and group.name.startswith("qrl-weights-")
    assert run_alongside(lambda: (True, "ok"), lambda: send_bucket(flat, group),
                         timeout_s=60) == (True, "ok")
    got = q.get(timeout=60)
    procs[0].join(30)
    torch.distributed.destroy_process_group(group.pg)  # a gloo group alive at exit aborts
    assert not isinstance(got, str), got
    assert [(n, d) for n, d, _ in got] == [(n, str(t.dtype)) for n, t in BUCKET]
    for (_, _, raw), (_, t) in zip(got, BUCKET):
        assert raw == t.contiguous().view(torch.uint8).tolist()


def test_engine_refusing_the_group_names_it():
    def refuse(host, port, world, name):
        return False, "NCCL error: no GPU"

    with pytest.raises(WeightSyncError, match="could not join the weight-update group.*no GPU"):
        # the trainer's rendezvous waits for a rank that never comes: bounded by the timeout
        open_group(refuse, 1, torch.device("cpu"), backend="gloo", timeout_s=3)


def test_broadcast_thread_error_is_raised():
    with pytest.raises(WeightSyncError, match="trainer's side of the weight broadcast failed"):
        run_alongside(lambda: (True, ""), lambda: 1 / 0, timeout_s=5)


def test_flat_buckets_mark_the_last_bucket():
    out = list(flat_buckets(BUCKET, 48, torch.device("cpu")))  # the wire's one bucketing rule
    assert [(names, last) for names, _, _, last in out] == [
        (["a.weight"], False), (["a.weight_scale", "b.weight", "c.weight"], True)]
    assert list(flat_buckets([], 48, torch.device("cpu"))) == []


@pytest.mark.parametrize("trainer,kwargs,match", [
    ("cuda:0", {}, r"GPUs \[0\].*include the trainer's cuda:0"),
    ("cuda:1", {"base_gpu_id": 0, "tp_size": 2}, r"GPUs \[0, 1\]"),
    ("cpu", {"base_gpu_id": 1}, "needs the trainer's weights on a CUDA device"),
])
def test_distributed_layout_errors(trainer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _check_distributed_layout(torch.device(trainer), "nccl", kwargs.get("base_gpu_id", 0),
                                  kwargs.get("tp_size", 1))


def test_distributed_layout_accepts_separate_gpus():
    _check_distributed_layout(torch.device("cuda:0"), "nccl", 1, 2)
    _check_distributed_layout(torch.device("cpu"), "gloo", 0, 1)


def test_job_engine_gets_sync_and_base_gpu(monkeypatch):
    """--qrl-rollout-sglang-sync distributed / --qrl-rollout-sglang-base-gpu reach SGLangEngine:
    the job's options object whole, placed on base_gpu (checked before SGLang is imported)."""
    import megatron_qrl.rollout_sglang.engine as sglang_engine
    from megatron_qrl.config.run import RolloutConfig
    from megatron_qrl.data import CharTokenizer, tiny_moe_config
    from megatron_qrl.rollout_sglang import SGLangOptions
    from megatron_qrl.rollout_sglang.launch import start_job_engine
    from megatron_qrl.utils.optional import MissingDependencyError

    built = {}

    class FakeSGLangEngine:
        def __init__(self, model_path, spec_name, options, **kwargs):
            built.update(spec=spec_name, options=options, kwargs=kwargs)

    real = sglang_engine.SGLangEngine
    monkeypatch.setattr(sglang_engine, "SGLangEngine", FakeSGLangEngine)
    hf = tiny_moe_config(CharTokenizer().vocab_size)
    cfg = RolloutConfig(format="int8", engine="sglang",
                        sglang=SGLangOptions(sync="distributed", base_gpu=2))
    start_job_engine(cfg.sglang, cfg.format, hf, 3)
    assert built["options"] is cfg.sglang and built["spec"] == "int8"
    assert built["kwargs"] == {"load_format": "dummy", "random_seed": 3}
    # the engine places itself on base_gpu: GPU 0 would hold the trainer's cuda:0
    with pytest.raises(ValueError, match=r"GPUs \[0\].*include the trainer's cuda:0"):
        real("/nonexistent", "int8", SGLangOptions(sync="distributed"), trainer_device="cuda:0")
    with pytest.raises((MissingDependencyError, FileNotFoundError)):  # GPU 2: past the check
        real("/nonexistent", "int8", cfg.sglang, trainer_device="cuda:0")
    with pytest.raises(ValueError, match="--qrl-rollout-sglang-base-gpu"):
        SGLangOptions(base_gpu=-1)


def test_distributed_sync_is_refused_in_ray_modes(monkeypatch):
    import megatron_qrl.config.args as args_mod
    from megatron_qrl.config.args import QrlArgumentError
    from megatron_qrl.rl.cli import parse_configs

    monkeypatch.setattr(args_mod, "_gpu_capability", lambda: (9, 0))  # an H200 here

    with pytest.raises(QrlArgumentError, match="distributed is for --qrl-mode single"):
        parse_configs(["--qrl-mode", "disaggregated", "--qrl-rollout-engine", "sglang",
                       "--qrl-rollout-sglang-sync", "distributed"])
    with pytest.raises(QrlArgumentError, match="Ray gives the engine actor its GPU"):
        parse_configs(["--qrl-mode", "colocated", "--qrl-rollout-engine", "sglang",
                       "--qrl-rollout-sglang-base-gpu", "1"])
