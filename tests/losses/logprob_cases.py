"""Shared cases of the log-prob implementation tests (tests/losses/test_logprob_impl.py,
tests/losses/test_triton_logprobs.py): data, the float64 full-vocabulary reference, a pure-torch
stand-in of the kernels' interface, and the tensor-parallel body run on gloo."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_qrl.losses import logprobs
from megatron_qrl.losses.logprobs import chunked_log_probs, set_logprob_impl


def data(seed: int, shape: tuple[int, ...], vocab: int, dtype=torch.float32):
    """``(logits [*shape, vocab] * 4, labels, per-token weights)``."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * 4).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=g)
    return x, labels, torch.randn(*shape, generator=g)


def reference(x: torch.Tensor, labels: torch.Tensor, t: float):
    """``(log p(y), entropy)`` of the full vocabulary in float64 (autograd-able)."""
    logp = torch.log_softmax(x.double() / t, -1)
    return logp.gather(-1, labels[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def _row_stats(x, idx, temperature, entropy):
    """The kernels' ``row_stats`` in torch: statistics about each row's own max."""
    z = x.float() / temperature
    m = z.amax(-1)
    d = z - m[:, None]
    e = d.exp()
    w = (e * d).sum(-1) if entropy else torch.zeros_like(m)
    return m, e.sum(-1), w, z.gather(-1, idx[:, None])[:, 0]


def _grad_logits(x, lse, g, target, temperature):
    """The kernels' ``grad_logits`` in torch (``target`` -1: not in this slice)."""
    p = (x.float() / temperature - lse[:, None]).exp()
    hit = torch.arange(x.shape[-1]) == target[:, None]
    return (p * -g[:, None] + torch.where(hit, g[:, None], 0.0)).to(x.dtype)


STANDIN = SimpleNamespace(row_stats=_row_stats, grad_logits=_grad_logits)
"""The kernels' interface in torch: drives logprobs.py's fused path where Triton is absent."""


def use_impl(impl: str, block: int | None = None) -> None:
    """``torch`` / ``triton`` (the kernels, blocks of ``block``) / ``standin`` (:data:`STANDIN`)."""
    if impl == "standin":
        logprobs._kernels = lambda device: STANDIN
        return
    set_logprob_impl(impl)
    if impl == "triton" and block is not None:
        from megatron_qrl.losses import triton_logprobs

        triton_logprobs.BLOCK = block


def tp_body(rank, world_size, port, temperature, impls, vocab, block):
    """Each of ``impls`` on this rank's vocabulary slice of :func:`data` (the last slice padded
    with -1e4 logits): ``{impl: {lp, ent, grad of this slice}}``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        x, labels, w = data(2, (3, 7), vocab)
        vp = -(-vocab // world_size)
        piece = x[..., rank * vp:(rank + 1) * vp]
        if piece.shape[-1] < vp:
            pad = torch.full((*piece.shape[:-1], vp - piece.shape[-1]), -1e4)
            piece = torch.cat([piece, pad], -1)
        out = {}
        for impl in impls:
            use_impl(impl, block)
            p = piece.clone().requires_grad_()
            lp, ent = chunked_log_probs(p, labels, temperature, dist.group.WORLD, True,
                                        chunk_elements=2 * vp)
            (grad,) = torch.autograd.grad((lp * w).sum(), p)
            out[impl] = {"lp": lp, "ent": ent, "grad": grad[..., : min(vp, vocab - rank * vp)]}
        return out
    finally:
        dist.destroy_process_group()


def check_tp(outs, impls, temperature, vocab, atol=3e-6):
    """Every implementation equals the float64 full-vocabulary reference on every rank."""
    x, labels, w = data(2, (3, 7), vocab)
    xd = x.double().requires_grad_()
    ref_lp, ref_ent = reference(xd, labels, temperature)
    (ref_grad,) = torch.autograd.grad((ref_lp * w.double()).sum(), xd)
    for impl in impls:
        for out in outs:
            got = out[impl]
            torch.testing.assert_close(got["lp"].double(), ref_lp.detach(), rtol=1e-6,
                                       atol=atol, msg=lambda m, i=impl: f"{i}: {m}")
            torch.testing.assert_close(got["ent"].double(), ref_ent.detach(), rtol=1e-6,
                                       atol=atol, msg=lambda m, i=impl: f"{i}: {m}")
        grad = torch.cat([o[impl]["grad"] for o in outs], -1)
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-6, atol=atol,
                                   msg=lambda m, i=impl: f"{i} grad: {m}")
