"""A frozen quantized LoRA base keeps only its codes across forward -> backward (QLoRA).

``models.lora.redequantize_in_backward``: megatron's frozen-weight GEMM saves its weight for the
input-gradient GEMM; the LoRA linears hand autograd a token instead and dequantize again in the
backward. The reference is the same model with ``_LoraMixin.qrl_redequantize = False`` (the
dequantized weight saved, as before). Tiny Qwen3 / Qwen3-MoE of tests/helpers/te_quant_fixtures.py,
fp32 on CPU.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.helpers.lora_fixtures import (
    frozen_lora_model,
    loss_grads,
    square_loss,
    tp_sp_lora_model,
)

FORMATS = ("nf4", "int8", "fp8", "w4a16")


def _linear_grads(model) -> dict[str, torch.Tensor]:
    """Per LoRA linear: the input's and the adapters' gradients of ``<r, linear(x)>``."""
    from megatron_qrl.models.lora import lora_linears

    out = {}
    g = torch.Generator().manual_seed(7)
    for name, lin in lora_linears(model):
        lin.zero_grad(set_to_none=True)
        x = torch.randn(8, 2, lin.input_size, generator=g).requires_grad_()
        y, _ = lin(x)
        (y * torch.randn(y.shape, generator=g)).sum().backward()
        out[f"{name}:input"] = x.grad
        out.update({f"{name}:{n}": p.grad.clone() for n, p in lin.named_parameters()
                    if p.grad is not None})
    return out


def _assert_identical(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref) and ref
    for name, g in ref.items():
        assert float(g.abs().max()) > 0, name
        assert torch.equal(got[name], g), name


@pytest.mark.parametrize("fmt,kind", [*((f, "dense") for f in FORMATS), ("nf4", "moe")])
def test_gradients_are_bit_identical_to_keeping_the_weight(megatron, monkeypatch, fmt, kind):
    from megatron_qrl.models.lora import _LoraMixin

    model = frozen_lora_model(kind, fmt)
    got = loss_grads(model), _linear_grads(model)
    monkeypatch.setattr(_LoraMixin, "qrl_redequantize", False)
    ref = loss_grads(model), _linear_grads(model)
    for g, r in zip(got, ref):
        _assert_identical(g, r)
    if kind == "moe":  # the SequentialMLP expert linears are covered
        assert any(".experts." in n for n in got[1])


def _track_dequantized(model) -> list:
    """Weak references to every tensor the model's base storages dequantize from now on."""
    from megatron_qrl.models.lora import lora_linears

    made = []
    for _, lin in lora_linears(model):
        lin.qrl_base.dequantize = _recording(lin.qrl_base, made)
    return made


def _recording(base, made: list):
    orig = base.dequantize

    def dequantize() -> torch.Tensor:
        w = orig()
        made.append(weakref.ref(w))
        return w

    return dequantize


def _alive_bytes(refs: list) -> int:
    gc.collect()
    return sum(t.numel() * t.element_size() for t in (r() for r in refs) if t is not None)


@pytest.mark.parametrize("fmt,kind", [*((f, "dense") for f in (*FORMATS, "nvfp4")),
                                      ("nf4", "moe")])
def test_no_dequantized_weight_lives_from_forward_to_backward(megatron, monkeypatch, fmt,
                                                              kind):
    from megatron_qrl.models.lora import _LoraMixin

    model = frozen_lora_model(kind, fmt)
    made = _track_dequantized(model)
    loss = square_loss(model)  # the graph (and whatever it saved) is alive
    n_forward = len(made)
    assert n_forward > 0 and _alive_bytes(made) == 0
    loss.backward()
    assert len(made) > n_forward  # the backward dequantized again ...
    assert _alive_bytes(made) == 0  # ... and let go
    # the reference keeps a weight per linear from forward to backward: the check can fail
    monkeypatch.setattr(_LoraMixin, "qrl_redequantize", False)
    made.clear()
    loss = square_loss(model)
    assert _alive_bytes(made) > 0
    assert len([r for r in made if r() is not None]) >= len(made) - 1  # all but the first qkv
    del loss


def test_activation_recomputation_nests(megatron, monkeypatch):
    """``--recompute-granularity full``: megatron's reentrant checkpoint re-runs the forward
    (and the hooks) in the backward; the gradients equal the plain run's, bit for bit.

    The word embedding stays frozen: ``freeze_base`` makes its output require grad (a
    reentrant checkpoint only back-propagates when its input does; tests/models/
    test_lora_recompute.py)."""
    from megatron_qrl.models.lora import _LoraMixin

    recomputed = frozen_lora_model("dense", "nf4", recompute_granularity="full",
                                   recompute_method="uniform", recompute_num_layers=1)
    made = _track_dequantized(recomputed)
    got = loss_grads(recomputed)
    assert len(made) == 3 * 8  # the forward, the recomputed forward, the backward
    assert _alive_bytes(made) == 0
    assert got and all(".lora_A." in n or ".lora_B." in n for n in got)
    monkeypatch.setattr(_LoraMixin, "qrl_redequantize", False)
    _assert_identical(got, loss_grads(frozen_lora_model("dense", "nf4")))


def _tp2_body(rank, world, port, fmt):
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.models.lora import _LoraMixin

    init_cpu_distributed(rank, world, port, tp=world)
    try:
        with cpu_device_mode():
            model = tp_sp_lora_model(world, fmt)
            made = _track_dequantized(model)
            loss = square_loss(model)
            alive = _alive_bytes(made)
            model.zero_grad(set_to_none=True)
            loss.backward()
            got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            _LoraMixin.qrl_redequantize = False
            ref = loss_grads(model)
            return {"alive": alive, "made": len(made), "got": got, "ref": ref}
    finally:
        destroy_cpu_distributed()


@pytest.mark.slow
def test_tp2_sequence_parallel_gradients_are_bit_identical():
    """TP = 2 with sequence parallelism: megatron's gather / reduce-scatter around the base GEMM
    run unchanged inside the hooks; the gradients equal the saved-weight reference's."""
    from tests.helpers.mp_utils import run_distributed

    for out in run_distributed(_tp2_body, 2, "w4a16"):
        assert out["alive"] == 0 and out["made"] > 8
        _assert_identical(out["got"], out["ref"])
