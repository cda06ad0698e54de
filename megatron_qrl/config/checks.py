"""Cross-field checks of the built ``--qrl-*`` configs: impossible combinations.

Each check is a small pure function ``(configs, env) -> problem text or None``; every
problem names the flags involved and the fix. :func:`combination_problems` runs them all so
``validate_qrl_args`` can raise ONE error listing every problem.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..quant import get_spec, list_specs
from ..quant.uaq import UAQ_MAX_LR, AlreadyScaledError, check_not_already_scaled
from .checkpoint_info import is_moe_config
from .lora_checks import lora_problem

__all__ = ["TBPO_AGGREGATIONS", "CheckEnv", "combination_problems", "combination_warnings",
           "prox_first_blocker", "prox_from_first_update"]

TBPO_AGGREGATIONS = ("seq_mean_token_mean",)
"""Aggregations allowed with ``--qrl-loss-kind tbpo``. TBPO (QaRL, docs/ALGORITHMS.md section 5)
is a sequence-level objective ``J = mean_i(m_i w_i L_i)``: one term per sequence, averaged
over sequences. The sequence-level aggregation is the one whose outer reduction is a plain
mean over sequences with each sequence weighted equally, ``seq_mean_token_mean``; applied to
a per-sequence term broadcast over its tokens it gives exactly ``J``. ``token_mean`` weights
sequences by their length and ``seq_mean_token_sum_norm`` by length / max length, so both
contradict ``J`` (and the KL term would be reduced differently from the policy term)."""


@dataclass(frozen=True)
class CheckEnv:
    """What the checks know about the machine and the starting model."""

    gpu_capability: tuple[int, int] | None
    """CUDA compute capability of the local GPU; None without a GPU."""
    checkpoint_metadata: Mapping[str, Any] | None
    """Metadata of the starting checkpoint (``uaq_scale``), None for a fresh model."""
    model_config: Mapping[str, Any] | None
    """HF config dict of the model to train; None if unknown."""


def _w4a4(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    r = c["rollout"]
    if not r.nvfp4_w4a4:
        return None
    if r.format != "nvfp4":
        return f"--qrl-rollout-nvfp4-w4a4 needs --qrl-rollout-format nvfp4 (got {r.format})"
    if env.gpu_capability is None or env.gpu_capability[0] < 10:
        have = "no CUDA GPU" if env.gpu_capability is None else "compute capability {}.{}".format(*env.gpu_capability)
        return ("--qrl-rollout-format nvfp4 with --qrl-rollout-nvfp4-w4a4 (FP4 activations) needs "
                f"a Blackwell GPU (compute capability >= 10.0); this machine has {have}. Drop "
                "--qrl-rollout-nvfp4-w4a4 to run NVFP4 weight-only (W4A16)")
    if r.engine != "sglang":
        return ("--qrl-rollout-nvfp4-w4a4 needs --qrl-rollout-engine sglang: the reference engine "
                "has no FP4 activation path (the nvfp4 QuantSpec is weight-only)")
    return None


def _sglang_gpu(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    if c["rollout"].engine == "sglang" and env.gpu_capability is None:
        return ("--qrl-rollout-engine sglang needs a CUDA GPU and there is none here; use "
                "--qrl-rollout-engine reference on CPU")
    return None


def _sglang_options(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    """The SGLang options' own rules for the format
    (:meth:`~megatron_qrl.rollout_sglang.options.SGLangOptions.problem`: which sync paths
    work, which speed options apply to which path); with another engine, speed options
    asked for explicitly are an error."""
    r = c["rollout"]
    if r.engine == "sglang":
        return r.sglang.problem(r.format)
    if r.sglang.kv_cache != "bf16":
        return (f"--qrl-rollout-kv-cache {r.sglang.kv_cache} needs --qrl-rollout-engine sglang "
                "(the reference engine keeps K/V in the model dtype)")
    asked = [f"--qrl-rollout-sglang-{name.replace('_', '-')}" for name in
             ("flat_buckets", "direct_expert_loads", "stack_experts")
             if getattr(r.sglang, name) is True]
    return f"{' and '.join(asked)} need --qrl-rollout-engine sglang" if asked else None


def _tbpo(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    loss = c.get("loss")
    if loss is None or loss.kind != "tbpo" or loss.aggregation in TBPO_AGGREGATIONS:
        return None
    return (f"--qrl-loss-kind tbpo is sequence-level and needs --qrl-loss-aggregation "
            f"{' or '.join(TBPO_AGGREGATIONS)} (got {loss.aggregation}); add "
            f"--qrl-loss-aggregation {TBPO_AGGREGATIONS[0]}")


def _aligned(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    fmt, kv = c["rollout"].format, c["rollout"].sglang.kv_cache
    if c["train"].forward != "aligned" or get_spec(fmt).quantizes_weights or kv != "bf16":
        return None
    quantized = [n for n in list_specs() if get_spec(n).quantizes_weights]
    return (f"--qrl-train-forward aligned needs a quantized --qrl-rollout-format (one of "
            f"{', '.join(quantized)}) or --qrl-rollout-kv-cache, got {fmt}; use "
            f"--qrl-train-forward bf16 with {fmt} rollouts")


def _routing(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    replay, model = c["routing"].replay, c["run"].model
    if replay == "off":
        return None
    if model == "tiny-dense" or (env.model_config is not None and not is_moe_config(env.model_config)):
        which = "--qrl-model tiny-dense" if model == "tiny-dense" else f"--qrl-checkpoint {c['run'].checkpoint}"
        return (f"--qrl-routing-replay {replay} needs an MoE model, but {which} is dense (no "
                "num_experts); use --qrl-routing-replay off")
    return None


def prox_first_blocker(c: Mapping[str, Any]) -> str | None:
    """Why the first update's forward is not pi_prox's forward (so it cannot stand in for the
    pi_prox recompute, ``--qrl-prox-from-first-update``), naming the flag; None if it is.

    Audited (everything else that reads pi_prox does so per micro batch inside the loss, after
    the forward that now supplies it: decoupled PPO / TIS / ACR / TBPO ratios, error tokens,
    the mismatch metrics, entropy; the token-budget normaliser counts the loss mask of each
    micro batch as Megatron's schedule runs it). Two settings make the update forward differ
    from the recompute forward by more than float noise:

    - ``--qrl-routing-replay recompute``: the recompute replays the rollout's experts, the
      update routes by itself;
    - ``--qrl-lora-dropout`` > 0: the update runs in train mode and drops adapter inputs, the
      recompute (eval mode) does not.

    (Megatron's sinkhorn router, also train-mode dependent, cannot be built here:
    ``--moe-router-load-balancing-type`` is fixed to aux_loss.)"""
    if c["routing"].replay == "recompute":
        return ("--qrl-routing-replay recompute replays the rollout's routing in the recompute "
                "only; the update forward routes by itself")
    lora = c.get("lora")
    if lora is not None and lora.enabled and lora.dropout > 0:
        return (f"--qrl-lora-dropout {lora.dropout} drops adapter inputs in the update forward "
                "(train mode), not in the recompute")
    return None


def prox_from_first_update(c: Mapping[str, Any]) -> bool:
    """Whether the first update's own forward gives its pi_prox: ``--qrl-prox-from-first-update``
    as given, or unset (auto) on wherever :func:`prox_first_blocker` finds nothing against it."""
    asked = c["run"].prox_from_first_update
    return prox_first_blocker(c) is None if asked is None else bool(asked)


def _prox_first(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    why = prox_first_blocker(c)
    if c["run"].prox_from_first_update is not True or why is None:
        return None
    return (f"--qrl-prox-from-first-update takes pi_prox from the first update's forward, but "
            f"{why}; drop --qrl-prox-from-first-update (unset, it falls back to the recompute "
            "pass by itself)")


def _uaq(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    if not c["uaq"].enabled or env.checkpoint_metadata is None:
        return None
    try:
        check_not_already_scaled(env.checkpoint_metadata, source=f"--qrl-checkpoint {c['run'].checkpoint}")
    except AlreadyScaledError as exc:
        return f"--qrl-uaq-scale {c['uaq'].scale}: {exc}"
    return None


def _batches(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    run, n = c["run"], c["rollout"].n_samples_per_prompt
    total = run.prompts_per_step * n
    if total % run.updates_per_step == 0 and (total // run.updates_per_step) % run.micro_batch_size == 0:
        return None
    return (f"the rollout batch (--qrl-prompts-per-step {run.prompts_per_step} x "
            f"--qrl-rollout-n-samples-per-prompt {n} = {total} responses) must split into "
            f"--qrl-updates-per-step {run.updates_per_step} mini batches, each a multiple of "
            f"--qrl-micro-batch-size {run.micro_batch_size}")


def _token_budget(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    agg = getattr(c.get("loss"), "aggregation", "token_mean")
    if c["run"].max_tokens_per_micro_batch and agg != "token_mean":
        return (f"--qrl-max-tokens-per-micro-batch {c['run'].max_tokens_per_micro_batch} "
                "normalises the loss by the step's tokens (the global token mean); it needs "
                f"--qrl-loss-aggregation token_mean, not {agg}")
    return None


def _packing(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    """The KV-cache-aligned core attention (te_quant.kv_core_attention) is padded-only."""
    from ..quant.kv_cache import get_kv_format

    kv = c["rollout"].sglang.kv_cache
    if not getattr(c["run"], "pack_sequences", False) or c["train"].forward != "aligned" or \
            not get_kv_format(kv).quantizes:
        return None
    return (f"--qrl-pack-sequences cannot run with --qrl-train-forward aligned and "
            f"--qrl-rollout-kv-cache {kv}: the KV-cache-aligned attention takes padded micro "
            "batches only; drop --qrl-pack-sequences (or use --qrl-max-tokens-per-micro-batch "
            "for less padding)")


def _fleet_split(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    """Engine TP / EP / DP attention against the model, where its config is known (the
    fleet checks it again when it starts, for the tiny models too)."""
    r = c["rollout"]
    if r.engine != "sglang" or env.model_config is None or (
            r.engine_tp == 1 and r.engine_ep == 1 and not r.engine_dp_attention):
        return None
    from ..rollout.fleet_layout import engine_parallel  # (as config.run: kept out of the block)

    try:
        engine_parallel(dict(env.model_config), r.engine_tp, r.engine_ep, r.engine_dp_attention)
    except ValueError as exc:
        return str(exc)
    return None


CHECKS: tuple[Callable[[Mapping[str, Any], CheckEnv], str | None], ...] = (
    _w4a4, _sglang_gpu, _sglang_options, _tbpo, _aligned, _routing, _prox_first, _uaq, _batches,
    lora_problem, _token_budget, _packing, _fleet_split,
)


def combination_problems(configs: Mapping[str, Any], env: CheckEnv) -> list[str]:
    """Every impossible combination in ``configs`` (built dataclasses keyed by group)."""
    return [p for p in (check(configs, env) for check in CHECKS) if p]


def combination_warnings(configs: Mapping[str, Any]) -> list[str]:
    """Legal but doubtful combinations; emitted as ``UserWarning`` by ``validate_qrl_args``."""
    out = []
    run, loss, aqn = configs["run"], configs.get("loss"), configs.get("aqn")
    if configs["uaq"].enabled and run.lr >= UAQ_MAX_LR:
        out.append(f"--qrl-uaq-scale {configs['uaq'].scale} with --qrl-lr {run.lr}: QuRL turns UAQ "
                   f"off at lr >= {UAQ_MAX_LR} (the update already exceeds the rounding step)")
    if aqn is not None and aqn.enabled and loss is not None and loss.kind in ("ppo_clip", "naive_quant"):
        out.append(f"--qrl-aqn-enabled with --qrl-loss-kind {loss.kind}: nothing corrects the "
                   "rollout noise; QeRL pairs AQN with an importance weight (decoupled/tis/acr)")
    for text in out:
        warnings.warn(text, UserWarning, stacklevel=3)
    return out
