"""Trainer micro batches by a token budget (``--qrl-max-tokens-per-micro-batch``): no padding waste.

The padded path (:func:`megatron_qrl.rl.batch.split_batch`) cuts the rollout batch into
micro batches of ``--qrl-micro-batch-size`` rows, every row as long as the batch's longest
sample. Here each optimizer step's samples (this data-parallel rank's equal share of them) are
sorted by length, longest first, and grouped greedily so that ``rows x longest row <= budget``
tokens; each micro batch is cut to its own longest row. A row's length is one past its last
loss position: the logits there predict the last label, later positions feed nothing that is
in the loss (causal attention), so every kept log-prob is the padded path's (up to the kernel's
summation order).

The objective must not depend on the grouping: the trainer then normalises the policy loss by
the step's total loss tokens (``TrainerOptions.per_token_loss``, Megatron's
``calculate_per_token_loss``), the global token mean ``sum_{i,t} m l / sum_{i,t} m`` (DAPO's
token-level loss, Yu et al. 2025; docs/ALGORITHMS.md section 1, "token-mean over the batch"), so
only ``--qrl-loss-aggregation token_mean`` is accepted with a budget.

The pi_prox recompute is forward only (no activations kept), so it can run on larger batches
than training: :func:`merge_micro_batches` joins consecutive micro batches up to
``--qrl-log-prob-max-tokens`` (each right-padded to the group's longest: no earlier logit
changes under the causal mask) and says where each one's rows and positions are.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["budget_micro_batches", "merge_micro_batches", "row_lengths"]


def row_lengths(batch: dict[str, Tensor]) -> Tensor:
    """Tokens each row needs: one past its last ``loss_mask`` position (1 for a row without)."""
    mask = batch["loss_mask"].bool()
    s = mask.shape[1]
    pos = torch.arange(1, s + 1).expand_as(mask)
    return (pos * mask).amax(dim=1).clamp_min(1)


_FILL = {"tokens": None, "labels": None, "routed_experts": -1}  # None: pad_id; others 0


def _take(batch: dict[str, Tensor], rows: Tensor, length: int, pad_id: int) -> dict[str, Tensor]:
    """Rows ``rows`` of every key; ``[B, S, ...]`` keys cut (or right-padded) to ``length``."""
    s = batch["tokens"].shape[1]
    out = {}
    for key, value in batch.items():
        v = value[rows]
        if key == "position_ids":
            v = torch.arange(length).unsqueeze(0).expand(len(rows), length)
        elif v.dim() >= 2 and value.shape[1] == s:
            if length <= s:
                v = v[:, :length]
            else:
                fill = _FILL.get(key, 0)
                tail = torch.full((v.shape[0], length - s, *v.shape[2:]),
                                  pad_id if fill is None else fill, dtype=v.dtype)
                v = torch.cat([v, tail], dim=1)
        out[key] = v.contiguous()
    return out


def _group(lengths: list[int], order: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive runs of ``order`` (longest first) with ``rows * first row's length <= max``."""
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def budget_micro_batches(batch: dict[str, Tensor], max_tokens: int, updates: int = 1,
                         dp_size: int = 1, dp_rank: int = 0, seq_multiple: int = 1,
                         pad_id: int = 0) -> list[list[dict[str, Tensor]]]:
    """This data-parallel rank's micro batches of each of ``updates`` optimizer steps.

    The batch's rows split into ``updates`` consecutive mini batches (as the padded path),
    each into ``dp_size`` equal consecutive shares; rank ``dp_rank``'s share is grouped by
    ``max_tokens`` (a longer row gets a micro batch of its own). Lengths are padded to a
    multiple of ``seq_multiple`` (sequence parallelism).
    """
    b = batch["tokens"].shape[0]
    if max_tokens < 1:
        raise ValueError(f"--qrl-max-tokens-per-micro-batch must be >= 1, got {max_tokens}")
    if b % (updates * dp_size):
        raise ValueError(
            f"{b} samples do not split into --qrl-updates-per-step {updates} x {dp_size} "
            "data-parallel ranks; make --qrl-prompts-per-step x "
            "--qrl-rollout-n-samples-per-prompt a multiple of their product")
    lengths = row_lengths(batch).tolist()
    per_update, share = b // updates, b // (updates * dp_size)
    out = []
    for u in range(updates):
        first = u * per_update + dp_rank * share
        rows = list(range(first, first + share))
        order = sorted(rows, key=lambda i: -lengths[i])  # stable: ties keep batch order
        mbs = []
        for group in _group(lengths, order, max_tokens):
            length = lengths[group[0]]
            length += -length % seq_multiple if seq_multiple > 1 else 0
            mbs.append(_take(batch, torch.tensor(group), length, pad_id))
        out.append(mbs)
    return out


def merge_micro_batches(mbs: list[dict[str, Tensor]], max_tokens: int, pad_id: int = 0
                        ) -> tuple[list[dict[str, Tensor]], list[tuple[int, int, int, int]]]:
    """``(merged batches, spans)``: consecutive ``mbs`` joined while ``rows x longest row <=
    max_tokens`` (a micro batch over the budget stays alone), and for each micro batch
    ``(merged index, first row, end row, its length)`` — its log-probs are
    ``out[index][first:end, :length]``."""
    if max_tokens < 1:
        raise ValueError(f"--qrl-log-prob-max-tokens must be >= 1 to merge, got {max_tokens}")
    groups: list[list[int]] = []
    rows = longest = 0  # of the last group
    for i, mb in enumerate(mbs):
        n, length = mb["tokens"].shape[:2]
        if groups and (rows + n) * max(longest, length) <= max_tokens:
            groups[-1].append(i)
            rows, longest = rows + n, max(longest, length)
        else:
            groups.append([i])
            rows, longest = n, length
    merged, spans = [], []
    for g, group in enumerate(groups):
        if len(group) == 1:
            merged.append(mbs[group[0]])
        else:
            width = max(mbs[j]["tokens"].shape[1] for j in group)
            parts = [_take(mbs[j], torch.arange(mbs[j]["tokens"].shape[0]), width, pad_id)
                     for j in group]
            merged.append({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
        first = 0
        for j in group:
            n, length = mbs[j]["tokens"].shape[:2]
            spans.append((g, first, first + n, length))
            first += n
    return merged, spans
