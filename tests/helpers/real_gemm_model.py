"""The model-level comparison of the aligned forward's GEMMs (no tests here): one BF16 tiny model
(local spec; MoE with stacked experts) run with the fake GEMM, the real GEMM, and the real
path's plumbing with its kernel replaced by a reference of the rollout engine's GEMM — the
exact one (:func:`exact_gemm`) and, on a GPU, the engine's own kernels — on the same codes.

Used by tests/te_quant/test_real_gemm_model.py (CPU) and tests/gpu/test_real_gemm.py (H200).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from megatron_qrl.te_quant import real_gemm


def exact_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
               out_dtype: torch.dtype, cuda_shapes: bool | None = None) -> torch.Tensor:
    """``(sum_k qx qw) * sx * sw`` with the sum exact (fp64: E4M3 / INT8 code products and their
    sums over K < 2^20 are exact there) and one rounding to ``out_dtype``: what SGLang's
    ``fp8_scaled_mm`` / ``int8_scaled_mm`` compute up to their fp32 summation order."""
    acc = xq.double() @ wq.double().t()
    return (acc * xs.double() * ws.double().reshape(1, -1)).to(out_dtype)


@contextlib.contextmanager
def kernels_replaced(fn: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Every real GEMM (dense and per expert, no ``_scaled_grouped_mm``) runs ``fn``."""
    saved, grouped = dict(real_gemm.KERNELS), real_gemm._scaled_grouped_ok
    for key, k in saved.items():
        real_gemm.KERNELS[key] = real_gemm.Kernel(fn, k.min_capability, k.what)
    real_gemm._scaled_grouped_ok = lambda *a: False
    try:
        yield
    finally:
        real_gemm.KERNELS.update(saved)
        real_gemm._scaled_grouped_ok = grouped


@dataclass
class Run:
    """The first quantized GEMM's input and output, every decoder layer's output and the
    logits (fp32), and all gradients."""

    first: tuple[torch.Tensor, torch.Tensor]
    layers: list[torch.Tensor]
    logits: torch.Tensor
    grads: torch.Tensor


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``mean |a - b| / mean |b|``."""
    return ((a - b).abs().mean() / b.abs().mean()).item()


def l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (fp64)."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


FIRST_GEMM_BOUND = 2.0**-7
"""Real vs fake on the first quantized GEMM, mean relative: twice one GEMM's BF16 operand
rounding ``2^-8`` (measured ``2^-9``); a wrong scale moves it by ``>= 2^-4``."""
RATIO = 0.5
"""Real's distance to the engine GEMM over fake's, at most (measured 0 to 0.2)."""


def build_bf16(kind: str, fmt: str, device: str):
    """(state, model, ids, positions): the tiny ``kind`` model in BF16 on ``device`` with the
    aligned forward for ``fmt`` (call inside a megatron job)."""
    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.stacked_experts import stacked_experts_spec_hook
    from megatron_qrl.models.streaming import groups_from_parallel_state, load_hf_weights
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook, compose_hooks
    from tests.helpers.te_quant_fixtures import hf_state, ids, tiny_hf

    hf, arch = tiny_hf(kind)
    state = AlignedForwardState(fmt)
    hook = compose_hooks(stacked_experts_spec_hook if kind == "moe" else None,
                         aligned_spec_hook(state))
    extra = {"use_cpu_initialization": False} if device != "cpu" else {}
    model = build_model(arch, None, torch.bfloat16, spec_hook=hook, use_te=False, **extra)
    load_hf_weights(model, arch, hf_state(hf).__getitem__, groups_from_parallel_state())
    model = model.to(device)
    x = ids(batch=4, seq=64).to(device)
    return state, model, x, torch.arange(x.shape[1], device=device)[None].expand_as(x)


def run(state, model, x, pos, gemm: str, kernel: Callable | None = None) -> Run:
    """One forward and backward (loss: the first token's log-probability, summed) with
    ``gemm``; ``kernel`` replaces the real GEMM."""
    state.gemm = gemm
    state.mark_weights_updated()
    model.zero_grad()
    layers: list[torch.Tensor] = []
    first: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(
        lambda m, i, o: layers.append((o[0] if isinstance(o, tuple) else o).detach().float()))
        for layer in model.decoder.layers]
    hooks.append(model.decoder.layers[0].self_attention.linear_qkv.register_forward_hook(
        lambda m, i, o: first.extend([i[0].detach(), o[0].detach().float()])))
    try:
        with kernels_replaced(kernel) if kernel else contextlib.nullcontext():
            logits = model(x, pos, attention_mask=None).float()
            logits.log_softmax(-1)[..., 0].sum().backward()
    finally:
        for h in hooks:
            h.remove()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()
                       if p.grad is not None])
    return Run((first[0], first[1]), layers, logits.detach(), grads)


def report(kind: str, fmt: str, runs: dict[str, Run], ref: str) -> str:
    """One line per comparison: per-layer and logit distances to ``ref``, gradient gaps."""
    r = runs[ref]
    out = []
    for name in ("real", "fake"):
        a = runs[name]
        per = [round(rel(u, v), 4) for u, v in zip(a.layers + [a.logits], r.layers + [r.logits])]
        out.append(f"{kind} {fmt} {name} vs {ref}: rel by layer (.., logits) {per}, gradient "
                   f"|diff| / |ref| {l2(a.grads, r.grads):.2e}")
    return "\n".join(out)


def check_model(kind: str, fmt: str, device: str, references: dict) -> None:
    """Runs fake, real and each ``references`` kernel on one model and asserts: the first
    quantized GEMM's real output within :data:`FIRST_GEMM_BOUND` (mean relative) of fake on
    bit-equal inputs; logits and gradients of real at most :data:`RATIO` times as far from each
    reference as fake's (why: tests/te_quant/test_real_gemm_model.py)."""
    state, model, x, pos = build_bf16(kind, fmt, device)
    runs = {"fake": run(state, model, x, pos, "fake"), "real": run(state, model, x, pos, "real")}
    runs.update({name: run(state, model, x, pos, "real", fn) for name, fn in references.items()})
    (xr, yr), (xf, yf) = runs["real"].first, runs["fake"].first
    assert torch.equal(xr, xf), "the first quantized GEMM's input differs between the paths"
    first = rel(yr, yf)
    print(f"\n{kind} {fmt}: first GEMM real vs fake {first:.2e}")
    assert first < FIRST_GEMM_BOUND
    for name in references:
        print(report(kind, fmt, runs, name))
        ref = runs[name]
        for what, dist in (("logits", rel), ("grads", l2)):
            d_real = dist(getattr(runs["real"], what), getattr(ref, what))
            d_fake = dist(getattr(runs["fake"], what), getattr(ref, what))
            assert d_fake > 0 and d_real <= RATIO * d_fake, \
                f"{kind} {fmt} {what}: real {d_real:.3g} vs fake {d_fake:.3g} from {name}"
