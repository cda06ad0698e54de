"""2 GPUs (nvidia-h200-x2): the trainer at TP=2 and at EP=2 under torchrun + NCCL
matches TP=1 on the same job: SFT loss, token accuracy and grad norm of 3 optimizer steps,
then one RL step (its weight gather to rank 0, rollout and update).

    bash bench/h200.sh mg-parity            # TE spec where /tmp/te_site imports (te-load)
    python -m pytest -q -s -rs tests/gpu/test_multigpu_parity.py

The job is tests/rl/test_rl_multirank.py's (its ``JOB``: the tiny Qwen3-MoE of
tests/helpers/tiny_hf.py, ``-- --load DIR``, BF16 training forward, lr 1e-5, router aux loss
0) with 3 SFT steps and 1 RL step; on the GPU with ``--bf16`` and the layer implementation
``PARITY_IMPL`` (default: ``transformer_engine`` where TE imports, else ``local``). The TP=1
run is one process (tests/helpers/rl_run_helper.py, as the CPU test); TP=2 (+ sequence
parallel) and EP=2 (data-parallel 2 for the dense layers) are ``torchrun --nproc-per-node 2``
of ``megatron_qrl.rl.cli`` — the backend is chosen by the device
(``models.runtime.torchrun_megatron``: NCCL with CUDA, gloo + megatron's CPU shim without).
The SFT steps see the same batches in every layout, so their loss / grad norm must agree to
BF16 noise (``TOL``: relative, a few BF16 roundings of 2^-8 deep; a missing TP all-reduce or
an expert on the wrong rank moves them by tens of percent). The RL step's rollout is sampled
by the reference engine on rank 0's CPU from the gathered weights: where its ``sample`` is
the same as TP=1's, its metrics are compared too; a different sample (weights one BF16 ulp
apart can flip a draw) is printed, not failed.

CPU evidence of the same script (gloo, 2 processes, the local spec, fp32 and TOL 1e-5):
``QRL_MULTIGPU_ON_CPU=1 python -m pytest -q -s tests/gpu/test_multigpu_parity.py`` (the
subprocesses get ``CUDA_VISIBLE_DEVICES=""``); elsewhere the test skips with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_qrl.compat.distributed import free_port
from megatron_qrl.data import CharTokenizer
from tests.helpers import RL_RUN_HELPER
from tests.helpers.tiny_hf import make_tiny_hf
from tests.rl.run_records import assert_records_close, read_records
from tests.rl.test_rl_multirank import COMPARED, JOB

ROOT = Path(__file__).resolve().parents[2]
ON_CPU = os.environ.get("QRL_MULTIGPU_ON_CPU") == "1"
if not ON_CPU and torch.cuda.device_count() < 2:
    pytest.skip(f"{torch.cuda.device_count()} CUDA device(s): the TP=2 / EP=2 parity needs 2 "
                "GPUs (nvidia-h200-x2: bash bench/h200.sh mg-parity); QRL_MULTIGPU_ON_CPU=1 "
                "runs the same script on gloo", allow_module_level=True)

SFT_STEPS, RL_STEPS = 3, 1
TOL = 1e-5 if ON_CPU else 2e-2
SFT_KEYS = ("sft_loss", "sft_token_acc", "grad_norm")
LAYOUTS = {"tp2": ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
           "ep2": ("--expert-model-parallel-size", "2")}


def _job() -> list[str]:
    job = list(JOB)
    job[job.index("--qrl-sft-steps") + 1] = str(SFT_STEPS)
    return job


def _impl() -> str:
    if ON_CPU:
        return "local"
    from megatron_qrl.models.builder import use_transformer_engine

    return os.environ.get("PARITY_IMPL") or (
        "transformer_engine" if use_transformer_engine() else "local")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if ON_CPU:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _megatron(hf: Path, *layout: str) -> list[str]:
    dtype = [] if ON_CPU else ["--bf16"]
    return ["--load", str(hf), "--lr", "1e-5", "--train-iters", str(RL_STEPS),
            "--transformer-impl", _impl(), *dtype, *layout]


def _run(out: Path, megatron: list[str], nproc: int) -> list[dict]:
    """qrl-train: one plain process (nproc 1) or torchrun's ``nproc`` ranks."""
    head = ([sys.executable, str(RL_RUN_HELPER)] if nproc == 1 else
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
             "-m", "megatron_qrl.rl.cli"])
    cmd = [*head, *_job(), "--qrl-output-dir", str(out), "--", *megatron]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(),
                          cwd=ROOT)
    assert proc.returncode == 0, (f"{' '.join(cmd)}\n" + proc.stdout[-2000:]
                                  + proc.stderr[-4000:])
    return read_records(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The tiny MoE checkpoint and the TP=1 run's records."""
    root = tmp_path_factory.mktemp("parity")
    hf = make_tiny_hf(root / "moe", "moe", router_aux_loss_coef=0.0)
    CharTokenizer().save(hf, hf=False)
    ref = _run(root / "tp1", _megatron(hf), 1)
    assert [r["phase"] for r in ref] == ["sft"] * SFT_STEPS + ["rl"] * RL_STEPS, ref
    return hf, ref


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_rank_layout_matches_one_rank(reference, tmp_path, layout):
    hf, ref = reference
    got = _run(tmp_path / layout, _megatron(hf, *LAYOUTS[layout]), 2)
    backend = "gloo" if ON_CPU else "nccl"
    for a, b in zip(ref, got):
        print(f"[mg-parity] {layout} ({backend}, {_impl()}) step {a['step']} {a['phase']}: "
              + ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in SFT_KEYS if k in a),
              flush=True)
    assert_records_close(ref[:SFT_STEPS], got[:SFT_STEPS], SFT_KEYS, tol=TOL)
    rl_ref, rl_got = ref[SFT_STEPS:], got[SFT_STEPS:]
    assert [r["step"] for r in rl_got] == [r["step"] for r in rl_ref]
    if all(a.get("sample") == b.get("sample") for a, b in zip(rl_ref, rl_got)):
        assert_records_close(rl_ref, rl_got, COMPARED, tol=TOL, skip_missing=True)
        print(f"[mg-parity] {layout}: RL step(s) equal to TP=1 within {TOL}", flush=True)
    else:
        print(f"[mg-parity] {layout}: RL sample differs from TP=1 (not compared): "
              f"{[r.get('sample') for r in rl_ref]} vs {[r.get('sample') for r in rl_got]}",
              flush=True)
