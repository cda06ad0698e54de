"""Per-token log-probs and entropy of vocab-parallel logits, chunked over tokens.

For logits ``x`` ``[..., V / TP]`` (this rank's vocabulary slice), temperature ``T`` and
``z = x / T``:

    log p(y) = z_y - logsumexp(z)                       (softmax, Bridle 1990)
    H        = logsumexp(z) - sum_v softmax(z)_v z_v    (Shannon entropy of the softmax)
    d log p(y) / d x_v = (onehot(y)_v - softmax(z)_v) / T

with the max / sum-exp / target-logit reductions all-reduced over the tensor-parallel group
(Megatron-LM's vocab-parallel cross entropy, Shoeybi et al. 2019 section 3; the full
vocabulary is never gathered). The forward visits the logits in chunks of rows, so only one
chunk is ever held in fp32; the backward recomputes the chunk's softmax from the logits it
kept (their own dtype, e.g. BF16) and the saved ``logsumexp``. Megatron-core's
``vocab_parallel_cross_entropy`` on a fp32 copy instead keeps the fp32 softmax of the whole
micro batch for the backward, and an entropy metric computed beside it makes four more fp32
copies: for Qwen3's 151,936-token vocabulary and 4,096 tokens a fp32 copy is 2.5 GB.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["CHUNK_ELEMENTS", "chunked_log_probs"]

CHUNK_ELEMENTS = 1 << 28
"""fp32 elements of one chunk (1 GiB); the rows per chunk are this over the vocabulary slice."""


def _tp(group) -> tuple[int, int]:
    """``(rank, size)`` of ``group`` (``(0, 1)`` without one)."""
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _scaled(x: Tensor, temperature: float) -> Tensor:
    z = x.float()
    if z.data_ptr() == x.data_ptr():  # already fp32: never modify the caller's logits
        z = z.clone()
    return z.div_(temperature) if temperature != 1.0 else z


def _targets(labels: Tensor, start: int, size: int) -> tuple[Tensor, Tensor]:
    """``(index in this slice clamped into it, label inside this slice)``."""
    local = labels - start
    inside = (local >= 0) & (local < size)
    return local.clamp(0, size - 1), inside


def _chunk_forward(x: Tensor, labels: Tensor, temperature: float, group, start: int,
                   entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(log p(y), logsumexp(z), H or None)`` of one chunk of rows ``x`` ``[r, V / TP]``."""
    z = _scaled(x, temperature)
    tp = _tp(group)[1] > 1
    zmax = z.amax(dim=-1)
    if tp:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    z.sub_(zmax.unsqueeze(-1))
    idx, inside = _targets(labels, start, z.shape[-1])
    sums = [torch.where(inside, z.gather(-1, idx.unsqueeze(-1)).squeeze(-1), 0.0)]
    e = torch.exp(z)
    sums.append(e.sum(dim=-1))
    if entropy:
        sums.append(e.mul_(z).sum(dim=-1))
    del e, z
    stacked = torch.stack(sums)
    if tp:
        dist.all_reduce(stacked, group=group)
    log_sum = torch.log(stacked[1])
    ent = log_sum - stacked[2] / stacked[1] if entropy else None
    return stacked[0] - log_sum, log_sum + zmax, ent


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, group, rows: int,
                entropy: bool):
        vp = logits.shape[-1]
        start = _tp(group)[0] * vp
        flat, lab = logits.reshape(-1, vp), labels.reshape(-1)
        n = flat.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp) if entropy else lp.new_zeros(0)
        for i in range(0, n, rows):
            j = min(i + rows, n)
            lp[i:j], lse[i:j], h = _chunk_forward(flat[i:j], lab[i:j], temperature, group,
                                                  start, entropy)
            if entropy:
                ent[i:j] = h
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.group, ctx.rows, ctx.start = temperature, group, rows, start
        ent = ent.view(labels.shape) if entropy else ent
        ctx.mark_non_differentiable(ent)
        return lp.view(labels.shape), ent

    @staticmethod
    def backward(ctx, grad_lp: Tensor, _grad_ent: Tensor | None):
        logits, labels, lse = ctx.saved_tensors
        t, vp = ctx.temperature, logits.shape[-1]
        flat, lab = logits.reshape(-1, vp), labels.reshape(-1)
        g = grad_lp.reshape(-1).float() / t
        grad = torch.empty_like(flat)
        for i in range(0, flat.shape[0], ctx.rows):
            j = min(i + ctx.rows, flat.shape[0])
            p = _scaled(flat[i:j], t).sub_(lse[i:j].unsqueeze(-1)).exp_()  # softmax(z)
            p.mul_(-g[i:j].unsqueeze(-1))
            idx, inside = _targets(lab[i:j], ctx.start, vp)
            p.scatter_add_(-1, idx.unsqueeze(-1), torch.where(inside, g[i:j], 0.0).unsqueeze(-1))
            grad[i:j] = p
        return grad.view_as(logits), None, None, None, None, None


def chunked_log_probs(logits: Tensor, labels: Tensor, temperature: float = 1.0, group=None,
                      entropy: bool = False, chunk_elements: int | None = None
                      ) -> tuple[Tensor, Tensor | None]:
    """``(log softmax(logits / T)[labels], entropy or None)``, both fp32 ``labels.shape``.

    ``logits`` ``[..., V / TP]`` is this rank's vocabulary slice of ``group`` (None: the
    whole vocabulary); labels outside the slice are handled by the others. The entropy is a
    metric (no gradient). ``chunk_elements``: fp32 elements per chunk (default
    :data:`CHUNK_ELEMENTS`, read at call time).
    """
    if temperature <= 0:
        raise ValueError(f"chunked_log_probs: temperature={temperature} must be > 0")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"chunked_log_probs: logits {tuple(logits.shape)} do not match labels "
                         f"{tuple(labels.shape)} (expected [..., vocab] and [...])")
    budget = CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    rows = max(1, budget // max(1, logits.shape[-1]))
    lp, ent = _ChunkedLogProbs.apply(logits, labels, float(temperature), group, rows, entropy)
    return lp, (ent if entropy else None)
