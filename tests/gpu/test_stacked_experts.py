"""H200: the stacked experts (``--qrl-train-moe-experts stacked``) on CUDA, BF16.

1. Local spec (no Transformer Engine needed): the stacked experts' GEMMs are
   ``torch._grouped_mm`` (counted; never the padded ``bmm`` fallback), and logits, loss and
   every gradient agree with the sequential experts within BF16 noise (relative 2e-2); both
   models replay the fp32 sequential model's experts, so top-k flips do not move the comparison.
2. Transformer Engine spec with ``--moe-grouped-gemm``, fused permute and router (where TE
   imports): the stacked experts replace ``TEGroupedMLP``; same comparison against TE's
   ``GroupedLinear``.

Run: ``pytest tests/gpu/test_stacked_experts.py -s -rs``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("megatron")]

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

# the module-scoped `megatron` fixture (one process group, TF32 off) is test_te_grouped's
from tests.gpu.test_te_grouped import (  # noqa: E402, F401
    _compare,
    _fp32_routed,
    _Ops,
    _run,
    megatron,
    needs_te,
)


def _model(arch, tensors, stacked, impl, replay, **overrides):
    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.stacked_experts import stacked_experts_spec_hook
    from megatron_qrl.models.streaming import groups_from_parallel_state, load_hf_weights
    from megatron_qrl.moe import replay_spec_hook
    from megatron_qrl.te_quant import compose_hooks

    hook = compose_hooks(stacked_experts_spec_hook if stacked else None, replay_spec_hook(replay))
    model = build_model(arch, None, torch.bfloat16, spec_hook=hook, use_te=impl, **overrides)
    load_hf_weights(model, arch, tensors.__getitem__, groups_from_parallel_state())
    return model.cuda()


def _pair(impl, **overrides):
    from megatron_qrl.moe import RoutingReplay

    arch, tensors, x, route = _fp32_routed(impl)
    out = {}
    for stacked in (True, False):
        replay = RoutingReplay("all", arch.num_experts, arch.moe_top_k)
        model = _model(arch, tensors, stacked, impl, replay,
                       **({} if stacked else overrides))
        names = {type(m).__name__ for m in model.modules()}
        assert ("StackedGroupedMLP" in names) == stacked, names
        out[stacked] = _run(model, arch, x, replay=replay, route=route)
        if stacked:  # one expert linear alone: the CUTLASS grouped GEMM, not the padded bmm
            fc1 = model.decoder.layers[0].mlp.experts.linear_fc1
            counts = [5, 0, 17, 3] + [1] * (arch.num_experts - 4)
            h = torch.randn(sum(counts), fc1.in_features, device="cuda", dtype=torch.bfloat16)
            with _Ops() as ops:
                fc1(h, counts)
            assert "_grouped_mm" in ops.names and "bmm" not in ops.names, sorted(ops.names)
    return out


def test_stacked_bf16_local_spec_uses_grouped_mm_and_matches_sequential():
    out = _pair("local")
    _compare(out[True], out[False], 2e-2, "stacked vs sequential, local spec, bf16")


@needs_te
def test_stacked_bf16_te_spec_matches_te_grouped_linear():
    out = _pair("transformer_engine", moe_grouped_gemm=True)
    _compare(out[True], out[False], 2e-2, "stacked vs TE GroupedLinear, bf16")
