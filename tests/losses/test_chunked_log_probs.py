"""Chunked vocab-parallel log-probs + entropy (losses.logprobs) against full-vocab references
and against the earlier megatron-core cross-entropy path on a tiny megatron-core GPT (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_qrl.losses import PolicyLossConfig
from megatron_qrl.losses.logprobs import chunked_log_probs
from megatron_qrl.losses.reduce import masked_max
from tests.helpers.mp_utils import run_distributed

V = 37


def _reference(x: torch.Tensor, labels: torch.Tensor, t: float):
    logp = torch.log_softmax(x.double() / t, -1)
    return logp.gather(-1, labels[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def _data(seed: int = 0, shape=(3, 7)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, V, generator=g, dtype=torch.float64) * 4
    labels = torch.randint(0, V, shape, generator=g)
    weights = torch.randn(*shape, generator=g, dtype=torch.float64)
    return x.float(), labels, weights


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [V, 4 * V, 10**6])  # one row, several rows, one chunk
def test_matches_full_vocab_log_softmax(temperature, chunk):
    x, labels, w = _data()
    x.requires_grad_()
    before = x.detach().clone()
    lp, ent = chunked_log_probs(x, labels, temperature, entropy=True, chunk_elements=chunk)
    assert lp.dtype == torch.float32 and lp.shape == labels.shape and not ent.requires_grad
    assert torch.equal(x.detach(), before)  # fp32 logits are not modified in place
    ref_lp, ref_ent = _reference(x.detach(), labels, temperature)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-6, atol=2e-6)
    (grad,) = torch.autograd.grad((lp * w.float()).sum(), x)
    xd = x.detach().double().requires_grad_()
    (ref_grad,) = torch.autograd.grad((_reference(xd, labels, temperature)[0] * w).sum(), xd)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-6, atol=2e-6)


def test_bf16_logits_give_fp32_log_probs_and_bf16_grads():
    x, labels, w = _data(1)
    xb = x.bfloat16().requires_grad_()
    lp, _ = chunked_log_probs(xb, labels, chunk_elements=2 * V)
    (lp * w.float()).sum().backward()
    assert lp.dtype == torch.float32 and xb.grad.dtype == torch.bfloat16
    ref = _reference(xb.detach().double(), labels, 1.0)[0]
    torch.testing.assert_close(lp.double(), ref, rtol=0, atol=1e-5)


def test_bad_input_is_named():
    x, labels, _ = _data()
    with pytest.raises(ValueError, match="temperature"):
        chunked_log_probs(x, labels, 0.0)
    with pytest.raises(ValueError, match="do not match labels"):
        chunked_log_probs(x, labels[:, :3])


def test_masked_max_equals_boolean_indexing():
    g = torch.Generator().manual_seed(3)
    v = torch.randn(5, 9, generator=g) - 10.0  # all negative: a 0-fill would win
    m = torch.rand(5, 9, generator=g) > 0.6
    assert masked_max(v, m).item() == v[m].max().item()
    assert masked_max(v, torch.zeros_like(m)).item() == 0.0


def _tp_body(rank, world_size, port, temperature):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        x, labels, w = _data(2)
        vp = -(-V // world_size)  # last slice shorter: labels of every slice are exercised
        piece = x[..., rank * vp:(rank + 1) * vp].clone().requires_grad_()
        # contiguous slices of equal size: pad the last rank's slice with -inf-like logits
        if piece.shape[-1] < vp:
            pad = torch.full((*piece.shape[:-1], vp - piece.shape[-1]), -1e4)
            piece = torch.cat([piece.detach(), pad], -1).requires_grad_()
        lp, ent = chunked_log_probs(piece, labels, temperature, dist.group.WORLD, True,
                                    chunk_elements=2 * vp)
        (grad,) = torch.autograd.grad((lp * w.float()).sum(), piece)
        return {"lp": lp, "ent": ent, "grad": grad[..., : min(vp, V - rank * vp)]}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_tensor_parallel_slices_equal_the_full_vocabulary(temperature):
    outs = run_distributed(_tp_body, 2, temperature)
    x, labels, w = _data(2)
    xd = x.double().requires_grad_()
    ref_lp, ref_ent = _reference(xd, labels, temperature)
    (ref_grad,) = torch.autograd.grad((ref_lp * w).sum(), xd)
    for out in outs:
        torch.testing.assert_close(out["lp"].double(), ref_lp.detach(), rtol=1e-6, atol=3e-6)
        torch.testing.assert_close(out["ent"].double(), ref_ent.detach(), rtol=1e-6, atol=3e-6)
    grad = torch.cat([o["grad"] for o in outs], -1)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-6, atol=3e-6)


def _gpt_body(rank, world_size, port, tp, temperature):
    import megatron_qrl.losses.logprobs as logprobs
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.losses.megatron_adapter import PolicyLossFunc
    from tests.helpers.megatron_cpu_utils import VOCAB, gathered_state
    from tests.losses.test_megatron_adapter import _batches, _run_schedule

    logprobs.CHUNK_ELEMENTS = 5 * VOCAB // tp  # several chunks per micro batch
    init_cpu_distributed(rank, world_size, port, tp=tp, seed=1234)
    try:
        with cpu_device_mode():
            from tests.helpers.megatron_cpu_utils import build_tiny_gpt

            ddp, _, _ = build_tiny_gpt(tp=tp)
            cfg = PolicyLossConfig(kind="tis", kl_coef=0.0)
            out = {}
            for chunked in (False, True):
                fn = PolicyLossFunc(cfg, temperature=temperature, chunked=chunked)
                batches = _batches(2)
                with torch.no_grad():
                    store = _run_schedule(ddp, fn, batches, forward_only=True, collect=True)
                for b, s in zip(batches, store):
                    b["old_log_probs"] = s["log_probs"]
                    b["rollout_log_probs"] = s["log_probs"] + b["noise"]
                metrics = _run_schedule(ddp, fn, batches)
                grads = {k: v.clone() for k, v in gathered_state(ddp).items()
                         if k.endswith(".grad")}
                out[chunked] = {"old": [s["log_probs"] for s in store], "metrics": metrics,
                                "grads": grads}
        return out
    finally:
        destroy_cpu_distributed()


@pytest.mark.slow
@pytest.mark.parametrize("tp,temperature", [(1, 1.0), (1, 0.8), (2, 1.0)])
def test_tiny_gpt_chunked_equals_megatron_cross_entropy(tp, temperature):
    for out in run_distributed(_gpt_body, tp, tp, temperature):
        old, new = out[False], out[True]
        for a, b in zip(new["old"], old["old"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for m_new, m_old in zip(new["metrics"], old["metrics"]):
            assert m_new.keys() == m_old.keys()
            for key in ("loss", "entropy", "pg_loss", "kl_behav_prox_k3", "ratio_mean"):
                assert m_new[key].item() == pytest.approx(m_old[key].item(), rel=1e-5,
                                                          abs=1e-6), key
        assert old["grads"].keys() == new["grads"].keys()
        for name, g in old["grads"].items():
            torch.testing.assert_close(new["grads"][name], g, rtol=1e-4, atol=1e-6)
        assert sum(g.abs().sum() for g in new["grads"].values()) > 0
