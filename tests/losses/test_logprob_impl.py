"""Which code computes the log-probs (megatron_qrl/losses/logprobs.py, ``QRL_LOGPROB_IMPL``), on
the CPU without Triton: CUDA logits with Triton get the fused kernels, everything else the torch
code; ``torch`` forces the torch code, ``triton`` the kernels or one clear error. The fused
path's tensor-parallel combination (rescale to the group's max, then the sums) runs here with a
pure-torch stand-in of the kernels (tests/losses/logprob_cases.py); the kernels themselves:
tests/losses/test_triton_logprobs.py (interpreter), tests/gpu/test_logprob_kernel.py (GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_qrl.losses import logprobs
from megatron_qrl.losses.logprobs import ENV, chunked_log_probs, logprob_impl, set_logprob_impl
from tests.helpers.mp_utils import run_distributed
from tests.losses.logprob_cases import STANDIN, check_tp, data, reference, tp_body

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield
    set_logprob_impl(None)


def test_auto_uses_the_kernels_for_cuda_logits_only(monkeypatch):
    monkeypatch.setattr(logprobs, "_triton_module", lambda: STANDIN)
    assert logprob_impl() == "auto"
    assert logprobs._kernels(CUDA) is STANDIN
    assert logprobs._kernels(CPU) is None  # auto: CPU logits stay on torch
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert logprobs._kernels(CPU) is None  # the interpreter only where triton is forced
    set_logprob_impl("triton")
    assert logprobs._kernels(CPU) is STANDIN
    monkeypatch.setenv(ENV, "triton")
    set_logprob_impl("torch")  # the call wins over the variable
    assert logprobs._kernels(CUDA) is None
    set_logprob_impl(None)
    assert logprob_impl() == "triton"
    monkeypatch.setattr(logprobs, "_triton_module", lambda: None)  # no Triton: torch
    monkeypatch.setenv(ENV, "auto")
    assert logprobs._kernels(CUDA) is None


def test_forced_triton_that_cannot_run_is_one_clear_error(monkeypatch):
    x, labels, _ = data(0, (2, 3), 11)
    monkeypatch.setattr(logprobs, "_triton_module", lambda: None)
    monkeypatch.setenv(ENV, "triton")
    with pytest.raises(RuntimeError, match="QRL_LOGPROB_IMPL=triton: Triton is not installed.*"
                                           "use auto or torch"):
        chunked_log_probs(x, labels)
    monkeypatch.setattr(logprobs, "_triton_module", lambda: STANDIN)
    with pytest.raises(RuntimeError, match="the logits are on cpu.*TRITON_INTERPRET=1"):
        chunked_log_probs(x, labels)


def test_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV, "cuda")
    with pytest.raises(ValueError, match="QRL_LOGPROB_IMPL='cuda'.*auto, torch, triton"):
        logprob_impl()
    with pytest.raises(ValueError, match="set_logprob_impl='fused'"):
        set_logprob_impl("fused")


def _recording(calls: list[str]) -> SimpleNamespace:
    """:data:`STANDIN` whose functions record their names in ``calls``."""
    def wrap(name, fn):
        def run(*args):
            calls.append(name)
            return fn(*args)
        return run
    return SimpleNamespace(**{k: wrap(k, f) for k, f in vars(STANDIN).items()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_path_equals_the_torch_path(monkeypatch, dtype):
    """The fused path (stand-in kernels) gives the torch path's log-probs, entropy and
    gradient, and the backward runs through the kernels the forward chose."""
    x, labels, w = data(1, (3, 5), 29, dtype)
    out = {}
    for fused in (False, True):
        calls = []
        kern = _recording(calls)
        monkeypatch.setattr(logprobs, "_kernels", lambda device, k=kern if fused else None: k)
        xg = x.clone().requires_grad_()
        lp, ent = chunked_log_probs(xg, labels, 0.7, entropy=True, chunk_elements=58)
        (lp * w).sum().backward()
        out[fused] = (lp, ent, xg.grad)
        assert calls == (["row_stats", "grad_logits"] if fused else [])
    for a, b in zip(out[True], out[False]):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=2e-6)
    ref_lp, ref_ent = reference(x, labels, 0.7)
    torch.testing.assert_close(out[True][0].double(), ref_lp, rtol=1e-6, atol=4e-6)
    torch.testing.assert_close(out[True][1].double(), ref_ent, rtol=1e-6, atol=4e-6)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_tensor_parallel_fused_path_equals_the_full_vocabulary(temperature):
    """TP 2 over gloo: each rank's statistics about its own slice's max are rescaled to the
    group's max before the sums are all-reduced (the stand-in's per-slice maxima differ)."""
    impls = ("torch", "standin")
    outs = run_distributed(tp_body, 2, temperature, impls, 37, None)
    check_tp(outs, impls, temperature, 37)
