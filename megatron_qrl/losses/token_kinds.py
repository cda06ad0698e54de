"""Token-level policy objectives: PPO-clip, naive-quant, decoupled PPO, TIS, ACR.

Every kind is the same clipped surrogate with three kind-specific ingredients, built by one
registered function each (no ``if kind == ...`` chain in the loss):

    per-token loss  l_t = -w_t * min(R_t A_t, clip(R_t, 1 - eps_low, U_t) A_t)

- ``log R``: log of the ratio whose gradient trains pi_theta,
- ``w``: the importance weight (no gradient),
- ``U``: the upper clip bound.

Notation (docs/ALGORITHMS.md): lp = log pi_theta, lprox = log pi_prox, lbehav = log pi_behav,
d = lprox - lbehav (the train/rollout mismatch of the sampled token).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_qrl.losses.config import PolicyLossConfig
from megatron_qrl.losses.reduce import LOG_CLAMP, safe_exp


@dataclass(frozen=True)
class TokenTerms:
    """Kind-specific ingredients of the clipped surrogate, all shaped ``[batch, seq]``."""

    log_ratio: Tensor
    """log R (carries the gradient of log_probs)."""
    weight: Tensor
    """Importance weight w (no gradient)."""
    upper: Tensor
    """Upper clip bound U on R."""


TermsFn = Callable[[Tensor, Tensor, Tensor, PolicyLossConfig], TokenTerms]
TOKEN_KINDS: dict[str, TermsFn] = {}


def register_token_kind(name: str) -> Callable[[TermsFn], TermsFn]:
    """Register the terms function of a token-level kind; duplicate names are rejected."""

    def deco(fn: TermsFn) -> TermsFn:
        if name in TOKEN_KINDS:
            raise ValueError(f"token-level loss kind {name!r} is already registered")
        TOKEN_KINDS[name] = fn
        return fn

    return deco


def _const(like: Tensor, value: float) -> Tensor:
    return torch.full_like(like, value)


@register_token_kind("ppo_clip")
def ppo_clip_terms(lp: Tensor, lprox: Tensor, lbehav: Tensor, cfg: PolicyLossConfig) -> TokenTerms:
    """PPO-clip / GRPO (Schulman et al. 2017 eq. 7; DAPO clip-higher): R = pi_theta/pi_prox,
    w = 1, U = 1 + eps_high. Ignores pi_behav."""
    return TokenTerms(lp - lprox, _const(lprox, 1.0), _const(lprox, 1.0 + cfg.eps_high))


@register_token_kind("naive_quant")
def naive_quant_terms(
    lp: Tensor, lprox: Tensor, lbehav: Tensor, cfg: PolicyLossConfig
) -> TokenTerms:
    """QuRL eq. 3 (known to collapse; ablation): R = pi_theta/pi_behav, w = 1, U = 1+eps_high."""
    return TokenTerms(lp - lbehav, _const(lbehav, 1.0), _const(lbehav, 1.0 + cfg.eps_high))


@register_token_kind("decoupled")
def decoupled_terms(lp: Tensor, lprox: Tensor, lbehav: Tensor, cfg: PolicyLossConfig) -> TokenTerms:
    """Decoupled PPO, QuRL eq. 4 (Hilton et al. 2022): R = pi_theta/pi_prox,
    w = pi_prox/pi_behav (untruncated; exp of d clamped at +-20 for finiteness), U = 1+eps_high."""
    return TokenTerms(lp - lprox, safe_exp(lprox - lbehav), _const(lprox, 1.0 + cfg.eps_high))


@register_token_kind("tis")
def tis_terms(lp: Tensor, lprox: Tensor, lbehav: Tensor, cfg: PolicyLossConfig) -> TokenTerms:
    """Truncated IS, QuRL eq. 5 (FlashRL): w = min(pi_prox/pi_behav, C), R and U as decoupled."""
    log_cap = math.log(cfg.tis_cap)
    weight = torch.exp((lprox - lbehav).clamp(-LOG_CLAMP, log_cap))
    return TokenTerms(lp - lprox, weight, _const(lprox, 1.0 + cfg.eps_high))


@register_token_kind("acr")
def acr_terms(lp: Tensor, lprox: Tensor, lbehav: Tensor, cfg: PolicyLossConfig) -> TokenTerms:
    """Adaptive clipping range, QuRL eq. 7-9: w = min(pi_prox/pi_behav, C) as TIS and
    U = (1 + eps_high) / r with r = pi_behav / max(pi_behav, pi_prox/C) = min(1, C pi_behav/pi_prox).

    In logs: log(1/r) = max(0, d - log C), so U = (1+eps_high) exactly where d <= log C (plain
    TIS) and grows as the truncation deepens (exponent clamped at 20).
    """
    log_cap = math.log(cfg.tis_cap)
    d = lprox - lbehav
    weight = torch.exp(d.clamp(-LOG_CLAMP, log_cap))
    inv_r = torch.exp((d - log_cap).clamp(0.0, LOG_CLAMP))
    return TokenTerms(lp - lprox, weight, (1.0 + cfg.eps_high) * inv_r)


def clipped_surrogate(
    terms: TokenTerms, adv: Tensor, cfg: PolicyLossConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss ``-w * min(R A, clip(R, 1-eps_low, U) A)`` (+ dual clip for A < 0).

    Dual clip (Ye et al. 2020, docs/ALGORITHMS.md section 1): for A < 0 the surrogate becomes
    ``max(min(R A, clip(R) A), c A)``. Returns the per-token loss and boolean event masks
    (``clip_low``, ``clip_high``, ``dual_clip``) for the metrics.
    """
    ratio = torch.exp(terms.log_ratio.clamp(-LOG_CLAMP, LOG_CLAMP))
    lower = torch.full_like(ratio, 1.0 - cfg.eps_low)
    clipped_ratio = torch.minimum(torch.maximum(ratio, lower), terms.upper)
    surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
    events = {
        "clip_low": (adv < 0) & (ratio < lower),
        "clip_high": (adv > 0) & (ratio > terms.upper),
        "ratio": ratio.detach(),
    }
    if cfg.dual_clip_c is not None:
        floor = cfg.dual_clip_c * adv
        events["dual_clip"] = (adv < 0) & (surrogate < floor)
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, floor), surrogate)
    else:
        events["dual_clip"] = torch.zeros_like(events["clip_low"])
    return -terms.weight * surrogate, events
