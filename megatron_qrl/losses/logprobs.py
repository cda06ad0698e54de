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

Two implementations give these numbers: the torch code here (the reference, and the CPU's) and
the fused Triton kernels of :mod:`.triton_logprobs`, which read the logits once per pass in
their own dtype and make no fp32 copy of them (their forward keeps online softmax statistics
per row; the tensor-parallel combination below is the same for both). The choice:

``auto`` / ``torch`` / ``triton`` (:mod:`megatron_qrl.utils.kernel_choice`; A/B benchmarks:
``bench/logprob_kernel.py``), set by the environment variable :data:`ENV` or
:func:`set_logprob_impl` (which wins).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_qrl.utils import kernel_choice

__all__ = ["CHUNK_ELEMENTS", "ENV", "IMPLS", "chunked_log_probs", "logprob_impl",
           "set_logprob_impl"]

CHUNK_ELEMENTS = 1 << 28
"""fp32 elements of one chunk (1 GiB); the rows per chunk are this over the vocabulary slice."""

ENV = "QRL_LOGPROB_IMPL"
IMPLS = kernel_choice.IMPLS

_SETTING = kernel_choice.ImplSetting(ENV, "log-prob")


def set_logprob_impl(impl: str | None) -> None:
    """Choose the implementation for this process (None: back to :data:`ENV`, else auto)."""
    _SETTING.set(impl, "set_logprob_impl")


def logprob_impl() -> str:
    """The implementation in force: :func:`set_logprob_impl`'s, else :data:`ENV`'s, else auto."""
    return _SETTING.get()


@functools.cache
def _triton_module() -> ModuleType | None:
    """:mod:`.triton_logprobs`, or None where Triton does not import."""
    return kernel_choice.import_kernels("megatron_qrl.losses.triton_logprobs")


def _kernels(device: torch.device) -> ModuleType | None:
    """The Triton kernels for logits on ``device``, or None (the torch code). Raises, naming
    the fix, where ``triton`` is forced but cannot run."""
    return kernel_choice.select_kernels(logprob_impl(), _triton_module(), device, ENV,
                                        "the logits are on {device}")


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


def _global_max(zmax: Tensor, group, tp: bool) -> Tensor:
    if tp:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    return zmax


def _finish(sums: list[Tensor], zmax: Tensor, group, tp: bool, entropy: bool
            ) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(log p(y), logsumexp(z), H or None)`` from this slice's ``[z_y - M, sum e^{z - M},
    sum e^{z - M} (z - M)]`` about the group's max ``M`` = ``zmax``, summed over the group."""
    stacked = torch.stack(sums)
    if tp:
        dist.all_reduce(stacked, group=group)
    log_sum = torch.log(stacked[1])
    ent = log_sum - stacked[2] / stacked[1] if entropy else None
    return stacked[0] - log_sum, log_sum + zmax, ent


def _chunk_forward(x: Tensor, labels: Tensor, temperature: float, group, start: int,
                   entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(log p(y), logsumexp(z), H or None)`` of one chunk of rows ``x`` ``[r, V / TP]``."""
    z = _scaled(x, temperature)
    tp = _tp(group)[1] > 1
    zmax = _global_max(z.amax(dim=-1), group, tp)
    z.sub_(zmax.unsqueeze(-1))
    idx, inside = _targets(labels, start, z.shape[-1])
    sums = [torch.where(inside, z.gather(-1, idx.unsqueeze(-1)).squeeze(-1), 0.0)]
    e = torch.exp(z)
    sums.append(e.sum(dim=-1))
    if entropy:
        sums.append(e.mul_(z).sum(dim=-1))
    del e, z
    return _finish(sums, zmax, group, tp, entropy)


def _fused_forward(kernels: ModuleType, x: Tensor, labels: Tensor, temperature: float, group,
                   start: int, entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`_chunk_forward` of all rows through the kernels: their statistics about each
    slice's own max ``m`` are rescaled to the group's max ``M`` by ``a = e^{m - M}``:
    ``S_M = a S_m``, ``W_M = a (W_m + (m - M) S_m)`` (:mod:`.triton_logprobs`)."""
    tp = _tp(group)[1] > 1
    idx, inside = _targets(labels, start, x.shape[-1])
    m, s, w, zy = kernels.row_stats(x, idx, temperature, entropy)
    zmax = _global_max(m.clone(), group, tp)
    a = torch.exp(m - zmax)
    sums = [torch.where(inside, zy - zmax, 0.0), s * a]
    if entropy:
        sums.append(a * (w + (m - zmax) * s))
    return _finish(sums, zmax, group, tp, entropy)


def _forward(logits: Tensor, labels: Tensor, temperature: float, group, rows: int,
             entropy: bool, kernels: ModuleType | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(log p(y), logsumexp(z), H or an empty tensor)``, fp32 ``[N]`` over the flattened
    rows, by the torch code chunk by chunk (``kernels`` None) or by the kernels at once."""
    vp = logits.shape[-1]
    start = _tp(group)[0] * vp
    flat, lab = logits.reshape(-1, vp), labels.reshape(-1)
    if kernels is not None:
        lp, lse, ent = _fused_forward(kernels, flat, lab, temperature, group, start, entropy)
        return lp, lse, ent if entropy else lp.new_zeros(0)
    n = flat.shape[0]
    lp = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(lp)
    ent = torch.empty_like(lp) if entropy else lp.new_zeros(0)
    for i in range(0, n, rows):
        j = min(i + rows, n)
        lp[i:j], lse[i:j], h = _chunk_forward(flat[i:j], lab[i:j], temperature, group, start,
                                              entropy)
        if entropy:
            ent[i:j] = h
    return lp, lse, ent


def _backward(logits: Tensor, labels: Tensor, lse: Tensor, grad_lp: Tensor, temperature: float,
              start: int, rows: int, kernels: ModuleType | None) -> Tensor:
    """``d log p(y) / d logits`` times ``grad_lp``, in the logits' dtype and shape."""
    t, vp = temperature, logits.shape[-1]
    flat, lab = logits.reshape(-1, vp), labels.reshape(-1)
    g = grad_lp.reshape(-1).float() / t
    if kernels is not None:
        idx, inside = _targets(lab, start, vp)
        grad = kernels.grad_logits(flat, lse, g, torch.where(inside, idx, -1), t)
        return grad.view_as(logits)
    grad = torch.empty_like(flat)
    for i in range(0, flat.shape[0], rows):
        j = min(i + rows, flat.shape[0])
        p = _scaled(flat[i:j], t).sub_(lse[i:j].unsqueeze(-1)).exp_()  # softmax(z)
        p.mul_(-g[i:j].unsqueeze(-1))
        idx, inside = _targets(lab[i:j], start, vp)
        p.scatter_add_(-1, idx.unsqueeze(-1), torch.where(inside, g[i:j], 0.0).unsqueeze(-1))
        grad[i:j] = p
    return grad.view_as(logits)


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, group, rows: int,
                entropy: bool):
        kernels = _kernels(logits.device)
        lp, lse, ent = _forward(logits, labels, temperature, group, rows, entropy, kernels)
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.rows, ctx.kernels = temperature, rows, kernels
        ctx.start = _tp(group)[0] * logits.shape[-1]
        ent = ent.view(labels.shape) if entropy else ent
        ctx.mark_non_differentiable(ent)
        return lp.view(labels.shape), ent

    @staticmethod
    def backward(ctx, grad_lp: Tensor, _grad_ent: Tensor | None):
        logits, labels, lse = ctx.saved_tensors
        grad = _backward(logits, labels, lse, grad_lp, ctx.temperature, ctx.start, ctx.rows,
                         ctx.kernels)
        return grad, None, None, None, None, None


def chunked_log_probs(logits: Tensor, labels: Tensor, temperature: float = 1.0, group=None,
                      entropy: bool = False, chunk_elements: int | None = None
                      ) -> tuple[Tensor, Tensor | None]:
    """``(log softmax(logits / T)[labels], entropy or None)``, both fp32 ``labels.shape``.

    ``logits`` ``[..., V / TP]`` is this rank's vocabulary slice of ``group`` (None: the
    whole vocabulary); labels outside the slice are handled by the others. The entropy is a
    metric (no gradient). ``chunk_elements``: fp32 elements per chunk of the torch code
    (default :data:`CHUNK_ELEMENTS`, read at call time; the kernels need no chunks). Which
    code runs: :func:`logprob_impl` (module docstring).
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
