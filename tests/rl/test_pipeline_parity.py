"""Pipeline parallelism (PP = 2) in the trainer == one stage (PP = 1), on megatron-core CPU/gloo.

The tiny Qwen3 / Qwen3-MoE models (2 layers: one per stage) are built by
``rl.trainer.build_policy`` from the same full HF weights (``models.streaming.load_hf_weights``
puts each stage's layers under their global names), then run the pi_prox recompute (forward
only: the log-probs come from the last stage) and one optimizer step through megatron-core's
1F1B schedule, for every loss kind, error tokens, the rollout-aligned forward, routing replay,
tied embeddings and LoRA (dense; MoE with expert adapters). Compared with the PP = 1 run: the
recomputed log-probs, the loss metrics (broadcast from the last stage), routing agreement (each
stage's MoE layers), the fingerprints a reference engine holds after a weight sync (int8
packing with AQN noise; each stage streams its own tensors to rank 0: the loaded weights, or
for LoRA ``rl.lora_sync`` before and after the update: frozen base + adapters, then noisy norm
gains + adapters, the expert adapters merged into their modules by the stage that holds them),
the grad norm, every gradient after megatron's reduction (``main_grad``; for tied embeddings
the first stage's embedding and the last stage's copy both hold the sum) and every updated
parameter. Fingerprints are compared bit for bit: each stage packs the same tensors.

Tolerance: PP splits the same per-layer computation over two processes and sends the fp32
activations unchanged, so each layer runs the same kernels on the same inputs; what may differ
is the order of fp32 sums that cross stages (the grad norm's sum of squares is summed per
stage, then over stages). Measured here the results agree to ~1e-7 relative; the bounds
(``TOL`` = 1e-5 on values, ``PARAM_TOL`` on parameters) leave room for another BLAS and
are far below the change one update makes (checked: the parameters moved by > 1e-4).
"""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.rl.batch import split_batch
from tests.helpers.mp_utils import run_distributed
from tests.helpers.tiny_hf import tiny_config
from tests.rl.test_token_budget_batches import _batch

TOL = 1e-5
PARAM_TOL = 1e-6
"""Largest |difference| of an updated parameter (lr 1e-3: an update moves a weight ~1e-3)."""
STEP = ["--qrl-rollout-format", "int8", "--qrl-train-forward", "bf16"]
DENSE = ["--qrl-model", "tiny-dense", "--qrl-routing-replay", "off"]
MOE = ["--qrl-model", "tiny-moe", "--qrl-routing-replay", "all"]
CASES: dict[str, tuple[bool, list[str], dict]] = {
    **{f"dense-{k}": (False, [*DENSE, "--qrl-loss-kind", k], {})
       for k in ("ppo_clip", "naive_quant", "decoupled", "tis", "acr")},
    "dense-tbpo": (False, [*DENSE, "--qrl-loss-kind", "tbpo", "--qrl-loss-aggregation",
                           "seq_mean_token_mean"], {}),
    "dense-tied-error-tokens": (False, [*DENSE, "--qrl-loss-kind", "tis",
                                        "--qrl-error-tokens-tau", "-0.5",
                                        "--qrl-error-tokens-behav-gap", "0.0"],
                                {"tie_word_embeddings": True}),
    "dense-aligned": (False, [*DENSE, "--qrl-train-forward", "aligned", "--qrl-loss-kind",
                              "acr"], {}),
    "dense-lora": (False, [*DENSE, "--qrl-lora-rank", "4", "--qrl-loss-kind", "tis"], {}),
    "moe-lora-experts": (True, [*MOE, "--qrl-lora-rank", "4", "--qrl-lora-experts",
                                "--qrl-loss-kind", "tis"], {}),
    **{f"moe-{k}": (True, [*MOE, "--qrl-loss-kind", k], {})
       for k in ("ppo_clip", "decoupled", "tis", "acr")},
    "moe-aligned-replay-recompute": (True, [*MOE[:3], "recompute", "--qrl-train-forward",
                                            "aligned", "--qrl-loss-kind", "tis"], {}),
}


def _hf_weights(arch, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random full HF tensors of ``arch`` (norm gains around 1)."""
    from megatron_qrl.models.mapping import expected_hf_shapes

    g = torch.Generator().manual_seed(seed)
    return {n: (1.0 + 0.2 * torch.randn(s, generator=g)) if n.endswith("norm.weight")
            else 0.1 * torch.randn(s, generator=g) for n, s in expected_hf_shapes(arch).items()}


def _case(moe: bool, flags: list[str], overrides: dict, groups) -> dict:
    """Build, recompute pi_prox, one update; this rank's results under global names."""
    from megatron.core import tensor_parallel

    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.models.stages import global_name
    from megatron_qrl.models.streaming import load_hf_weights
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.forward import forward_plan
    from megatron_qrl.rl.lora_sync import enter_lora
    from megatron_qrl.rl.steps import make_loss_fn
    from megatron_qrl.rl.trainer import PolicyTrainer, build_policy

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    arch = arch_from_dict(tiny_config("moe" if moe else "dense", **overrides), source="tiny")
    configs = parse_configs([*STEP, *flags, "--qrl-sft-steps", "0"])[0]
    plan = forward_plan(configs, arch)
    plan.config_overrides["moe_aux_loss_coeff"] = 0.0  # (padding tokens are routed too)
    stage = None if groups is None else groups.stage
    layout = None if groups is None else ParallelLayout(pp=stage.size)
    trainer = PolicyTrainer(build_policy(arch, 1e-3, plan, layout=layout, groups=groups))
    load_hf_weights(trainer.module, arch, _hf_weights(arch).__getitem__, groups)
    plan.weights_changed()
    if plan.lora is not None:
        enter_lora(trainer, configs)
        trainer.policy.set_optimizer(trainer.policy.new_optimizer(1e-3))
        _set_adapters(trainer.module, stage)
    start = {global_name(n, stage): p.detach().clone()
             for n, p in trainer.module.named_parameters()}
    hf_config = tiny_config("moe" if moe else "dense", **overrides)
    lora = _LoraEngine(trainer, configs, hf_config) if plan.lora is not None else None
    held = _sync(trainer, configs, hf_config) if lora is None else lora.sync(1)
    loss_fn = make_loss_fn(configs)
    mbs = split_batch(_batch(moe_layers=arch.num_layers if moe else 0, vocab=arch.vocab_size), 2)
    g = torch.Generator().manual_seed(1)
    for mb, lp in zip(mbs, trainer.log_probs(mbs, loss_fn)):
        mb["old_log_probs"] = lp  # the rollout's pi_behav: near pi_prox, as a rollout's is
        mb["rollout_log_probs"] = lp + 0.05 * torch.randn(lp.shape, generator=g)
    agreement = trainer.last_routing_agreement
    metrics, grad_norm = trainer.train_step(mbs, loss_fn)
    if lora is not None:
        held = lora.close(held, lora.sync(2))
    named = list(trainer.module.named_parameters())
    return {"log_probs": [mb["old_log_probs"] for mb in mbs], "agreement": agreement,
            "metrics": metrics, "grad_norm": grad_norm,
            "grads": {global_name(n, stage): p.main_grad.detach().clone() for n, p in named
                      if p.requires_grad},
            "params": {global_name(n, stage): p.detach().clone() for n, p in named},
            "start": start, "held": held}


def _set_adapters(module, stage) -> None:
    """Adapters drawn from their global name (a random init draws them in build order,
    which differs per stage); B != 0 so that A gets gradients too."""
    import zlib

    from megatron_qrl.models.stages import global_name

    with torch.no_grad():
        for n, p in module.named_parameters():
            if ".lora_" in n:
                g = torch.Generator().manual_seed(zlib.crc32(global_name(n, stage).encode()))
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def _sync(trainer, configs: dict, hf_config: dict) -> dict[str, str] | None:
    """A weight sync (int8 packing, AQN noise) of the loaded weights into a reference engine
    on rank 0: its fingerprints (None on the other ranks, which stream their stage there)."""
    import torch.distributed as dist

    from megatron_qrl.quant.aqn import AQNConfig
    from megatron_qrl.rl.sync import make_engine, sync_weights

    if dist.get_rank() != 0:
        for _ in trainer.hf_tensors():
            pass
        return None
    engine = make_engine(configs["rollout"], hf_config, 0)
    try:
        sync_weights(trainer.hf_tensors(), engine, configs["rollout"].spec, 1,
                     AQNConfig(enabled=True), seed=0, aqn_step=5, total_steps=10)
        return engine.held_checksums()
    finally:
        engine.shutdown()


class _LoraEngine:
    """A reference engine on rank 0 kept in sync with a LoRA trainer by ``rl.lora_sync``
    (the other ranks take part through ``LoraSync.consume``); AQN on."""

    def __init__(self, trainer, configs: dict, hf_config: dict) -> None:
        import torch.distributed as dist

        from megatron_qrl.rl.lora_sync import LoraSync
        from megatron_qrl.rl.sync import make_engine
        from megatron_qrl.rollout.lora_serving import resolve_lora_serving

        lora, rollout = configs["lora"], configs["rollout"]
        serving = resolve_lora_serving("reference", rollout.format, lora.targets,
                                       is_moe=trainer.policy.arch.is_moe, experts=lora.experts)
        self.trainer, self.spec, self.lora = trainer, rollout.spec, LoraSync(lora, serving)
        self.engine = make_engine(rollout, hf_config, 0) if dist.get_rank() == 0 else None

    def sync(self, version: int) -> list[dict[str, str]] | None:
        """Sync ``version``; rank 0: the engine's base and adapter fingerprints after it."""
        from megatron_qrl.quant.aqn import AQNConfig

        aqn = AQNConfig(enabled=True)
        if self.engine is None:
            self.lora.consume(self.trainer, aqn, 5, 10)
            return None
        self.lora.send(self.trainer, self.engine, self.spec, version, aqn, 0, 5, 10)
        return [self.engine.held_checksums(), self.engine.held_lora_checksums()]

    def close(self, first: list | None, second: list | None) -> list | None:
        """Both syncs' fingerprints (rank 0; None elsewhere); the engine shut down."""
        if self.engine is None:
            return None
        self.engine.shutdown()
        return first + second


def _body(rank, world_size, port, pp: int, names: list[str]) -> dict:
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.models.streaming import groups_from_parallel_state

    init_cpu_distributed(rank, world_size, port, pp=pp, seed=0)
    try:
        with cpu_device_mode():
            groups = groups_from_parallel_state(2) if pp > 1 else None
            return {n: _case(*CASES[n], groups) for n in names}
    finally:
        destroy_cpu_distributed()


def _merged(ranks: list[dict], key: str) -> dict[str, torch.Tensor]:
    """The stages' ``key`` dicts as one; a name on two stages (the tied copy) must agree."""
    out: dict[str, torch.Tensor] = {}
    for r in ranks:
        for name, t in r[key].items():
            if name in out:
                torch.testing.assert_close(t, out[name], rtol=0, atol=0, msg=name)
            out[name] = t
    return out


def _assert_parity(ref: dict, stages: list[dict], name: str) -> None:
    for got in stages:  # every stage holds the last stage's log-probs and metrics
        for a, b in zip(got["log_probs"], ref["log_probs"], strict=True):
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=name)
        assert got["metrics"].keys() == ref["metrics"].keys(), name
        for key, value in ref["metrics"].items():
            assert got["metrics"][key] == pytest.approx(value, rel=TOL, abs=TOL), (name, key)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=TOL), name
        if ref["agreement"] is None:
            assert got["agreement"] is None, name
        else:
            assert got["agreement"] == pytest.approx(ref["agreement"], rel=TOL), name
    if isinstance(ref["held"], list):  # LoRA: base, adapters; after the update: both again
        assert stages[0]["held"] == ref["held"] and all(ref["held"]), name
        assert ref["held"][3] != ref["held"][1], name  # the update moved the adapters
    elif ref["held"] is not None:  # the engine's fingerprints: every tensor, bit for bit
        assert stages[0]["held"] == ref["held"] and len(ref["held"]) > 10, name
    grads, params = _merged(stages, "grads"), _merged(stages, "params")
    tied = "output_layer.weight" in params and "output_layer.weight" not in ref["params"]
    if tied:  # the last stage's copy of the tied embedding: the same weight and gradient
        torch.testing.assert_close(params.pop("output_layer.weight"),
                                   ref["params"]["embedding.word_embeddings.weight"])
        torch.testing.assert_close(grads.pop("output_layer.weight"),
                                   ref["grads"]["embedding.word_embeddings.weight"],
                                   rtol=TOL, atol=1e-7)
    assert grads.keys() == ref["grads"].keys() and params.keys() == ref["params"].keys(), name
    for key, g in ref["grads"].items():
        torch.testing.assert_close(grads[key], g, rtol=TOL, atol=1e-7, msg=f"{name}: {key}")
        assert g.abs().max() > 0, (name, key)
    for key, p in ref["params"].items():
        torch.testing.assert_close(params[key], p, rtol=0, atol=PARAM_TOL,
                                   msg=f"{name}: {key}")


GROUPS = {"dense-losses": [n for n in CASES if n.startswith("dense-") and
                            n.split("-", 1)[1] in ("ppo_clip", "naive_quant", "decoupled", "tis",
                                                   "acr", "tbpo")],
          "dense-features": ["dense-tied-error-tokens", "dense-aligned", "dense-lora"],
          "moe": [n for n in CASES if n.startswith("moe-")]}
"""Cases run together (one spawn of each layout)."""


@pytest.mark.slow
@pytest.mark.parametrize("group", list(GROUPS))
def test_pp2_equals_pp1(group):
    names = GROUPS[group]
    assert sorted(n for g in GROUPS.values() for n in g) == sorted(CASES)
    (ref,) = run_distributed(_body, 1, 1, names)
    stages = run_distributed(_body, 2, 2, names)
    for name in names:
        _assert_parity(ref[name], [s[name] for s in stages], name)
        moved = max(float((ref[name]["params"][k] - w).abs().max())
                    for k, w in ref[name]["start"].items())
        assert moved > 1e-4, name  # the update moved the weights (far above PARAM_TOL)
    if group == "dense-features":  # error tokens flagged, not all
        assert 0 < ref["dense-tied-error-tokens"]["metrics"]["error_improbable_rate"] < 1
    if group == "moe":  # the expert adapters were merged: the experts' packs changed
        held = ref["moe-lora-experts"]["held"]
        assert any(held[2][k] != v for k, v in held[0].items() if ".experts." in k)
        assert all(ref[n]["agreement"] is not None for n in names)
        assert ref["moe-tis"]["agreement"] < 1.0  # recompute: replayed; update: own routing

