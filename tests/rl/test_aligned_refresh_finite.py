"""A NaN weight under the aligned forward stops the trainer's step with NonFiniteError naming
the parameter, now that the Q(W) refresh's finiteness is read once per refresh
(``te_quant.state``: at the end of ``PolicyTrainer._run``) instead of per linear."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.op_census import BASE, VARIANTS, micro_batch, model_config  # noqa: E402

NAME = r"fp8: decoder\.layers\.0\.self_attention\.linear_proj\.weight holds NaN / Inf"


def _trainer():
    from megatron_qrl.losses.megatron_adapter import PolicyLossFunc
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.forward import forward_plan
    from megatron_qrl.rl.trainer import PolicyTrainer, TrainerOptions, build_policy

    configs = parse_configs([*BASE, *VARIANTS["aligned-fp8"]])[0]
    cfg = model_config(1, 8, 2)
    arch = arch_from_dict(cfg, source="test")
    torch.manual_seed(0)
    trainer = PolicyTrainer(build_policy(arch, 1e-4, forward_plan(configs, arch),
                                         options=TrainerOptions(transformer_impl="local")))
    return trainer, PolicyLossFunc(configs["loss"], configs["error_tokens"]), cfg


@pytest.mark.parametrize("how", ["update with guard", "update", "recompute"])
def test_nan_weight_stops_the_step_naming_it(megatron, how):
    """The error names the parameter and comes before any update is applied. ``update with
    guard`` fails on ``check_finite`` left out of ``PolicyTrainer._run`` (the guard reads the
    NaN loss and merely skips the update); ``update`` without a guard is then still caught
    by the optimizer's pre-step hook; ``recompute`` (no step) fails on that mutation too."""
    from megatron_qrl.rl.guard import BadStepGuard
    from megatron_qrl.utils.finite import NonFiniteError

    trainer, loss_fn, cfg = _trainer()
    trainer.guard = BadStepGuard(5, log=lambda _: None) if how.endswith("guard") else None
    proj = trainer.module.decoder.layers[0].self_attention.linear_proj
    with torch.no_grad():
        proj.weight[1, 2] = float("nan")
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    mb = micro_batch(cfg, 2, 16)
    with pytest.raises(NonFiniteError, match=NAME):
        if how == "recompute":
            trainer.log_probs([mb], loss_fn)
        else:
            trainer.train_step([mb], loss_fn)
    after = dict(trainer.module.named_parameters())
    assert all(torch.equal(p.nan_to_num(), after[n].detach().nan_to_num())
               for n, p in before.items())
    assert trainer.policy.plan.aligned.version == 0
