"""The fused Triton log-prob kernels (megatron_qrl/losses/triton_logprobs.py) give the torch
path's log-probs, logsumexp, entropy and gradients, run by Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set here before Triton loads): BF16 and fp32 logits, temperature != 1,
vocabularies and row counts that are not multiples of the block, labels in other ranks'
slices, strided rows, tensor parallelism over gloo. The compiled kernels' proof at the real size
is tests/gpu/test_logprob_kernel.py.

Run: ``PYTHONPATH=/tmp/triton_site:$PWD pytest tests/losses/test_triton_logprobs.py`` (Triton
installed aside; the shared venv has none, and there the module skips).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.triton_cpu import require_triton_interpreter

require_triton_interpreter("tests/gpu/test_logprob_kernel.py")

from megatron_qrl.losses import logprobs, triton_logprobs  # noqa: E402
from megatron_qrl.losses.logprobs import chunked_log_probs, set_logprob_impl  # noqa: E402
from tests.helpers.mp_utils import run_distributed  # noqa: E402
from tests.losses.logprob_cases import check_tp, data, reference, tp_body  # noqa: E402

V = 301
TOL = {torch.float32: {"rtol": 1e-6, "atol": 2e-6},
       torch.bfloat16: {"rtol": 2.0**-7, "atol": 1e-7}}  # one BF16 rounding step apart


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.setattr(triton_logprobs, "BLOCK", triton_logprobs.BLOCK)
    yield
    set_logprob_impl(None)


def _both(x, labels, t, start, grad_lp, entropy=True):
    """``{impl: (lp, lse, ent, grad)}`` of the flattened rows, slice starting at ``start``."""
    out = {}
    for name, kern in (("torch", None), ("triton", triton_logprobs)):
        if kern is None:
            lp, lse, ent = logprobs._chunk_forward(x, labels, t, None, start, entropy)
        else:
            lp, lse, ent = logprobs._fused_forward(kern, x, labels, t, None, start, entropy)
        grad = logprobs._backward(x, labels, lse, grad_lp, t, start, 5, kern)
        out[name] = (lp, lse, ent, grad)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("block", [16, 128, 512])  # 19 blocks, 3 (a tail of 45), one
def test_kernels_equal_the_torch_path(dtype, temperature, block):
    triton_logprobs.BLOCK = block
    x, labels, g = data(0, (23,), V, dtype)
    x[3, 290:] += 30  # the max in the last (partial) block: every earlier sum is rescaled
    x[4, :7] += 30  # the max in the first block
    out = _both(x, labels, temperature, 0, g)
    for name, a, b in zip(("lp", "lse", "ent"), out["triton"], out["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    grad, ref = out["triton"][3], out["torch"][3]
    assert grad.dtype == dtype and grad.shape == x.shape
    torch.testing.assert_close(grad, ref, **TOL[dtype])
    ref_lp, ref_ent = reference(x, labels, temperature)
    torch.testing.assert_close(out["triton"][0].double(), ref_lp, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(out["triton"][2].double(), ref_ent, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_labels_in_other_slices(dtype):
    """A slice starting at column V of a 3V vocabulary: only labels in [V, 2V) are its own
    (the target term and the gradient's one-hot are zero for the rest)."""
    triton_logprobs.BLOCK = 64
    x, _, g = data(1, (17,), V, dtype)
    labels = torch.randint(0, 3 * V, (17,), generator=torch.Generator().manual_seed(4))
    inside = (labels >= V) & (labels < 2 * V)
    assert 0 < inside.sum() < len(labels)
    out = _both(x, labels, 0.8, V, g)
    for name, a, b in zip(("lp", "lse", "ent", "grad"), out["triton"], out["torch"]):
        torch.testing.assert_close(a, b, **TOL[a.dtype], msg=lambda m, n=name: f"{n}: {m}")
    rows = out["triton"][3].float().sum(-1)  # sum_v (onehot - softmax) g over this slice
    torch.testing.assert_close(rows, torch.where(inside, 0.0, -g / 0.8), rtol=0, atol=0.05)


def test_strided_rows_without_entropy_through_autograd():
    """Logits as a view with a row stride wider than the slice (a vocabulary slice of a wider
    tensor) through chunked_log_probs; no entropy; the logits are not modified."""
    triton_logprobs.BLOCK = 32
    wide, labels, w = data(2, (3, 5), V + 40, torch.bfloat16)
    labels = labels.clamp_max(V - 1)
    out = {}
    for impl in ("torch", "triton"):
        set_logprob_impl(impl)
        x = wide.clone().requires_grad_()
        before = x.detach().clone()
        lp, ent = chunked_log_probs(x[..., :V], labels, 1.3, chunk_elements=4 * V)
        (lp * w).sum().backward()
        assert ent is None and torch.equal(x.detach(), before)
        out[impl] = (lp, x.grad)
    torch.testing.assert_close(out["triton"][0], out["torch"][0], rtol=1e-6, atol=1e-5)
    assert out["triton"][1].dtype == torch.bfloat16
    assert not out["triton"][1][..., V:].any()  # columns beyond the view get no gradient
    torch.testing.assert_close(out["triton"][1], out["torch"][1], **TOL[torch.bfloat16])


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_tensor_parallel_kernels_equal_the_full_vocabulary(temperature):
    """TP 2 over gloo, both implementations on each rank (slices of 19 in blocks of 8)."""
    impls = ("torch", "triton")
    outs = run_distributed(tp_body, 2, temperature, impls, 37, 8)
    check_tp(outs, impls, temperature, 37)
    for out in outs:
        for key in ("lp", "ent", "grad"):
            torch.testing.assert_close(out["triton"][key], out["torch"][key], rtol=1e-6,
                                       atol=2e-6)
