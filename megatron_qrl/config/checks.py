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

__all__ = ["TBPO_AGGREGATIONS", "CheckEnv", "combination_problems", "combination_warnings"]

TBPO_AGGREGATIONS = ("seq_mean_token_mean",)
"""Aggregations allowed with ``--qrl-loss-kind tbpo``. TBPO (QaRL, ALGORITHMS.md section 5)
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


def _inplace_options(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    """Flat buckets, direct expert loads and stacked experts exist in the in-place sync only
    (the default for weight-quantized formats: ``--qrl-rollout-sglang-sync auto``; stacked
    experts need direct expert loads); prefetching in the tensor and in-place syncs. Unset
    options take the engine's default for the sync; what is asked for explicitly must apply."""
    from ..rollout_sglang.sync_policy import OPTION_SYNCS, default_sync  # the engine's rules

    r = c["rollout"]
    resolved = default_sync(r.format) if r.sglang_sync == "auto" else r.sglang_sync
    if r.sglang_prefetch_buckets and resolved not in OPTION_SYNCS["prefetch_buckets"]:
        return (f"--qrl-rollout-sglang-prefetch-buckets applies to the tensor and in-place "
                f"syncs, not --qrl-rollout-sglang-sync {r.sglang_sync}")
    asked = [(f, o) for f, o, on in (
        ("--qrl-rollout-sglang-flat-buckets", "flatten_buckets", r.sglang_flat_buckets is True),
        ("--qrl-rollout-sglang-direct-expert-loads", "direct_expert_loads",
         r.sglang_direct_expert_loads is True),
        ("--qrl-rollout-sglang-stack-experts", "stack_experts",
         r.sglang_stack_experts is True)) if on]
    if not asked:
        return None
    if r.engine != "sglang":
        return f"{' and '.join(f for f, _ in asked)} need --qrl-rollout-engine sglang"
    if r.sglang_stack_experts and r.sglang_direct_expert_loads is False:
        return ("--qrl-rollout-sglang-stack-experts needs direct expert loads (stacked expert "
                "tensors are loaded straight into the FusedMoE parameters); drop "
                "--no-qrl-rollout-sglang-direct-expert-loads or the first")
    flags = [f for f, o in asked if resolved not in OPTION_SYNCS[o]]  # both: in place only
    if not flags:
        return None
    sync = r.sglang_sync if r.sglang_sync != "auto" else f"auto ({resolved} for {r.format})"
    return (f"{' and '.join(flags)} apply to the in-place sync (--qrl-rollout-sglang-sync "
            f"inplace, the default for weight-quantized formats); this run syncs with {sync}")


def _tbpo(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    loss = c.get("loss")
    if loss is None or loss.kind != "tbpo" or loss.aggregation in TBPO_AGGREGATIONS:
        return None
    return (f"--qrl-loss-kind tbpo is sequence-level and needs --qrl-loss-aggregation "
            f"{' or '.join(TBPO_AGGREGATIONS)} (got {loss.aggregation}); add "
            f"--qrl-loss-aggregation {TBPO_AGGREGATIONS[0]}")


def _aligned(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    fmt = c["rollout"].format
    if c["train"].forward != "aligned" or get_spec(fmt).quantizes_weights:
        return None
    quantized = [n for n in list_specs() if get_spec(n).quantizes_weights]
    return (f"--qrl-train-forward aligned needs a quantized --qrl-rollout-format (one of "
            f"{', '.join(quantized)}), got {fmt}; use --qrl-train-forward bf16 with {fmt} rollouts")


def _routing(c: Mapping[str, Any], env: CheckEnv) -> str | None:
    replay, model = c["routing"].replay, c["run"].model
    if replay == "off":
        return None
    if model == "tiny-dense" or (env.model_config is not None and not is_moe_config(env.model_config)):
        which = "--qrl-model tiny-dense" if model == "tiny-dense" else f"--qrl-checkpoint {c['run'].checkpoint}"
        return (f"--qrl-routing-replay {replay} needs an MoE model, but {which} is dense (no "
                "num_experts); use --qrl-routing-replay off")
    return None


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


CHECKS: tuple[Callable[[Mapping[str, Any], CheckEnv], str | None], ...] = (
    _w4a4, _sglang_gpu, _inplace_options, _tbpo, _aligned, _routing, _uaq, _batches,
    lora_problem,
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
