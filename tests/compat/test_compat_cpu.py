"""megatron-core 0.16.1 on CPU/gloo through megatron_qrl.compat: build, train, TP=1 == TP=2."""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.compat import (
    cpu_device_mode,
    cpu_megatron_enabled,
    destroy_cpu_distributed,
    disable_cpu_megatron,
    enable_cpu_megatron,
    init_cpu_distributed,
)
from tests.helpers.megatron_cpu_utils import (
    SEQ,
    build_tiny_gpt,
    gathered_state,
    tiny_batches,
    train_step,
)
from tests.helpers.mp_utils import run_distributed


def test_enable_is_idempotent_and_reversible():
    original = torch.cuda.current_device
    was_enabled = cpu_megatron_enabled()
    try:
        enable_cpu_megatron()
        enable_cpu_megatron()
        assert torch.cuda.current_device() == "cpu"
        torch.cuda.manual_seed(7)
        a = torch.rand(3)
        torch.manual_seed(7)
        assert torch.equal(a, torch.rand(3))  # "cuda" seeding drives the CPU generator
        disable_cpu_megatron()
        assert not cpu_megatron_enabled()
        disable_cpu_megatron()
    finally:
        if was_enabled:
            enable_cpu_megatron()
    if not was_enabled:
        assert torch.cuda.current_device is original


@pytest.fixture
def restore_cpu_shim():
    """Leave the pytest process as found: the shim is process-wide once enabled."""
    was_enabled = cpu_megatron_enabled()
    yield
    if not was_enabled:
        disable_cpu_megatron()


def test_device_mode_redirects_cuda_factories_only_inside(restore_cpu_shim):
    with cpu_device_mode():
        t = torch.zeros(2, device="cuda")
        u = torch.tensor([1.0], device=torch.device("cuda", 0)).cuda().to("cuda")
        assert t.device.type == "cpu" and u.device.type == "cpu"
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1).type() == "torch.FloatTensor"


def _ce_forward_step(data_iterator, model):
    tokens = next(data_iterator)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    per_token = model(tokens, position_ids, None, labels=labels)  # [b, s] CE from Megatron

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return per_token, loss_func


def _train_body(rank, world_size, port, tp, steps):
    init_cpu_distributed(rank, world_size, port, tp=tp, seed=1234)
    try:
        with cpu_device_mode():
            ddp, opt, _ = build_tiny_gpt(tp=tp)
            before = gathered_state(ddp)
            losses, norms = [], []
            for batch in tiny_batches(steps):
                store, norm = train_step(ddp, opt, _ce_forward_step, [batch], 1, SEQ, 2)
                losses.append(float(store[0]["lm loss"]))
                norms.append(norm)
            after = gathered_state(ddp)
        return {"losses": losses, "norms": norms, "before": before, "after": after}
    finally:
        destroy_cpu_distributed()


@pytest.mark.slow
def test_tiny_gpt_trains_on_cpu_and_tp2_matches_tp1():
    (tp1,) = run_distributed(_train_body, 1, 1, 2)
    assert all(torch.isfinite(torch.tensor(tp1["losses"])))
    assert tp1["losses"][0] == pytest.approx(torch.log(torch.tensor(128.0)).item(), abs=0.3)
    changed = [
        k
        for k, v in tp1["before"].items()
        if not k.endswith(".grad") and not torch.equal(v, tp1["after"][k])
    ]
    assert len(changed) == len([k for k in tp1["before"] if not k.endswith(".grad")])

    tp2 = run_distributed(_train_body, 2, 2, 2)
    for rank_out in tp2:
        assert rank_out["losses"] == pytest.approx(tp1["losses"], rel=1e-5, abs=1e-6)
        assert rank_out["norms"] == pytest.approx(tp1["norms"], rel=1e-4)
        for name, value in tp1["after"].items():
            if name.endswith(".grad"):
                continue
            assert name in rank_out["after"], name
            torch.testing.assert_close(rank_out["after"][name], value, rtol=1e-4, atol=1e-5)


def _group_timeouts(rank, world_size, port):
    import torch.distributed as dist

    init_cpu_distributed(rank, world_size, port, ep=2, timeout_s=7.0)
    try:
        groups = list(dist.distributed_c10d._world.pg_map)
        return sorted({g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                       for g in groups}), len(groups)
    finally:
        destroy_cpu_distributed()


def test_every_megatron_group_times_out_with_the_default_group():
    """A collective on megatron's groups (data / expert / tensor parallel) waits as long as the
    default group's (``timeout_s``), not megatron's own 30 min default: a frozen peer ends the
    job after ``--qrl-launch-collective-timeout-s`` whichever group the ranks were in. Fails
    without ``distributed_timeout_minutes`` passed to ``initialize_model_parallel``."""
    for timeouts, count in run_distributed(_group_timeouts, 2):
        assert count > 5 and timeouts == [7.0], (count, timeouts)
