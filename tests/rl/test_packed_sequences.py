"""Packed (THD) micro batches (``--qrl-pack-sequences``) == the padded path.

Samples of very different lengths run once as padded ``[B, S]`` micro batches and once packed
(``models.packing``: each micro batch's samples back to back in one row, ``PackedSeqParams``
with ``cu_seqlens``, RoPE and attention restarting per sample). Real tiny Qwen3 / Qwen3-MoE
models built by ``rl.trainer.build_policy`` (local spec, SDPA core attention segment by
segment) on megatron-core CPU/gloo: the logits and entropy on every run position, the pi_prox
log-probs, the step's loss metrics, the grad norm and every gradient must agree up to fp32
summation order — with the padded micro batches of ``--qrl-micro-batch-size`` and with the
token-budget ones, for the dense and the MoE model (routing replay on), and with TP = 2 +
sequence parallelism (the packed length padded by a tail segment).
"""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.models.packing import Packing
from megatron_qrl.rl.batch import split_batch
from megatron_qrl.rl.microbatch import budget_micro_batches, row_lengths
from tests.helpers.mp_utils import run_distributed
from tests.helpers.tiny_hf import tiny_config
from tests.rl.test_token_budget_batches import _batch

VOCAB = 40


def test_packing_index_arithmetic():
    p = Packing.of_lengths([3, 1, 4], width=5, multiple=3)
    assert p.total == 9 and p.cu_seqlens.dtype == torch.int32
    assert p.cu_seqlens.tolist() == [0, 3, 4, 8, 9]  # the tail segment of 1 to reach 9
    assert p.position_ids().tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 0]]
    assert p.max_seqlen == 4 and p.seq_params().qkv_format == "thd"
    x = torch.arange(15).reshape(3, 5)
    assert p.pack(x, fill=-7).tolist() == [[0, 1, 2, 5, 10, 11, 12, 13, -7]]
    y = torch.arange(9.0).reshape(1, 9).requires_grad_()
    back = p.unpack(y)
    assert back.tolist() == [[0, 1, 2, 0, 0], [3, 0, 0, 0, 0], [4, 5, 6, 7, 0]]
    back.sum().backward()
    assert y.grad.tolist() == [[1.0] * 8 + [0.0]]  # the tail feeds nothing
    assert Packing.of_lengths([3, 1, 4], 5).cu_seqlens.tolist() == [0, 3, 4, 8]
    for bad in ([0, 2], [6], []):
        with pytest.raises(ValueError, match="row lengths"):
            Packing.of_lengths(bad, 5)
    with pytest.raises(ValueError, match="expected"):
        p.unpack(torch.zeros(1, 8))


@pytest.fixture(scope="module")
def megatron():
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        yield


def test_sdpa_thd_is_causal_within_each_segment(megatron):
    """SDPACoreAttention on a packed [t, heads, hn] row == its padded path per sample (fp64),
    and no output depends on another sample's tokens."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_qrl.models.sdpa_attention import SDPACoreAttention

    heads, groups, dim, lengths = 4, 2, 8, [5, 1, 7, 3]
    config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=dim, attention_dropout=0.0,
                               use_cpu_initialization=True, params_dtype=torch.float64)
    attn = SDPACoreAttention(config, 1, AttnMaskType.causal, "self")
    p = Packing.of_lengths(lengths, max(lengths), multiple=2)  # 16 tokens: no tail
    g = torch.Generator().manual_seed(0)
    q = torch.randn(p.total, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(p.total, groups, dim, generator=g, dtype=torch.float64,
                        requires_grad=True) for _ in range(2))
    out = attn(q, k, v, None, packed_seq_params=p.seq_params())
    assert out.shape == (p.total, heads * dim)
    cu = p.cu_seqlens.tolist()
    for a, e in zip(cu[:-1], cu[1:]):  # each sample alone, through the padded path
        want = attn(q[a:e, None], k[a:e, None], v[a:e, None], None)[:, 0]
        torch.testing.assert_close(out[a:e], want, rtol=1e-12, atol=1e-12)
    (dk,) = torch.autograd.grad(out[cu[2]:cu[3]].sum(), k)  # sample 2 reads only its own keys
    outside = torch.ones(p.total, dtype=torch.bool)
    outside[cu[2]:cu[3]] = False
    assert dk[outside].abs().max() == 0 and dk[~outside].abs().max() > 0
    bad = p.seq_params()
    bad.cu_seqlens_kv = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_kv == cu_seqlens_q"):
        attn(q, k, v, None, packed_seq_params=bad)
    bad = p.seq_params()
    bad.qkv_format = "sbhd"
    with pytest.raises(ValueError, match="'thd'"):
        attn(q, k, v, None, packed_seq_params=bad)


def _build(moe: bool, pack: bool, seed: int = 0, layout=None, groups=None, bf16: bool = False,
           impl: str = "auto", lr: float = 1e-3, flags: tuple[str, ...] = (), prepare=None):
    """The policy trainer of the tiny model; ``flags``: more ``--qrl-*`` flags (LoRA),
    ``prepare(trainer, configs)``: run on the built trainer (enter LoRA)."""
    from megatron.core import tensor_parallel

    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.forward import forward_plan
    from megatron_qrl.rl.trainer import PolicyTrainer, TrainerOptions, build_policy

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    arch = arch_from_dict(tiny_config("moe" if moe else "dense"), source="tiny")
    configs = parse_configs(["--qrl-model", "tiny-moe" if moe else "tiny-dense",
                             "--qrl-routing-replay", "all" if moe else "off", *flags])[0]
    plan = forward_plan(configs, arch)
    # the load-balancing loss is a function of the set of routed tokens, the padding among
    # them on the padded path: off, so that the gradients compare the policy loss alone
    plan.config_overrides["moe_aux_loss_coeff"] = 0.0
    trainer = PolicyTrainer(build_policy(arch, lr, plan, layout=layout, groups=groups, bf16=bf16,
                                         options=TrainerOptions(transformer_impl=impl,
                                                                per_token_loss=True,
                                                                pack_sequences=pack)))
    if prepare is not None:
        prepare(trainer, configs)
    return trainer


def _train(mbs: list[dict], moe: bool, pack: bool, **kw):
    """pi_prox recompute + one optimizer step; (micro batches with their old log-probs,
    metrics, grad norm, gradients)."""
    from megatron_qrl.losses import PolicyLossConfig
    from megatron_qrl.losses.megatron_adapter import PolicyLossFunc

    trainer = _build(moe, pack, **kw)
    assert trainer.pack_multiple() == (
        (trainer.policy.config.tensor_model_parallel_size if trainer.policy.config.sequence_parallel
         else 1) if pack else None)
    loss_fn = PolicyLossFunc(PolicyLossConfig(kind="tis", aggregation="token_mean"))
    mbs = [dict(mb) for mb in mbs]
    for mb, lp in zip(mbs, trainer.log_probs(mbs, loss_fn)):
        mb["old_log_probs"] = lp
    agreement = trainer.last_routing_agreement
    metrics, grad_norm = trainer.train_step(mbs, loss_fn)
    grads = {k: v.main_grad.detach().clone() for k, v in trainer.module.named_parameters()
             if v.requires_grad}  # (LoRA: the adapters only)
    return mbs, {**metrics, "agreement": agreement}, grad_norm, grads


def _by_row(mbs: list[dict]) -> dict:
    """old log-probs on loss positions, keyed by the row's tokens (rows are distinct)."""
    return {tuple(mb["tokens"][r][mb["loss_mask"][r]].tolist()):
            mb["old_log_probs"][r][mb["loss_mask"][r]] for mb in mbs
            for r in range(mb["tokens"].shape[0])}


def _assert_same(got, want, tol: float = 1e-5):
    (mb_a, m_a, g_a, w_a), (mb_b, m_b, g_b, w_b) = got, want
    a, b = _by_row(mb_a), _by_row(mb_b)
    assert a.keys() == b.keys() and len(a) == sum(mb["tokens"].shape[0] for mb in mb_a)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=tol, atol=tol)
    assert m_a.keys() == m_b.keys()
    for key in m_a:  # loss, entropy, ratios, KLs, clip fractions, routing agreement
        if m_b[key] is None:
            assert m_a[key] is None, key
        else:
            assert m_a[key] == pytest.approx(m_b[key], rel=tol, abs=tol), key
    assert g_a == pytest.approx(g_b, rel=tol)
    for name in w_b:
        torch.testing.assert_close(w_a[name], w_b[name], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_packed_equals_padded(megatron, moe):
    """The same micro batches (metrics are means over micro batches) padded and packed."""
    batch = _batch(moe_layers=2 if moe else 0)
    for mbs in (split_batch(batch, 3), budget_micro_batches(batch, 20)[0]):
        padded = _train(mbs, moe, pack=False)
        _assert_same(_train(mbs, moe, pack=True), padded)
        assert padded[1]["entropy"] > 0 and padded[2] > 0
        assert (padded[1]["agreement"] is not None) == moe


def test_packed_logits_and_entropy_per_position(megatron):
    """The model's own logits on every run position, and the entropy / log-probs that
    ``losses.megatron_adapter.batch_log_probs`` maps back to [B, S]."""
    from megatron_qrl.losses.logprobs import chunked_log_probs
    from megatron_qrl.losses.megatron_adapter import _tp_group, batch_log_probs

    batch = _batch()
    trainer = _build(moe=False, pack=True)
    model = trainer.module
    lengths = row_lengths(batch)
    p = Packing.of_lengths(lengths.tolist(), batch["tokens"].shape[1])
    with torch.no_grad():
        padded = model(batch["tokens"], batch["position_ids"], None)
        packed = model(p.pack(batch["tokens"]), p.position_ids(), None,
                       packed_seq_params=p.seq_params())
    assert packed.shape == (1, int(lengths.sum()), padded.shape[-1])
    run = torch.arange(batch["tokens"].shape[1]) < lengths[:, None]
    torch.testing.assert_close(p.unpack(packed)[run], padded[run], rtol=1e-5, atol=1e-5)

    def fn(x, labels):
        return chunked_log_probs(x, labels, 1.0, _tp_group(), True)

    lp_a, ent_a = batch_log_probs(fn, packed, {**batch, "packing": p})
    lp_b, ent_b = fn(padded, batch["labels"])
    torch.testing.assert_close(lp_a[run], lp_b[run], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_a[run], ent_b[run], rtol=1e-5, atol=1e-5)
    assert lp_a[~run].abs().max() == 0
    from megatron_qrl.rl.steps import _sft_loss  # the warm-up's loss reads the packed logits too

    sft_a, _ = _sft_loss({**batch, "packing": p}, packed)
    assert float(sft_a) == pytest.approx(float(_sft_loss(batch, padded)[0]), rel=1e-5)


def _tp_body(rank, world_size, port):
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.streaming import groups_from_parallel_state

    init_cpu_distributed(rank, world_size, port, tp=2, seed=1234)
    try:
        with cpu_device_mode():
            batch = _batch()
            mbs = split_batch(batch, 3)  # rows 11+2+8 = 21 and 13+5+8 = 26 tokens: a tail of 1
            kw = dict(layout=ParallelLayout(tp=2), groups=groups_from_parallel_state())
            out = {}
            for pack in (False, True):
                mb, metrics, norm, grads = _train(mbs, False, pack, **kw)
                out[pack] = ([m["old_log_probs"] for m in mb], metrics, norm, grads)
        return out
    finally:
        destroy_cpu_distributed()


def test_packed_equals_padded_tp2_sequence_parallel():
    outs = run_distributed(_tp_body, 2)
    batch = split_batch(_batch(), 3)
    for out in outs:
        for mb, a, b in zip(batch, out[True][0], out[False][0]):
            m = mb["loss_mask"]
            torch.testing.assert_close(a[m], b[m], rtol=1e-5, atol=1e-5)
        for key in out[False][1]:
            if out[False][1][key] is not None:
                assert out[True][1][key] == pytest.approx(out[False][1][key], rel=1e-5,
                                                          abs=1e-5), key
        assert out[True][2] == pytest.approx(out[False][2], rel=1e-5)
        for name, g in out[False][3].items():
            torch.testing.assert_close(out[True][3][name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_refusals():
    from megatron_qrl.config import QrlArgumentError
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.micro_forward import forward_step

    assert parse_configs(["--qrl-pack-sequences"])[0]["run"].pack_sequences
    assert not parse_configs([])[0]["run"].pack_sequences
    flags = ["--qrl-train-forward", "aligned", "--qrl-rollout-kv-cache", "fp8_e4m3"]
    with pytest.raises(QrlArgumentError, match="--qrl-pack-sequences cannot run with "
                       "--qrl-train-forward aligned and --qrl-rollout-kv-cache fp8_e4m3"):
        parse_configs(["--qrl-pack-sequences", *flags])
    with pytest.raises(QrlArgumentError) as exc:
        parse_configs(flags)  # the same flags without packing: not this error
    assert "--qrl-pack-sequences" not in str(exc.value)
    with pytest.raises(ValueError, match="KV-cache-aligned core attention"):
        forward_step(iter([_batch()]), torch.nn.Linear(1, 1), loss_fn=None, replay=None,
                     kv=object(), pack=1)


@pytest.mark.slow
def test_qrl_train_packed_equals_padded(tmp_path):
    """qrl-train end to end (tiny MoE, routing replay, BF16 rollouts on the reference engine,
    one warm-up and three RL steps): --qrl-pack-sequences gives the same records (losses,
    KLs, grad norms, rewards, samples) with fewer positions run."""
    import json
    import os
    import subprocess
    import sys

    from tests.helpers import RL_RUN_HELPER

    flags = ["--qrl-preset", "tiny-cpu", "--qrl-rollout-format", "bf16", "--qrl-train-forward",
             "bf16", "--qrl-sft-steps", "1", "--qrl-prompts-per-step", "2",
             "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "6",
             "--qrl-micro-batch-size", "4", "--qrl-updates-per-step", "2", "--qrl-steps", "3",
             "--qrl-save-interval", "-1", "--qrl-lr", "1e-3", "--qrl-no-progress",
             "--no-qrl-tensorboard"]
    runs = []
    for extra in ([], ["--qrl-pack-sequences"]):
        out = tmp_path / f"run{len(runs)}"
        proc = subprocess.run([sys.executable, str(RL_RUN_HELPER), *flags, *extra,
                               "--qrl-output-dir", str(out)], capture_output=True, text=True,
                              timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append([json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()])
    padded, packed = runs
    assert [r["phase"] for r in packed] == ["sft"] + ["rl"] * 3
    for a, b in zip(padded, packed):
        assert a.get("sample") == b.get("sample")
        for key, value in a.items():
            if isinstance(value, float) and not key.startswith("time_") and "gib" not in key:
                # fp32 sums in another order (per-segment attention, no padding) compound
                # over six updates at lr 1e-3: measured up to 9e-5 relative (grad_norm) on
                # one CPU, 7.5e-4 at the last step on an AMD EPYC (AVX-512) one; steps 0-1
                # stay at 3e-4 (attention across packed segments: step 0's grad norm +2.6%)
                rel = 3e-4 if a["step"] <= 1 else 2e-3
                assert b[key] == pytest.approx(value, rel=rel, abs=1e-6), (a["step"], key)
        if a["phase"] == "rl":
            assert b["trained_tokens"] < a["trained_tokens"]
