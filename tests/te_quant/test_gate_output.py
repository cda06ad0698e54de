"""``te_quant.linears.gate_output``: the aligned W8A8 experts' gate after the down projection
(SGLang's order) equals ``(out * probs.unsqueeze(-1)).to(out.dtype)`` forward and backward,
bit for bit, without that expression's fp32 ``[T, H]`` copies."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_qrl.te_quant.linears import gate_output


def _reference(out, probs):
    return (out * probs.unsqueeze(-1)).to(out.dtype)


def _run(fn, out, probs, grad):
    o, p = out.clone().requires_grad_(), probs.clone().requires_grad_()
    y = fn(o, p)
    y.backward(grad)
    return y.detach(), o.grad, p.grad


@pytest.mark.parametrize("dtype,pdtype", [(torch.bfloat16, torch.float32),
                                          (torch.float16, torch.float32),
                                          (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.float32)])
def test_equals_the_expression_forward_and_backward(dtype, pdtype):
    """Catches: the gate's gradient reduced in the output's dtype (``(grad * out).sum``
    without ``.float()``), the output gradient through an fp32 tensor rounded twice, the
    forward's product rounded to the output dtype before the multiply."""
    g = torch.Generator().manual_seed(0)
    out = (torch.randn(300, 96, generator=g) * 3).to(dtype)
    probs = torch.rand(300, generator=g).to(pdtype)
    grad = torch.randn(300, 96, generator=g).to(dtype)
    for a, b in zip(_run(gate_output, out, probs, grad), _run(_reference, out, probs, grad)):
        assert a.dtype == b.dtype and torch.equal(a, b)


class _Allocs(TorchDispatchMode):
    """The dtype and shape of every tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        for t in res if isinstance(res, (tuple, list)) else (res,):
            if isinstance(t, torch.Tensor):
                self.made.append((t.dtype, tuple(t.shape), func.__name__))
        return res


def test_no_fp32_copy_of_the_output_or_of_its_gradient():
    """Catches: ``gate_output`` computing the expression (an fp32 ``[T, H]`` product, an fp32
    copy of the incoming gradient and its product with the gates). The gate's own gradient
    keeps one fp32 product (its reduction is in fp32)."""
    out = torch.randn(64, 32).bfloat16().requires_grad_()
    probs = torch.rand(64).requires_grad_()
    grad = torch.randn(64, 32).bfloat16()
    with _Allocs() as fwd:
        y = gate_output(out, probs)
    assert [m for m in fwd.made if m[:2] == (torch.float32, (64, 32))] == []
    with _Allocs() as bwd:
        y.backward(grad)
    wide = [m for m in bwd.made if m[:2] == (torch.float32, (64, 32))]
    assert len(wide) == 2  # grad.float() and its product with out: the gate's gradient only
