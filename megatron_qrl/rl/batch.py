"""Rollouts -> trainer batches (pure tensor functions).

A sample is ``prompt_ids + response_ids`` in one row, right-padded with ``pad_id``. The
trainer's logits at position ``t`` predict token ``t + 1``, so ``labels[t] = tokens[t + 1]``
and ``loss_mask[t]`` is on exactly where ``t + 1`` is a response token; ``rollout_log_probs``
(pi_behav from the engine) sit on the same positions. Right padding never changes the
logits of earlier positions under the causal mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["pack_samples", "pad_to_multiple", "sft_batch", "split_batch"]


def pack_samples(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                 response_logprobs: Sequence[Tensor] | None = None, pad_id: int = 0,
                 routed_experts: Tensor | None = None) -> dict[str, Tensor]:
    """Trainer batch of ``B`` samples: ``tokens``, ``position_ids``, ``labels``, ``loss_mask``
    (bool), ``rollout_log_probs`` (fp32, 0 off-mask) and, if given, ``routed_experts``
    (``[B, S, layers, top_k]``, -1 padded) — all ``[B, S]`` with ``S`` the longest sample.
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"pack_samples: {len(prompt_ids)} prompts but {len(response_ids)} responses")
    if not prompt_ids:
        raise ValueError("pack_samples: empty batch")
    rows = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
    seq = max(len(r) for r in rows)
    b = len(rows)
    tokens = torch.full((b, seq), pad_id, dtype=torch.long)
    labels = torch.full((b, seq), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((b, seq), dtype=torch.bool)
    behav = torch.zeros((b, seq), dtype=torch.float32)
    for i, (p, row) in enumerate(zip(prompt_ids, rows)):
        n, plen = len(row), len(p)
        if plen < 1:
            raise ValueError(f"pack_samples: prompt {i} is empty (it needs at least <bos>)")
        tokens[i, :n] = torch.tensor(row)
        labels[i, : n - 1] = tokens[i, 1:n]
        loss_mask[i, plen - 1: n - 1] = True
        if response_logprobs is not None:
            lp = torch.as_tensor(response_logprobs[i], dtype=torch.float32)[: n - plen]
            behav[i, plen - 1: n - 1] = lp
    batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
             "rollout_log_probs": behav,
             "position_ids": torch.arange(seq).unsqueeze(0).expand(b, seq).contiguous()}
    if routed_experts is not None:
        re = torch.full((b, seq, *routed_experts.shape[2:]), -1, dtype=torch.long)
        keep = min(seq, routed_experts.shape[1])
        re[:, :keep] = routed_experts[:, :keep].long()
        batch["routed_experts"] = re
    return batch


def sft_batch(prompt_ids: Sequence[Sequence[int]], answer_ids: Sequence[Sequence[int]],
              pad_id: int = 0) -> dict[str, Tensor]:
    """Supervised batch: the loss is on the answer tokens (their ``rollout_log_probs`` are 0)."""
    return pack_samples(prompt_ids, answer_ids, None, pad_id)


def split_batch(batch: dict[str, Tensor], size: int) -> list[dict[str, Tensor]]:
    """Consecutive micro batches of ``size`` rows (the batch size must be a multiple)."""
    b = batch["tokens"].shape[0]
    if size < 1 or b % size:
        raise ValueError(f"split_batch: batch of {b} rows does not split into micro batches of "
                         f"{size} (--qrl-micro-batch-size)")
    return [{k: v[i: i + size] for k, v in batch.items()} for i in range(0, b, size)]


def pad_to_multiple(batch: dict[str, Tensor], multiple: int, pad_id: int = 0) -> dict[str, Tensor]:
    """``batch`` right-padded to a sequence length that is a multiple of ``multiple``.

    Sequence parallelism splits the sequence over the TP ranks, so it needs such lengths.
    Padding positions are off ``loss_mask`` and come after every real token, so under the
    causal mask they change no logit of an earlier position: losses and metrics keep their
    values (up to fp32 summation order). ``multiple <= 1`` returns ``batch`` itself.
    """
    s = batch["tokens"].shape[1]
    extra = -s % multiple if multiple > 1 else 0
    if extra == 0:
        return batch
    fill = {"tokens": pad_id, "labels": pad_id, "loss_mask": False, "rollout_log_probs": 0.0,
            "routed_experts": -1}
    out = {}
    for key, value in batch.items():
        if key == "position_ids":
            b = value.shape[0]
            out[key] = torch.arange(s + extra).unsqueeze(0).expand(b, s + extra).contiguous()
            continue
        if key not in fill or value.dim() < 2 or value.shape[1] != s:
            raise ValueError(f"pad_to_multiple: batch key {key!r} is not a [B, S, ...] tensor "
                             "it knows how to pad")
        tail = torch.full((value.shape[0], extra, *value.shape[2:]), fill[key], dtype=value.dtype)
        out[key] = torch.cat([value, tail], dim=1)
    return out
