"""The Megatron loss_func adapter through get_forward_backward_func() on CPU/gloo."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
from megatron_qrl.losses import LOSS_KINDS, ErrorTokenConfig, PolicyLossConfig, compute_policy_loss
from megatron_qrl.losses.megatron_adapter import (
    PolicyLossFunc,
    policy_forward_step,
    schedule_accepts_num_tokens,
)
from tests.helpers.megatron_cpu_utils import SEQ, VOCAB, build_tiny_gpt, gathered_state
from tests.helpers.mp_utils import run_distributed

B = 4


def _batches(n_micro: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_micro):
        tokens = torch.randint(0, VOCAB, (B, SEQ), generator=g)
        mask = torch.ones(B, SEQ, dtype=torch.bool)
        mask[:, :4] = False  # prompt
        mask[:, -1] = False
        mask[1, 9:] = False  # a shorter response
        out.append({
            "tokens": tokens,
            "position_ids": torch.arange(SEQ).unsqueeze(0).expand(B, -1),
            "labels": torch.roll(tokens, -1, dims=1),
            "loss_mask": mask,
            "advantages": torch.randn(B, generator=g),
            "noise": torch.randn(B, SEQ, generator=g) * 0.3,
        })  # fmt: skip
    return out


def _run_schedule(ddp, loss_fn, batches, forward_only=False, collect=False):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    return get_forward_backward_func()(
        forward_step_func=partial(policy_forward_step, loss_fn=loss_fn),
        data_iterator=iter(batches),
        model=[ddp],
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=B,
        forward_only=forward_only,
        collect_non_loss_data=collect,
    )


def _fill_log_probs(ddp, loss_fn, batches):
    """Trainer recompute of pi_prox via the non_loss_data path; pi_behav = pi_prox + noise."""
    with torch.no_grad():
        store = _run_schedule(ddp, loss_fn, batches, forward_only=True, collect=True)
    for batch, out in zip(batches, store):
        batch["old_log_probs"] = out["log_probs"]
        batch["rollout_log_probs"] = out["log_probs"] + batch["noise"]


def _tp_body(rank, world_size, port, tp, kind):
    init_cpu_distributed(rank, world_size, port, tp=tp, seed=1234)
    try:
        with cpu_device_mode():
            ddp, _, _ = build_tiny_gpt(tp=tp)
            cfg = PolicyLossConfig(kind=kind, kl_coef=0.0)
            batches = _batches(2)
            _fill_log_probs(ddp, PolicyLossFunc(cfg), batches)
            out = {"old": [b["old_log_probs"] for b in batches]}
            for num_tokens in (True, False):
                loss_fn = PolicyLossFunc(cfg, return_num_tokens=num_tokens)
                store = _run_schedule(ddp, loss_fn, batches)
                grads = {k: v for k, v in gathered_state(ddp).items() if k.endswith(".grad")}
                out[num_tokens] = {"metrics": store, "grads": grads}
            if tp == 1:  # reference: full-vocab log_softmax, same loss through the pure function
                b = batches[0]
                logits = ddp(b["tokens"], b["position_ids"], None)
                ref_lp = torch.log_softmax(logits.float(), -1).gather(-1, b["labels"][..., None])
                out["ref_old"] = ref_lp[..., 0].detach()
                ref_loss, ref_m = compute_policy_loss(
                    ref_lp[..., 0], b["old_log_probs"], b["rollout_log_probs"], b["advantages"],
                    b["loss_mask"], cfg, logits=logits.detach(),
                )  # fmt: skip
                out["ref_loss"], out["ref_entropy"] = ref_loss.detach(), ref_m["entropy"]
        return out
    finally:
        destroy_cpu_distributed()


def test_installed_schedule_accepts_both_tuple_formats():
    assert schedule_accepts_num_tokens()  # megatron-core 0.16.1: len(outputs) == 3 or 2


def test_missing_batch_key_is_named():
    fn = PolicyLossFunc(PolicyLossConfig(kind="tis"), return_num_tokens=True)
    with pytest.raises(KeyError, match="rollout_log_probs"):
        fn({"labels": torch.zeros(1, 1)}, torch.zeros(1, 1, 4))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["acr", "tbpo"])
def test_adapter_same_loss_and_grads_tp1_tp2_and_both_tuple_formats(kind):
    (tp1,) = run_distributed(_tp_body, 1, 1, kind)
    # log-probs from vocab-parallel CE == full-vocab log_softmax; loss == the pure function
    torch.testing.assert_close(tp1["old"][0], tp1["ref_old"], rtol=1e-5, atol=1e-5)
    first = tp1[True]["metrics"][0]
    assert first["loss"].item() == pytest.approx(tp1["ref_loss"].item(), rel=1e-5, abs=1e-6)
    assert first["entropy"].item() == pytest.approx(tp1["ref_entropy"].item(), rel=1e-5)
    # 3-tuple and 2-tuple outputs train identically and report the same metrics (the
    # schedule scales the returned loss in place; the metric must not alias it)
    for m3, m2 in zip(tp1[True]["metrics"], tp1[False]["metrics"]):
        assert m3.keys() == m2.keys()
        for key in m3:
            assert m2[key].item() == pytest.approx(m3[key].item(), rel=1e-6), key
    for name, g in tp1[True]["grads"].items():
        torch.testing.assert_close(tp1[False]["grads"][name], g, rtol=1e-5, atol=1e-7)
    assert sum(g.abs().sum() for g in tp1[True]["grads"].values()) > 0

    tp2 = run_distributed(_tp_body, 2, 2, kind)
    for out in tp2:
        for a, b in zip(out["old"], tp1["old"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for fmt in (True, False):
            for m2, m1 in zip(out[fmt]["metrics"], tp1[fmt]["metrics"]):
                for key in ("loss", "entropy", "clip_frac_high", "kl_behav_prox_k3"):
                    assert m2[key].item() == pytest.approx(m1[key].item(), rel=1e-4, abs=1e-6)
            for name, g in tp1[fmt]["grads"].items():
                torch.testing.assert_close(out[fmt]["grads"][name], g, rtol=1e-4, atol=1e-6)


def _train_body(rank, world_size, port, steps):
    init_cpu_distributed(rank, world_size, port, tp=1, seed=1234)
    try:
        results = {}
        with cpu_device_mode():
            for kind in LOSS_KINDS:
                ddp, opt, _ = build_tiny_gpt(tp=1, lr=1e-3)
                before = {k: v for k, v in gathered_state(ddp).items() if not k.endswith(".grad")}
                cfg = PolicyLossConfig(kind=kind, dual_clip_c=3.0 if kind != "tbpo" else None)
                loss_fn = PolicyLossFunc(
                    cfg, error_tokens=ErrorTokenConfig(tau=-4.0, behav_gap=0.5)
                )
                losses, err_rates = [], []
                for step in range(steps):
                    batches = _batches(2, seed=step)
                    _fill_log_probs(ddp, loss_fn, batches)
                    opt.zero_grad()
                    store = _run_schedule(ddp, loss_fn, batches)
                    ok, grad_norm, _ = opt.step()
                    assert ok
                    losses.append([m["loss"].item() for m in store] + [float(grad_norm)])
                    err_rates += [m["error_token_rate"].item() for m in store]
                after = gathered_state(ddp)
                changed = sum(not torch.equal(v, after[k]) for k, v in before.items())
                results[kind] = {
                    "losses": losses,
                    "changed": changed,
                    "total": len(before),
                    "err": err_rates,
                }
        return results
    finally:
        destroy_cpu_distributed()


@pytest.mark.slow
def test_tiny_gpt_trains_with_every_kind():
    (res,) = run_distributed(_train_body, 1, 3)
    for kind, r in res.items():
        flat = torch.tensor(r["losses"])
        assert torch.isfinite(flat).all(), (kind, r["losses"])
        assert (flat[:, -1] > 0).all(), (kind, "zero grad norm")
        assert r["changed"] == r["total"], (kind, r["changed"], r["total"])
        assert all(0.0 <= e < 0.5 for e in r["err"]) and max(r["err"]) > 0, (kind, r["err"])
