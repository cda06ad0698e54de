"""Megatron logits == transformers logits (fp32) at TP=1, TP=2, EP=2, TP=2 x EP=2 on gloo.

Each layout loads the tiny HF model twice: straight from safetensors (``load_hf_weights``)
and from a dist checkpoint saved at TP=1 (re-sharded by megatron on load). The sharded
model is then streamed back to HF tensors (``iter_hf_tensors``), which must equal the
original safetensors bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_qrl.models.checkpoint import load_checkpoint
from megatron_qrl.models.convert import convert_hf_to_megatron, convert_megatron_to_hf
from megatron_qrl.models.hf_config import load_hf_config
from megatron_qrl.models.hf_io import HFCheckpointReader
from tests.helpers.mp_utils import run_distributed
from tests.helpers.tiny_hf import hf_logits, make_tiny_hf, tokens

TOL = 1e-4


def _megatron_logits(model, ids: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    model.eval()
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        out = model(ids, pos, attention_mask=None)
    if ps.get_tensor_model_parallel_world_size() > 1:
        group = ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, out.contiguous(), group=group)
        out = torch.cat(parts, dim=-1)
    return out


def _check_layout(arch, hf_dir, ckpt_dir, ids, ref, tp, ep, save_dir=None) -> dict:
    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.streaming import (
        groups_from_parallel_state,
        iter_hf_tensors,
        load_hf_weights,
    )

    reader = HFCheckpointReader(hf_dir)
    groups = groups_from_parallel_state()
    model = build_model(arch, ParallelLayout(tp=tp, ep=ep))
    load_hf_weights(model, arch, reader.get, groups)
    diff_hf = (_megatron_logits(model, ids) - ref).abs().max().item()
    if arch.is_moe and tp > 1:  # training-mode forward/backward with sequence parallelism
        model.train()
        pos = torch.arange(ids.shape[1])[None].expand_as(ids)
        model(ids, pos, attention_mask=None).float().pow(2).mean().backward()
        for name, param in model.named_parameters():
            if "norm" in name:  # SP-aware norms: megatron all-reduces these grads over TP
                assert param.sequence_parallel, name
            if "norm" in name or "router" in name or "linear_qkv" in name:
                assert param.grad is not None and param.grad.isfinite().all(), name
    model = build_model(arch, ParallelLayout(tp=tp, ep=ep))
    load_checkpoint(model, ckpt_dir)
    diff_ckpt = (_megatron_logits(model, ids) - ref).abs().max().item()
    streamed = list(iter_hf_tensors(model, arch, groups))
    mismatched = [n for n, t in streamed if not torch.equal(t, reader.get(n))]
    if sorted(n for n, _ in streamed) != sorted(reader.names()):
        mismatched.append("streamed names != checkpoint names")
    if save_dir is not None:  # save at this layout; the parent converts it back at TP=1
        from megatron_qrl.models.checkpoint import save_checkpoint
        from megatron_qrl.models.hf_io import copy_side_files

        if dist.get_rank() == 0:
            (Path(save_dir) / "hf").mkdir(parents=True)
            copy_side_files(Path(ckpt_dir) / "hf", Path(save_dir) / "hf")
        dist.barrier()
        save_checkpoint(model, save_dir, {"architecture": arch.architecture, "dtype": "float32",
                                          "saved_layout": {"tp": tp, "ep": ep}, "uaq_scale": None})
    return {"diff_hf": diff_hf, "diff_ckpt": diff_ckpt, "stream_mismatch": mismatched}


def _worker(rank, world_size, port, cases, save_dir=None):
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed

    results = {}
    try:
        for key, (hf_dir, ckpt_dir, ids, ref, tp, ep) in cases.items():
            init_cpu_distributed(rank, world_size, port, tp=tp, ep=ep, etp=1)
            _, arch = load_hf_config(hf_dir)
            with cpu_device_mode():
                results[key] = _check_layout(arch, hf_dir, ckpt_dir, ids, ref, tp, ep, save_dir)
    finally:
        destroy_cpu_distributed()
    return results


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ids = tokens(batch=2, seq=8)
    out = {}
    for key, kind, extra in (("dense", "dense", {}), ("moe", "moe", {}),
                             ("dense_tied", "dense", {"tie_word_embeddings": True})):
        root = tmp_path_factory.mktemp(key)
        hf_dir = make_tiny_hf(root / "hf", kind, **extra)
        convert_hf_to_megatron(hf_dir, root / "megatron")
        out[key] = (str(hf_dir), str(root / "megatron"), ids, hf_logits(hf_dir, ids))
    return out


def _assert_ok(results: list[dict], report: dict) -> None:
    for rank_result in results:
        for key, res in rank_result.items():
            assert not res["stream_mismatch"], (key, res["stream_mismatch"][:5])
    for key, res in results[0].items():
        report[key] = (res["diff_hf"], res["diff_ckpt"])
        assert res["diff_hf"] <= TOL and res["diff_ckpt"] <= TOL, (key, res)


MEASURED: dict = {}


def test_tp1_parity(tiny):
    cases = {f"{k}_tp1": (*tiny[k], 1, 1) for k in ("dense", "moe")}
    _assert_ok(run_distributed(_worker, 1, cases), MEASURED)


@pytest.mark.slow
def test_tp2_and_ep2_parity(tiny):
    cases = {"dense_tp2": (*tiny["dense"], 2, 1), "dense_tied_tp2": (*tiny["dense_tied"], 2, 1),
             "moe_tp2": (*tiny["moe"], 2, 1),
             "moe_ep2": (*tiny["moe"], 1, 2)}
    _assert_ok(run_distributed(_worker, 2, cases), MEASURED)


@pytest.mark.slow
def test_tp2_x_ep2_parity_and_save_at_tp2_x_ep2(tiny, tmp_path):
    cases = {"moe_tp2xep2": (*tiny["moe"], 2, 2)}
    saved = tmp_path / "saved_tp2_ep2"
    _assert_ok(run_distributed(_worker, 4, cases, save_dir=str(saved), timeout_s=600), MEASURED)
    print("max |logit diff| (hf loader, dist ckpt):", MEASURED)
    convert_megatron_to_hf(saved, tmp_path / "back")  # re-sharded to TP=1, EP=1 on load
    original, back = HFCheckpointReader(tiny["moe"][0]), HFCheckpointReader(tmp_path / "back")
    assert sorted(original.names()) == sorted(back.names())
    assert all(torch.equal(original.get(n), back.get(n)) for n in original.names())
