"""Error tokens in quantized rollouts (QaRL, docs/ALGORITHMS.md section 5).

Long low-bit rollouts drift into repetitive or garbled text that the full-precision trainer
finds very improbable. A token is flagged when either

(a) repetition: it lies inside a span where an n-gram (1 <= n <= ``max_ngram``) repeats at
    least ``min_repeats`` times back to back and the repeated span has at least
    ``min_span_tokens`` tokens (our reading: the span floor keeps short legitimate repeats
    such as "000" or "\\n\\n" from being flagged; the paper gives no thresholds); or
(b) improbable: ``logp_prox < tau`` while ``logp_behav - logp_prox > behav_gap`` (the engine
    picked, with much higher probability, a token the trainer finds improbable).

Flagged tokens are masked out of the loss, or their whole sequences are dropped
(``action``). Rates are reported as metrics every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_qrl.losses.reduce import masked_mean

ERROR_TOKEN_ACTIONS = ("none", "mask", "drop_sequence")


@dataclass
class ErrorTokenConfig:
    """Error-token detection (QaRL) thresholds and what to do with flagged tokens."""

    action: str = "mask"
    """none (report the rate only), mask (drop flagged tokens from the loss) or
    drop_sequence (drop every sequence containing a flagged token)."""

    max_ngram: int = 16
    """Longest n-gram checked for consecutive repetition."""

    min_repeats: int = 3
    """An n-gram repeated back to back at least this many times is a repetition."""

    min_span_tokens: int = 12
    """...and only if the repeated span covers at least this many tokens."""

    tau: float = -10.0
    """Improbable-token threshold on logp_prox (natural log)."""

    behav_gap: float = 5.0
    """...flagged only if logp_behav - logp_prox exceeds this (nats)."""

    def __post_init__(self) -> None:
        if self.action not in ERROR_TOKEN_ACTIONS:
            raise ValueError(
                f"ErrorTokenConfig.action={self.action!r}: expected one of {ERROR_TOKEN_ACTIONS}"
            )
        if self.max_ngram < 1 or self.min_repeats < 2 or self.min_span_tokens < 1:
            raise ValueError(
                "ErrorTokenConfig: need max_ngram >= 1, min_repeats >= 2, min_span_tokens >= 1 "
                f"(got {self.max_ngram}, {self.min_repeats}, {self.min_span_tokens})"
            )
        if self.behav_gap < 0:
            raise ValueError(f"ErrorTokenConfig.behav_gap={self.behav_gap}: must be >= 0")


def _run_lengths(flags: Tensor) -> Tensor:
    """Length of the run of True containing each position (0 where False), along dim -1."""
    idx = torch.arange(flags.shape[-1], device=flags.device).expand_as(flags)
    last_false = torch.where(~flags, idx, torch.full_like(idx, -1)).cummax(dim=-1).values
    fwd = idx - last_false
    rev = flags.flip(-1)
    last_false_rev = torch.where(~rev, idx, torch.full_like(idx, -1)).cummax(dim=-1).values
    bwd = (idx - last_false_rev).flip(-1)
    return torch.where(flags, fwd + bwd - 1, torch.zeros_like(fwd))


def repetition_mask(
    token_ids: Tensor, valid: Tensor, max_ngram: int, min_repeats: int, min_span_tokens: int
) -> Tensor:
    """Tokens inside a back-to-back repetition of an n-gram (see the module docstring).

    For period n, ``eq[t] = tok[t] == tok[t+n]``; a run of ``L`` such matches starting at a
    covers the periodic span ``a .. a+L+n-1`` (``(L+n)/n`` repeats). It is flagged when
    ``L >= (min_repeats-1) n`` and ``L + n >= min_span_tokens``. Invalid tokens break runs.
    All periods at once, ``[batch, periods, seq]`` (``eq`` is False past ``seq - n``, which
    ends a run where the row of period n ends): a fixed number of ops, not one set per period.
    """
    seq = token_ids.shape[-1]
    top = min(max_ngram, seq - 1)
    if top < 1:
        return torch.zeros_like(valid) & valid
    dev = token_ids.device
    n = torch.arange(1, top + 1, device=dev).unsqueeze(1)  # [N, 1]
    pos = torch.arange(seq, device=dev)
    ahead = pos + n  # [N, S]: t + n
    inside = ahead < seq
    ahead = ahead.clamp_max(seq - 1)
    b = token_ids.shape[0]
    eq = ((token_ids.unsqueeze(1) == token_ids[:, ahead]) & valid.unsqueeze(1)
          & valid[:, ahead] & inside)  # [B, N, S]
    run = _run_lengths(eq)
    hit = (run >= (min_repeats - 1) * n) & (run + n >= min_span_tokens) & eq
    behind = pos - n  # flagged[t + n] |= hit[t]: read hit at t - n
    shifted = hit.gather(-1, behind.clamp_min(0).expand(b, -1, -1)) & (behind >= 0)
    return (hit | shifted).any(1) & valid


def improbable_token_mask(
    old_log_probs: Tensor, rollout_log_probs: Tensor, valid: Tensor, tau: float, behav_gap: float
) -> Tensor:
    """``logp_prox < tau`` and ``logp_behav - logp_prox > behav_gap`` on valid tokens."""
    lprox, lbehav = old_log_probs.detach().float(), rollout_log_probs.detach().float()
    return valid & (lprox < tau) & (lbehav - lprox > behav_gap)


def detect_error_tokens(
    token_ids: Tensor,
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    loss_mask: Tensor | None = None,
    cfg: ErrorTokenConfig | None = None,
) -> Tensor:
    """Bool mask ``[batch, seq]`` of error tokens: repetition (a) OR improbable (b)."""
    cfg = cfg or ErrorTokenConfig()
    valid = torch.ones_like(token_ids, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    rep = repetition_mask(token_ids, valid, cfg.max_ngram, cfg.min_repeats, cfg.min_span_tokens)
    bad = improbable_token_mask(old_log_probs, rollout_log_probs, valid, cfg.tau, cfg.behav_gap)
    return rep | bad


def filter_error_tokens(
    token_ids: Tensor,
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    loss_mask: Tensor,
    cfg: ErrorTokenConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detect error tokens, apply ``cfg.action`` to ``loss_mask`` and report the rates.

    Returns ``(new_loss_mask (bool), metrics)`` with metrics ``error_token_rate`` (flagged /
    valid tokens), ``error_repetition_rate``, ``error_improbable_rate``, ``error_seq_rate``
    (sequences with a flagged token / non-empty sequences) and ``error_dropped_token_frac``
    (valid tokens removed from the loss).
    """
    valid = loss_mask.bool()
    rep = repetition_mask(token_ids, valid, cfg.max_ngram, cfg.min_repeats, cfg.min_span_tokens)
    bad = improbable_token_mask(old_log_probs, rollout_log_probs, valid, cfg.tau, cfg.behav_gap)
    err = rep | bad
    seq_has_err = err.any(dim=-1)
    if cfg.action == "mask":
        new_mask = valid & ~err
    elif cfg.action == "drop_sequence":
        new_mask = valid & ~seq_has_err.unsqueeze(-1)
    else:
        new_mask = valid
    metrics = {
        "error_token_rate": masked_mean(err.float(), valid),
        "error_repetition_rate": masked_mean(rep.float(), valid),
        "error_improbable_rate": masked_mean(bad.float(), valid),
        "error_seq_rate": masked_mean(seq_has_err.float(), valid.any(dim=-1)),
        "error_dropped_token_frac": masked_mean((valid & ~new_mask).float(), valid),
    }
    return new_mask, metrics
