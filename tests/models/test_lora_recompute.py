"""LoRA under megatron's activation recomputation (``--recompute-granularity``).

megatron-core 0.16.1's full recompute wraps layers in a reentrant checkpoint that only
back-propagates when its input requires grad; a frozen embedding's output does not.
``models.lora.decoder_input_requires_grad`` (called by ``freeze_all_but_adapters``, so by both
freezing paths) marks the embedding's output as requiring grad when the model recomputes.
Without it, ``uniform 1`` (every layer recomputed) raises in backward and ``block 1`` (layer 0
of 2 recomputed) silently leaves layer 0's adapters without gradient. Tiny Qwen3 / Qwen3-MoE (expert adapters on) of
tests/helpers/te_quant_fixtures.py, fp32 on CPU, bf16 base storage (the parameter dtype).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.lora_fixtures import frozen_lora_model, loss_grads, tp_sp_lora_model
from tests.helpers.te_quant_fixtures import ids

RECOMPUTE = {
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
    "full-block-1": dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}
_REF: dict[str, dict[str, torch.Tensor]] = {}


def _reference(kind: str) -> dict[str, torch.Tensor]:
    if kind not in _REF:
        _REF[kind] = loss_grads(frozen_lora_model(kind))
    return _REF[kind]


def _assert_frozen_embedding(model) -> None:
    emb = model.embedding.word_embeddings.weight
    assert not emb.requires_grad and emb.grad is None


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_recomputed_adapter_gradients_equal_the_plain_run(megatron, kind, recompute):
    """Every adapter of every layer (recomputed or not) gets the no-recompute run's gradient,
    bit for bit (the recomputed forward runs the same fp32 ops on CPU); nothing else does."""
    ref = _reference(kind)
    model = frozen_lora_model(kind, **RECOMPUTE[recompute])
    got = loss_grads(model)
    names = {n for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    assert sorted(ref) == sorted(names)  # the reference: every adapter, adapters only
    assert sorted(got) == sorted(ref), sorted(set(ref) - set(got))[:4]
    for name, g in ref.items():
        assert float(g.abs().max()) > 0, name
        assert torch.equal(got[name], g), name
    for layer in ("decoder.layers.0.", "decoder.layers.1."):
        assert any(n.startswith(layer) for n in got)
    if kind == "moe":
        assert any(".experts." in n for n in got)
    _assert_frozen_embedding(model)


def test_freezing_after_a_warm_up_hooks_the_embedding(megatron):
    """The warm-up path: the base (embedding included) trains under recomputation, then
    ``freeze_base`` at the RL start; the adapters then get the reference's gradients."""
    model = frozen_lora_model("dense", None, **RECOMPUTE["full-uniform-1"])
    warm = loss_grads(model)
    assert "embedding.word_embeddings.weight" in warm  # trainable: no hook needed
    from megatron_qrl.models.lora import (
        decoder_input_requires_grad,
        freeze_base,
    )
    from megatron_qrl.models.lora_base import make_base_storage

    freeze_base(model, make_base_storage("bf16"))
    assert decoder_input_requires_grad(model) == 1  # idempotent: still one hook
    assert len(model.embedding._forward_hooks) == 1
    got = loss_grads(model)
    assert sorted(got) == sorted(_reference("dense"))
    for name, g in _reference("dense").items():
        assert torch.equal(got[name], g), name
    _assert_frozen_embedding(model)


def test_embedding_output_requires_grad_only_when_grad_is_on(megatron):
    """No graph where none is wanted: under ``no_grad`` (pi_prox recompute) the hook leaves
    the output alone; without recomputation there is no hook (no extra input gradient)."""
    from megatron_qrl.models.lora import decoder_input_requires_grad

    x = ids()
    pos = torch.arange(x.shape[1])[None].expand_as(x)
    for recompute, want in ((True, [False, True]), (False, [False, False])):
        model = frozen_lora_model("dense", **(RECOMPUTE["full-uniform-1"] if recompute else {}))
        assert decoder_input_requires_grad(model) == int(recompute)
        seen = []
        model.decoder.register_forward_pre_hook(
            lambda m, args, kwargs, seen=seen: seen.append(
                kwargs["hidden_states"].requires_grad), with_kwargs=True)
        with torch.no_grad():
            model(x, pos, None)
        model(x, pos, None)
        assert seen == want
        _assert_frozen_embedding(model)


def _tp2_body(rank, world, port):
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed

    init_cpu_distributed(rank, world, port, tp=world)
    try:
        with cpu_device_mode():
            out = {}
            for name, overrides in (("plain", {}), ("full", RECOMPUTE["full-uniform-1"])):
                model = tp_sp_lora_model(world, **overrides)  # the same adapter init in both
                out[name] = loss_grads(model)
                _assert_frozen_embedding(model)
            return out
    finally:
        destroy_cpu_distributed()


@pytest.mark.slow
def test_tp2_sequence_parallel_recompute_equals_plain():
    """TP = 2 with sequence parallelism: the hooked embedding output is the scattered
    sequence shard; the recomputed run's adapter gradients equal the plain run's."""
    from tests.helpers.mp_utils import run_distributed

    for out in run_distributed(_tp2_body, 2):
        ref, got = out["plain"], out["full"]
        assert ref and sorted(got) == sorted(ref)
        assert any(n.startswith("decoder.layers.0.") for n in ref)
        for name, g in ref.items():
            assert float(g.abs().max()) > 0, name
            assert torch.equal(got[name], g), name
