"""H200: --qrl-pack-sequences on the GPU — Transformer Engine's THD attention and the SDPA one.

The CPU tests (tests/rl/test_packed_sequences.py) hold packed == padded in fp32 on the local
spec. Here the same tiny dense / MoE policy, BF16 with fp32 masters as qrl-train builds it on a
GPU, runs the same micro batches padded and packed on ONE model (the option switched between
the runs; the optimizer's lr is 0, so the weights do not move): TE spec (TEDotProductAttention
with ``qkv_format="thd"``, TE's fused THD RoPE) and the local spec (SDPA per segment). The
pi_prox log-probs on every loss position, the loss metrics and the grad norm must agree within
BF16 noise (the packed and padded runs use different attention kernels: varlen vs fixed
length). MoE routers replay the batch's experts (routing replay ``all``): a BF16 rounding
difference must not move a token to another expert and hide the comparison.

Run: ``pytest tests/gpu/test_packed_te.py -s`` (bench/h200.sh ``gpu-tests FILES=...``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from megatron_qrl.rl.batch import split_batch  # noqa: E402
from megatron_qrl.rl.microbatch import budget_micro_batches  # noqa: E402
from tests.rl.test_packed_sequences import _batch, _build  # noqa: E402

HAVE_TE, TE_REASON = False, ""
try:
    import transformer_engine.pytorch  # noqa: F401

    HAVE_TE = True
except Exception as exc:  # noqa: BLE001 - the reason is the skip message
    TE_REASON = f"Transformer Engine does not import: {exc}"


@pytest.fixture(scope="module")
def megatron():
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        yield


def _run(trainer, mbs: list[dict], pack: bool):
    from megatron_qrl.losses import PolicyLossConfig
    from megatron_qrl.losses.megatron_adapter import PolicyLossFunc

    trainer.policy.options = dataclasses.replace(trainer.policy.options, pack_sequences=pack)
    loss_fn = PolicyLossFunc(PolicyLossConfig(kind="tis", aggregation="token_mean"))
    mbs = [dict(mb) for mb in mbs]
    for mb, lp in zip(mbs, trainer.log_probs(mbs, loss_fn)):
        mb["old_log_probs"] = lp.cpu()
    metrics, norm = trainer.train_step(mbs, loss_fn)
    return [mb["old_log_probs"] for mb in mbs], metrics, norm


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_packed_equals_padded_bf16(megatron, impl, moe):
    if impl == "transformer_engine" and not HAVE_TE:
        pytest.skip(TE_REASON)
    batch = _batch(moe_layers=2 if moe else 0)
    trainer = _build(moe, pack=False, bf16=True, impl=impl, lr=0.0)
    for mbs in (split_batch(batch, 3), budget_micro_batches(batch, 20)[0]):
        lp_pad, m_pad, n_pad = _run(trainer, mbs, False)
        lp_thd, m_thd, n_thd = _run(trainer, mbs, True)
        worst = max(float((a - b)[mb["loss_mask"]].abs().max())
                    for mb, a, b in zip(mbs, lp_thd, lp_pad))
        print(f"[packed {impl} {'moe' if moe else 'dense'}] max |dlogp| {worst:.2e}, "
              f"grad norm {n_thd:.6g} vs {n_pad:.6g}, loss {m_thd['loss']:.6g} vs "
              f"{m_pad['loss']:.6g}")
        assert worst < 3e-2  # BF16 logits of a vocab-128 model: ~1e-2 per rounding
        assert n_thd == pytest.approx(n_pad, rel=3e-2)
        for key in ("loss", "entropy", "kl_behav_prox_k3"):
            assert m_thd[key] == pytest.approx(m_pad[key], rel=3e-2, abs=3e-3), key
