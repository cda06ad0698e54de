"""``rl.guard.guarded_step`` on real megatron-core optimizers (one process, CPU / gloo).

The guarded step reads the gradient norm once (the guard's check and the clipping share it)
and gives the same update, bit for bit, as megatron's own ``optimizer.step()``.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.te_quant_fixtures import hf_state, ids, tiny_hf


def _policy(bf16: bool, clip_grad: float):
    """A tiny dense Qwen3 in megatron DDP + its Adam optimizer, with backward run once."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.streaming import groups_from_parallel_state, load_hf_weights
    from megatron_qrl.rl.trainer import make_optimizer

    hf, arch = tiny_hf("dense", seed=1)
    model = build_model(arch, None, torch.bfloat16 if bf16 else torch.float32)
    load_hf_weights(model, arch, hf_state(hf).__getitem__, groups_from_parallel_state())
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=bf16), model)
    opt = make_optimizer(ddp, 1e-2, clip_grad=clip_grad, bf16=bf16)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    x = ids()
    model(x, torch.arange(x.shape[1])[None].expand_as(x), None).float().pow(2).mean().backward()
    ddp.finish_grad_sync()
    return ddp, opt


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize("clip_grad", [1e-3, 0.0], ids=["clipping", "no-clip"])
def test_guarded_step_reads_the_norm_once_and_matches_megatrons_step(megatron, monkeypatch,
                                                                     bf16, clip_grad):
    import megatron.core.optimizer.optimizer as mopt

    from megatron_qrl.rl.guard import BadStepGuard, guarded_step

    ref_ddp, ref_opt = _policy(bf16, clip_grad)
    ok, ref_norm, _ = ref_opt.step()
    assert ok and type(ref_opt).__name__ == "ChainedOptimizer"  # what make_optimizer returns

    calls = []
    norm_fp32 = mopt.get_grad_norm_fp32
    monkeypatch.setattr(mopt, "get_grad_norm_fp32", lambda *a, **k: calls.append(1)
                        or norm_fp32(*a, **k))
    ddp, opt = _policy(bf16, clip_grad)
    before = {n: t.detach().clone() for n, t in ddp.module.named_parameters()}
    guard = BadStepGuard(0)
    norm = guarded_step(opt, [{"loss": torch.tensor(1.0)}], guard)
    assert len(calls) == 1, f"{len(calls)} gradient-norm passes for one guarded update"
    assert guard.bad_steps == 0 and norm > 0
    assert norm == float(ref_norm)
    got, ref = dict(ddp.module.named_parameters()), dict(ref_ddp.module.named_parameters())
    assert got.keys() == ref.keys()
    for name, p in got.items():
        assert torch.equal(p, ref[name]), name
    assert any(not torch.equal(p, before[n]) for n, p in got.items())
