"""The ``--qrl-*`` options of a slime run: read from slime's ``args`` once, validated, kept there.

slime's Megatron parser drops unknown flags, so the options reach the plugin one of two ways:

- the launcher (``python -m megatron_qrl.integrations.slime.launch``) hands
  :func:`~megatron_qrl.config.add_qrl_args` to slime's ``parse_args(add_custom_arguments=...)``:
  every ``qrl_*`` dest is on ``args``;
- plain ``train.py`` with ``--custom-config-path x.yaml``: slime sets every YAML key on ``args``,
  so ``qrl_loss_kind: acr`` there is ``--qrl-loss-kind acr``; absent keys take the flag defaults.

Both are validated by :func:`~megatron_qrl.config.validate_qrl_args` (presets apply, explicit
values win) plus the slime-specific rules in :func:`slime_problems` (combinations of qrl options
with slime's own flags and with which of our hooks the run names). The result is cached on
``args`` (:data:`OPTIONS_ATTR`), so the loss, run per micro-batch, builds it once per process.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from megatron_qrl.config import QrlArgumentError, add_qrl_args, validate_qrl_args
from megatron_qrl.config.generator import EXPLICIT_ATTR, explicit_dests

PACKAGE = "megatron_qrl.integrations.slime"
LOSS_PATH = f"{PACKAGE}.loss.qrl_policy_loss"
TIS_PATH = f"{PACKAGE}.loss.qrl_tis_function"
INIT_PATH = f"{PACKAGE}.hooks.qrl_megatron_init"
BEFORE_LOG_PROB_PATH = f"{PACKAGE}.hooks.qrl_before_log_prob"
BEFORE_TRAIN_STEP_PATH = f"{PACKAGE}.hooks.qrl_before_train_step"
POSTPROCESS_PATH = f"{PACKAGE}.postprocess.qrl_rollout_data_postprocess"
SPEC = [f"{PACKAGE}.model", "qrl_layer_spec"]
"""Megatron's ``--spec MODULE NAME`` (slime's model provider calls it as ``(args, config, vp_stage)``)."""

OPTIONS_ATTR = "_qrl_slime_options"
WEIGHTED_KINDS = ("decoupled", "tis", "acr")
"""Loss kinds with an importance weight pi_prox / pi_behav: the ones the custom TIS serves."""


@dataclass(frozen=True)
class SlimeQrlOptions:
    """The validated qrl configs of one slime run (``{group key: config dataclass}``)."""

    configs: dict[str, Any]

    @property
    def loss(self) -> Any:
        return self.configs["loss"]

    @property
    def error_tokens(self) -> Any:
        return self.configs["error_tokens"]

    @property
    def rollout(self) -> Any:
        return self.configs["rollout"]

    @property
    def train(self) -> Any:
        return self.configs["train"]

    @property
    def routing(self) -> Any:
        return self.configs["routing"]

    @property
    def uaq(self) -> Any:
        return self.configs["uaq"]

    @property
    def aqn(self) -> Any:
        return self.configs["aqn"]

    @property
    def run(self) -> Any:
        return self.configs["run"]


def _defaults() -> argparse.Namespace:
    return add_qrl_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False)).parse_args([])


def qrl_namespace(args: Any) -> argparse.Namespace:
    """Every ``qrl_*`` value of slime's ``args`` (flag defaults for the absent ones).

    A ``qrl_*`` key no flag generates (a YAML typo) is an error naming the valid keys. Values
    that differ from the default count as explicit, so they win over ``qrl_preset``.
    """
    ns = _defaults()
    known = set(vars(ns))
    given = {k for k in vars(args) if k.startswith("qrl_")}
    unknown = sorted(given - known)
    if unknown:
        raise QrlArgumentError(
            f"unknown qrl option(s) {unknown} on slime's args (from --custom-config-path YAML or "
            f"the launcher); valid keys are the --qrl-* flag dests: {', '.join(sorted(known))}")
    explicit = explicit_dests(args) | {k for k in given if getattr(args, k) != getattr(ns, k)}
    for key in given:
        setattr(ns, key, getattr(args, key))
    setattr(ns, EXPLICIT_ATTR, explicit)
    return ns


def _loss_problems(loss: Any, args: Any) -> list[str]:
    out = []
    per_token = bool(getattr(args, "calculate_per_token_loss", False))
    want = {"token_mean": True, "seq_mean_token_mean": False}.get(loss.aggregation)
    if want is None:
        out.append(f"--qrl-loss-aggregation {loss.aggregation} has no slime reduction; use "
                   "token_mean (with --calculate-per-token-loss) or seq_mean_token_mean (without)")
    elif want != per_token:
        fix = "add --calculate-per-token-loss" if want else "drop --calculate-per-token-loss"
        out.append(f"--qrl-loss-aggregation {loss.aggregation} is slime's "
                   f"{'per-token' if want else 'per-sample'} mean: {fix} (or change the aggregation)")
    for flag, dest, why in (
            ("--use-rollout-logprobs", "use_rollout_logprobs", "it skips the pi_prox recompute the "
             "qrl loss needs; --qrl-loss-kind naive_quant is the ratio against the rollout"),
            ("--use-tis", "use_tis", "slime's TIS acts inside its own PPO loss only; the qrl kinds "
             "tis / acr / decoupled carry the weight"),
            ("--use-kl-loss", "use_kl_loss", "the custom loss owns the KL term: "
             "--qrl-loss-kl-coef (k3 to --ref-load)")):
        if getattr(args, dest, False):
            out.append(f"{flag} with --custom-loss-function-path {LOSS_PATH}: {why}")
    if loss.kl_coef > 0 and not getattr(args, "ref_load", None):
        out.append(f"--qrl-loss-kl-coef {loss.kl_coef} needs slime's reference model: add "
                   "--ref-load")
    return out


def slime_problems(opts: SlimeQrlOptions, args: Any) -> list[str]:
    """Combinations of qrl options with slime's flags that cannot work, each naming the fix."""
    out: list[str] = []
    if (getattr(args, "loss_type", None) == "custom_loss"
            and getattr(args, "custom_loss_function_path", None) == LOSS_PATH):
        out += _loss_problems(opts.loss, args)
    if getattr(args, "custom_tis_function_path", None) == TIS_PATH and opts.loss.kind not in WEIGHTED_KINDS:
        out.append(f"--custom-tis-function-path {TIS_PATH} applies the importance weight of "
                   f"--qrl-loss-kind {' / '.join(WEIGHTED_KINDS)}; got {opts.loss.kind}")
    replay, r3 = opts.routing.replay, bool(getattr(args, "use_rollout_routing_replay", False))
    if replay == "recompute":
        out.append("--qrl-routing-replay recompute has no slime counterpart (slime's R3 replays "
                   "the recompute and the update): use all, i.e. --use-rollout-routing-replay")
    elif replay == "all" and not r3:
        out.append("--qrl-routing-replay all inside slime is slime's own R3 (the rollout's "
                   "expert ids travel with slime's data only then): add --use-rollout-routing-replay")
    if opts.train.moe_experts == "stacked":
        out.append("--qrl-train-moe-experts stacked inside slime: slime's weight update and "
                   "converters read one parameter per expert (mlp.experts.linear_fc1.weight<i>), "
                   "the stacked experts hold one per GEMM; use --qrl-train-moe-experts megatron "
                   "(slime's --moe-grouped-gemm)")
    if opts.train.forward == "aligned" and opts.train.aligned_gemm == "real":
        out.append("--qrl-train-aligned-gemm real: inside slime the aligned linears run the "
                   "fake-quant GEMM (dequantized codes in a BF16 GEMM); use auto or fake")
    if opts.train.forward == "aligned" and list(getattr(args, "spec", None) or []) != SPEC:
        out.append(f"--qrl-train-forward aligned swaps the quantized linears through the layer "
                   f"spec: add --spec {' '.join(SPEC)}")
    needs_init = [f for f, on in (("--qrl-rollout-format " + opts.rollout.format,
                                   opts.rollout.spec.quantizes_weights),
                                  ("--qrl-aqn-enabled", opts.aqn.enabled),
                                  ("--qrl-uaq-scale", opts.uaq.enabled)) if on]
    if needs_init and getattr(args, "custom_megatron_init_path", None) != INIT_PATH:
        out.append(f"{', '.join(needs_init)} need the init hook (weight-sync quantizer, UAQ "
                   f"check): add --custom-megatron-init-path {INIT_PATH}")
    if opts.aqn.enabled and getattr(args, "custom_megatron_before_train_step_hook_path",
                                    None) != BEFORE_TRAIN_STEP_PATH:
        out.append("--qrl-aqn-enabled steps its noise schedule per rollout: add "
                   f"--custom-megatron-before-train-step-hook-path {BEFORE_TRAIN_STEP_PATH}")
    if (opts.error_tokens.action != "none"
            and getattr(args, "rollout_data_postprocess_path", None) != POSTPROCESS_PATH):
        out.append(f"--qrl-error-tokens-action {opts.error_tokens.action} folds the error-token "
                   f"mask into loss_masks: add --rollout-data-postprocess-path {POSTPROCESS_PATH} "
                   "(or set --qrl-error-tokens-action none)")
    return out


def slime_options(args: Any) -> SlimeQrlOptions:
    """The run's qrl options: built, validated and cached on ``args`` at the first call."""
    cached = getattr(args, OPTIONS_ATTR, None)
    if cached is not None:
        return cached
    opts = SlimeQrlOptions(dict(validate_qrl_args(qrl_namespace(args))))
    problems = slime_problems(opts, args)
    if problems:
        raise QrlArgumentError("megatron_qrl in slime: invalid flag combination:\n  - "
                               + "\n  - ".join(problems))
    setattr(args, OPTIONS_ATTR, opts)
    return opts
