"""--qrl-log-prob-max-tokens: the pi_prox recompute on joined micro batches equals it per micro batch."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_qrl.config import QrlArgumentError, QrlConfigs
from megatron_qrl.rl.batch import pack_samples
from megatron_qrl.rl.microbatch import budget_micro_batches, merge_micro_batches
from tests.helpers.mp_utils import run_distributed

ROOT = Path(__file__).resolve().parents[2]
PAD = 0


def _batch(lengths, vocab=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (3,), generator=g).tolist() for _ in lengths]
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]
    lps = [-torch.rand(n, generator=g) for n in lengths]
    experts = torch.randint(0, 4, (len(lengths), 3 + max(lengths), 2, 2), generator=g)
    batch = pack_samples(prompts, responses, lps, PAD, experts)
    batch["advantages"] = torch.randn(len(lengths), generator=g)
    return batch


def test_grouping_spans_and_padding():
    (mbs,) = budget_micro_batches(_batch([9, 2, 7, 4, 1, 5]), max_tokens=24)
    shapes = [tuple(mb["tokens"].shape) for mb in mbs]
    merged, spans = merge_micro_batches(mbs, 30, PAD)
    assert len(spans) == len(mbs) and len(merged) < len(mbs)
    for mb, (g, first, end, length) in zip(mbs, spans):
        assert (end - first, length) == tuple(mb["tokens"].shape)
        m = merged[g]
        assert m["tokens"].shape[0] * m["tokens"].shape[1] <= 30 or m["tokens"].shape[0] == end - first
        for key in ("tokens", "labels", "loss_mask", "rollout_log_probs", "routed_experts"):
            assert torch.equal(m[key][first:end, :length], mb[key]), key
        assert torch.equal(m["advantages"][first:end], mb["advantages"])
        tail = m["tokens"][first:end, length:]
        assert (tail == PAD).all() and not m["loss_mask"][first:end, length:].any()
        assert (m["routed_experts"][first:end, length:] == -1).all()
        assert torch.equal(m["position_ids"][0], torch.arange(m["tokens"].shape[1]))
    # a budget below every micro batch leaves them as they are
    same, spans = merge_micro_batches(mbs, 1, PAD)
    assert [tuple(m["tokens"].shape) for m in same] == shapes
    assert all(s[1] == 0 for s in spans)
    with pytest.raises(ValueError, match="--qrl-log-prob-max-tokens"):
        merge_micro_batches(mbs, 0, PAD)


def test_flag_is_validated():
    from megatron_qrl.rl.cli import parse_configs

    configs = parse_configs(["--qrl-log-prob-max-tokens", "4096"])[0]
    assert configs["run"].log_prob_max_tokens == 4096
    with pytest.raises(QrlArgumentError, match="--qrl-log-prob-max-tokens"):
        parse_configs(["--qrl-log-prob-max-tokens", "-1"])


def _body(rank, world_size, port):
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.losses import PolicyLossConfig
    from megatron_qrl.losses.megatron_adapter import PolicyLossFunc
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.rl.steps import recompute_log_probs
    from megatron_qrl.rl.trainer import PolicyTrainer, build_policy

    init_cpu_distributed(rank, world_size, port, tp=1, seed=1234)
    try:
        with cpu_device_mode():
            cfg = json.loads((ROOT / "megatron_qrl/data/configs/tiny_qwen3.json").read_text())
            trainer = PolicyTrainer(build_policy(arch_from_dict(cfg, source="tiny"), 1e-3))
            batch = _batch([11, 3, 8, 8, 1, 6, 10, 2], vocab=cfg["vocab_size"])
            batch.pop("routed_experts")  # dense model
            (mbs,) = budget_micro_batches(batch, max_tokens=30)
            loss_fn = PolicyLossFunc(PolicyLossConfig(kind="tis"))
            out = {}
            for budget in (0, 60, 10**6):
                run = SimpleNamespace(log_prob_max_tokens=budget)
                ctx = SimpleNamespace(configs=QrlConfigs(run=run),
                                      tokenizer=SimpleNamespace(pad_id=PAD), trainer=trainer,
                                      loss_fn=loss_fn)
                out[budget] = recompute_log_probs(ctx, mbs)
            out["shapes"] = [tuple(mb["tokens"].shape) for mb in mbs]
        return out
    finally:
        destroy_cpu_distributed()


def test_merged_recompute_equals_per_micro_batch():
    (out,) = run_distributed(_body, 1)
    assert len(out["shapes"]) > 2
    for budget in (60, 10**6):
        assert [tuple(x.shape) for x in out[budget]] == out["shapes"]
        for a, b in zip(out[budget], out[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
