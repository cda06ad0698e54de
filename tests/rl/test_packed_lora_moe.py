"""Packed (THD) micro batches (``--qrl-pack-sequences``) == the padded path, for a LoRA policy
and for a tiny MoE at TP = 2 (sequence parallel) and EP = 2.

The pattern and helpers of ``tests/rl/test_packed_sequences.py``: real tiny Qwen3 /
Qwen3-MoE policies from ``rl.trainer.build_policy`` (local spec, SDPA core attention per
``cu_seqlens`` segment) on megatron-core CPU/gloo, the same micro batches run padded and
packed; the pi_prox log-probs, the step's loss metrics, the grad norm and every gradient must
agree up to fp32 summation order.

LoRA (``--qrl-lora-rank``; ``models.lora``): the policy enters LoRA as the driver does
(``rl.lora_sync.enter_lora``: the base frozen in ``--qrl-lora-base-format bf16`` storage — the
parameter dtype, fp32 here, no fake-quant rounding — adapters on), ``B`` drawn at random so the
adapters move the logits and both factors get gradients; only adapters may have gradients.

MoE (routing replay on): TP = 2 with ETP = 2 (megatron's default; ETP 1 with EP 1 is refused,
``rl.trainer._check_expert_layout``), with and without LoRA; EP = 2 with each data-parallel
rank its own samples (the packed length equalised over the dispatcher's ranks).
"""

from __future__ import annotations

import torch

from megatron_qrl.rl.batch import split_batch
from megatron_qrl.rl.microbatch import budget_micro_batches
from tests.helpers.mp_utils import run_distributed
from tests.rl.test_packed_sequences import _assert_same, _batch, _train

LORA = ("--qrl-lora-rank", "4", "--qrl-lora-alpha", "8", "--qrl-lora-base-format", "bf16",
        "--qrl-train-forward", "bf16")
LR = 1e-3


def test_packing_at_least_grows_the_tail():
    """``Packing.of_lengths(at_least=)``: the packed length the other ranks run."""
    import pytest

    from megatron_qrl.models.packing import Packing

    p = Packing.of_lengths([3, 1], width=4, multiple=2, at_least=8)
    assert p.total == 8 and p.cu_seqlens.tolist() == [0, 3, 4, 8] and p.max_seqlen == 4
    assert Packing.of_lengths([3, 2], width=4, multiple=2, at_least=4).total == 6  # longer
    with pytest.raises(ValueError, match="divide at_least"):
        Packing.of_lengths([3, 1], width=4, multiple=2, at_least=7)


def _lora_on(trainer, configs) -> None:
    """Enter LoRA RL as the driver's ``_start_rl`` does, with random ``B`` (seeded per name)."""
    from megatron_qrl.rl.lora_sync import enter_lora

    assert enter_lora(trainer, configs) > 0 and trainer.policy.plan.lora.active
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(trainer.module.named_parameters())):
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
    trainer.policy.set_optimizer(trainer.policy.new_optimizer(LR))


def _assert_adapter_grads(grads: dict) -> None:
    """Gradients of adapters only, every factor kind moved (B != 0: A's gradient too)."""
    assert grads and all(".lora_A." in k or ".lora_B." in k for k in grads), sorted(grads)[:4]
    for factor in (".lora_A.", ".lora_B."):
        assert max(float(g.abs().max()) for k, g in grads.items() if factor in k) > 0, factor


def test_lora_packed_equals_padded_dense(megatron):
    batch = _batch()
    for mbs in (split_batch(batch, 3), budget_micro_batches(batch, 20)[0]):
        padded = _train(mbs, False, pack=False, flags=LORA, prepare=_lora_on)
        _assert_adapter_grads(padded[3])
        _assert_same(_train(mbs, False, pack=True, flags=LORA, prepare=_lora_on), padded)
        assert padded[1]["entropy"] > 0 and padded[2] > 0


def test_lora_packed_equals_padded_moe(megatron):
    """LoRA on attention + the experts (``--qrl-lora-experts``), routing replay on."""
    batch = _batch(moe_layers=2)
    flags = (*LORA, "--qrl-lora-experts")
    mbs = split_batch(batch, 3)
    padded = _train(mbs, True, pack=False, flags=flags, prepare=_lora_on)
    _assert_adapter_grads(padded[3])
    assert any(".experts." in k for k in padded[3]) and padded[1]["agreement"] is not None
    _assert_same(_train(mbs, True, pack=True, flags=flags, prepare=_lora_on), padded)


def _parallel_body(rank, world_size, port, tp: int, ep: int, lora: bool):
    """Both paths on this rank. TP: the same micro batches on both ranks. EP = 2: the ranks
    are data parallel too, each with its own three one-row micro batches (packed rows of
    other lengths than the other rank's: megatron's all-gather token dispatcher needs equal
    ones, ``rl.micro_forward.pack_group``)."""
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.streaming import groups_from_parallel_state

    etp = tp  # megatron's default (the driver's too): experts split like the dense layers
    init_cpu_distributed(rank, world_size, port, tp=tp, ep=ep, etp=etp, seed=1234)
    try:
        with cpu_device_mode():
            mbs = split_batch(_batch(moe_layers=2), 3)  # 21 and 26 tokens: a tail of 1 at TP 2
            if ep > 1:  # packed rows of 11, 8, 5 tokens on rank 0; 2, 13, 8 on rank 1
                mbs = split_batch(_batch(moe_layers=2), 1)[rank::2]
            kw = dict(layout=ParallelLayout(tp=tp, ep=ep, etp=etp),
                      groups=groups_from_parallel_state())
            if lora:
                kw.update(flags=(*LORA, "--qrl-lora-experts"), prepare=_lora_on)
            return {pack: _train(mbs, True, pack, **kw) for pack in (False, True)}
    finally:
        destroy_cpu_distributed()


def _check_ranks(outs: list[dict], lora: bool) -> None:
    for out in outs:
        _assert_same(out[True], out[False])
        assert out[False][1]["agreement"] is not None and out[False][2] > 0
        if lora:
            _assert_adapter_grads(out[False][3])


def test_moe_packed_equals_padded_tp2_sequence_parallel():
    """TP = 2 + SP (the packed row padded by a tail segment to a multiple of 2; each rank's
    routers replay their slice of the packed row), without and with LoRA."""
    _check_ranks(run_distributed(_parallel_body, 2, 2, 1, False), lora=False)
    _check_ranks(run_distributed(_parallel_body, 2, 2, 1, True), lora=True)


def test_moe_packed_equals_padded_ep2():
    """EP = 2 (4 of the 8 experts per rank, tokens exchanged by the dispatcher) and data
    parallel 2 (each rank its own samples); before ``pack_group`` the ranks' packed rows of
    different lengths broke the dispatcher's all-gather (gloo: a size mismatch)."""
    outs = run_distributed(_parallel_body, 2, 1, 2, False)
    _check_ranks(outs, lora=False)
    assert len(outs[0][False][3]) == len(outs[1][False][3])  # every rank: its own experts


def test_moe_layout_with_unsummed_expert_gradients_is_refused():
    """TP 2 + SP with ETP 1 and EP 1 (how the TP test above first ran): megatron-core leaves
    the experts' gradients out of every reduction over the TP ranks, each holding the partial
    sum of its token slice, and the expert copies drift apart (about 2 lr after one step)."""
    import pytest

    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.rl.trainer import _check_expert_layout, build_policy
    from tests.helpers.tiny_hf import tiny_config

    moe, dense = (arch_from_dict(tiny_config(k), source="tiny") for k in ("moe", "dense"))
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size 2 \\(the default\\)"):
        build_policy(moe, LR, layout=ParallelLayout(tp=2, etp=1))
    for arch, layout in ((moe, ParallelLayout(tp=2, etp=2)), (moe, ParallelLayout(tp=2, ep=2)),
                         (moe, ParallelLayout(tp=2, etp=1, sequence_parallel=False)),
                         (dense, ParallelLayout(tp=2, etp=1)), (moe, None)):
        _check_expert_layout(arch, layout)
