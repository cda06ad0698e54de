"""Token-budget micro batches (rl.microbatch) == the padded path: log-probs, loss, gradients.

A batch of samples of very different lengths is trained once in padded micro batches of 2 rows
(every row as long as the longest sample) and once grouped by a token budget (rows sorted by
length, each micro batch cut to its longest row), both with the global token-mean loss
(``TrainerOptions.per_token_loss``). Log-probs on every loss position, the step's loss metrics,
the grad norm and the gradients must agree up to fp32 summation order.
"""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.rl.batch import pack_samples, split_batch
from megatron_qrl.rl.microbatch import budget_micro_batches, row_lengths


def _batch(seed: int = 0, b: int = 6, moe_layers: int = 0, vocab: int = 40) -> dict:
    """Six rows of different prompt / response lengths; ``moe_layers``: the engine's routed
    experts too (tests/rl/test_packed_sequences.py)."""
    g = torch.Generator().manual_seed(seed)
    plens, rlens = [3, 2, 5, 2, 4, 3][:b], [9, 1, 4, 12, 2, 6][:b]
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in plens]
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in rlens]
    lps = [-torch.rand(n, generator=g) for n in rlens]
    routed = None
    if moe_layers:  # the engine's experts (top-2 of 8) of every token but the last sampled one
        s = max(p + r for p, r in zip(plens, rlens))
        routed = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(b * s * moe_layers)])
        routed = routed.reshape(b, s, moe_layers, 2)
        for i, (p, r) in enumerate(zip(plens, rlens)):
            routed[i, p + r - 1:] = -1
    batch = pack_samples(prompts, responses, lps, pad_id=0, routed_experts=routed)
    batch["advantages"] = torch.randn(b, generator=g)
    return batch


def test_grouping_respects_the_budget_and_keeps_every_row_once():
    batch = _batch()
    lengths = row_lengths(batch)
    assert lengths.tolist() == [11, 2, 8, 13, 5, 8]  # prompt + response - 1
    groups = budget_micro_batches(batch, 16, updates=2)
    assert len(groups) == 2
    seen = []
    for u, mbs in enumerate(groups):
        for mb in mbs:
            rows, s = mb["tokens"].shape
            assert rows == 1 or rows * s <= 16
            assert mb["position_ids"].shape == (rows, s) and mb["advantages"].shape == (rows,)
            assert mb["loss_mask"][:, s - 1].any()  # cut to its longest row, not shorter
            for r in range(rows):  # each row is one of this update's rows, unchanged
                match = [i for i in range(3 * u, 3 * u + 3)
                         if torch.equal(batch["tokens"][i, :s], mb["tokens"][r])
                         and int(batch["loss_mask"][i].sum()) == int(mb["loss_mask"][r].sum())]
                assert match
                seen.append(match[0])
    assert sorted(seen) == list(range(6))
    dp = budget_micro_batches(batch, 1000, updates=1, dp_size=2, dp_rank=1, seq_multiple=4)
    assert [mb["tokens"].shape for mb in dp[0]] == [(3, 16)]  # rows 3..5, 13 -> 16
    with pytest.raises(ValueError, match="--qrl-updates-per-step"):
        budget_micro_batches(batch, 16, updates=4)


@pytest.fixture(scope="module")
def megatron():
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        yield


def _train(mbs: list[dict], seed: int = 0):
    from megatron.core import tensor_parallel

    from megatron_qrl.data import tiny_dense_config
    from megatron_qrl.losses import PolicyLossConfig
    from megatron_qrl.losses.megatron_adapter import PolicyLossFunc
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.rl.trainer import PolicyTrainer, TrainerOptions, build_policy

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    arch = arch_from_dict(tiny_dense_config(40))
    trainer = PolicyTrainer(build_policy(arch, 1e-3, options=TrainerOptions(per_token_loss=True)))
    loss_fn = PolicyLossFunc(PolicyLossConfig(kind="ppo_clip", aggregation="token_mean"))
    mbs = [dict(mb) for mb in mbs]
    for mb, lp in zip(mbs, trainer.log_probs(mbs, loss_fn)):
        mb["old_log_probs"] = lp
    metrics, grad_norm = trainer.train_step(mbs, loss_fn)
    grads = {k: v.main_grad.detach().clone() for k, v in trainer.module.named_parameters()}
    return mbs, metrics, grad_norm, grads


def _by_row(mbs: list[dict]) -> dict:
    """old log-probs on loss positions, keyed by the row's tokens (rows are distinct)."""
    return {tuple(mb["tokens"][r][mb["loss_mask"][r]].tolist()):
            mb["old_log_probs"][r][mb["loss_mask"][r]] for mb in mbs
            for r in range(mb["tokens"].shape[0])}


def test_budget_path_equals_padded_path(megatron):
    batch = _batch()
    padded, m_pad, g_pad, w_pad = _train(split_batch(batch, 2))
    budget, m_bud, g_bud, w_bud = _train(budget_micro_batches(batch, 20)[0])
    assert sum(mb["tokens"].numel() for mb in budget) < sum(mb["tokens"].numel() for mb in padded)
    a, b = _by_row(padded), _by_row(budget)
    assert a.keys() == b.keys() and len(a) == 6
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-5)
    assert g_bud == pytest.approx(g_pad, rel=1e-5)
    for name in w_pad:  # the gradients of the step (Adam's first update is sign-like: not compared)
        torch.testing.assert_close(w_bud[name], w_pad[name], rtol=1e-4, atol=1e-7, msg=name)
