"""H200: the aligned forward on TE's grouped experts (one grouped GEMM) vs the sequential experts.

Both models are Megatron's Transformer Engine spec with the aligned swap
(``te_quant.aligned_spec_hook``), the same weights; only the experts differ:
``--moe-grouped-gemm`` (``AlignedTEGroupedMLP``, ``te_quant.grouped_gemm``) against TE's
``SequentialMLP`` (one aligned TE linear per expert).

1. fp32, every format and the plain forward: logits, loss and every gradient within fp32 GEMM
   noise (the grouped path's fp32 GEMM is the padded ``bmm``).
2. BF16, every format: the grouped GEMM is ``torch._grouped_mm`` (counted), both models routed
   alike (routing replay of the fp32 sequential model's experts); logits and every gradient
   within BF16 noise of each other (relative, 2e-2; a W8A8 code that rounds the other way
   moves a few values, not the norm).
3. The plain grouped path (aligned swap, ``state.only(())``) vs TE's own ``GroupedLinear``
   (Megatron's TE spec, no swap), BF16: within BF16 noise.
4. ``--moe-router-fusion``: a forward without replay (TE's fused top-k) records the unfused
   router's experts.

Run: ``pytest tests/gpu/test_te_grouped.py -s -rs``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from tests.helpers.routing_flips import record_routing, routing_ids  # noqa: E402
from tests.helpers.te_quant_fixtures import grads_as_hf, hf_state, ids, tiny_hf  # noqa: E402

try:
    import transformer_engine.pytorch  # noqa: F401

    TE_REASON = ""
except Exception as exc:  # noqa: BLE001 - the reason is the skip message
    TE_REASON = f"Transformer Engine does not import: {exc}"
needs_te = pytest.mark.skipif(bool(TE_REASON), reason=TE_REASON)


@pytest.fixture(scope="module")
def megatron():
    from megatron_qrl.models.runtime import single_process_megatron

    torch.backends.cuda.matmul.allow_tf32 = False
    with single_process_megatron():
        yield


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _model(arch, tensors, dtype, grouped, fmt="bf16", aligned=True, replay=None,
           impl="transformer_engine"):
    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.streaming import groups_from_parallel_state, load_hf_weights
    from megatron_qrl.moe import replay_spec_hook
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook, compose_hooks

    state = AlignedForwardState(fmt)
    hook = compose_hooks(aligned_spec_hook(state) if aligned else None,
                         replay_spec_hook(replay) if replay else None)
    model = build_model(arch, None, dtype, spec_hook=hook, use_te=impl,
                        moe_grouped_gemm=grouped)
    load_hf_weights(model, arch, tensors.__getitem__, groups_from_parallel_state())
    return state, model.cuda()


def _run(model, arch, x, state=None, plain=False, replay=None, route=None):
    model.zero_grad()
    pos = torch.arange(x.shape[1], device="cuda")[None].expand_as(x)
    with contextlib.ExitStack() as stack:
        if plain:
            stack.enter_context(state.only(()))
        if replay is not None:
            stack.enter_context(replay.use(route, "update"))
        logits = model(x, pos, attention_mask=None).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                 torch.roll(x, -1, 1).flatten())
        loss.backward()
    return logits.detach(), loss.detach(), {k: v.float() for k, v in
                                            grads_as_hf(model, arch).items()}


def _fp32_routed(impl="transformer_engine"):
    """(arch, HF tensors, token ids, the fp32 sequential model's experts per token): BF16
    models replay these experts, so their comparison is not moved by top-k flips. ``impl``:
    the spec of that fp32 model (``local`` where Transformer Engine is not installed)."""
    hf, arch = tiny_hf("moe")
    tensors = hf_state(hf)
    x = ids(batch=4, seq=64).cuda()
    _, ref = _model(arch, tensors, torch.float32, False, aligned=False, impl=impl)
    with record_routing(ref) as maps, torch.no_grad():
        ref(x, torch.arange(x.shape[1], device="cuda")[None].expand_as(x), attention_mask=None)
    return arch, tensors, x, routing_ids(maps, arch.moe_top_k).cuda()


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _compare(got, want, bound, what):
    assert _rel(got[0], want[0]) <= bound, (what, _rel(got[0], want[0]))
    assert abs(got[1].item() - want[1].item()) <= bound * abs(want[1].item()), what
    assert sorted(got[2]) == sorted(want[2]), what
    worst = max((_rel(got[2][k], want[2][k]), k) for k in want[2])
    print(f"{what}: logits rel {_rel(got[0], want[0]):.2e}, worst gradient {worst}")
    assert worst[0] <= bound, (what, worst)


@needs_te
def test_grouped_equals_sequential_fp32_every_format(megatron):
    from megatron_qrl.quant import get_spec, list_specs

    hf, arch = tiny_hf("moe")
    tensors = hf_state(hf)
    x = ids(batch=4, seq=32).cuda()
    g_state, g_model = _model(arch, tensors, torch.float32, True)
    s_state, s_model = _model(arch, tensors, torch.float32, False)
    for fmt in ("plain", *list_specs()):
        for st in (g_state, s_state):
            st.spec = get_spec("int8" if fmt == "plain" else fmt)
            st.mark_weights_updated()
        got = _run(g_model, arch, x, g_state, plain=fmt == "plain")
        want = _run(s_model, arch, x, s_state, plain=fmt == "plain")
        _compare(got, want, 1e-4, f"fp32 {fmt}")


@needs_te
def test_grouped_bf16_uses_grouped_mm_and_matches_sequential(megatron):
    from megatron_qrl.moe import RoutingReplay
    from megatron_qrl.quant import get_spec, list_specs

    arch, tensors, x, route = _fp32_routed()
    runs = {}
    for grouped in (True, False):
        replay = RoutingReplay("all", arch.num_experts, arch.moe_top_k)
        runs[grouped] = (*_model(arch, tensors, torch.bfloat16, grouped, replay=replay), replay)
    for fmt in list_specs():
        out = {}
        for grouped, (state, model, replay) in runs.items():
            state.spec = get_spec(fmt)
            state.mark_weights_updated()
            with _Ops() if grouped else contextlib.nullcontext() as ops:
                out[grouped] = _run(model, arch, x, state, replay=replay, route=route)
            if grouped and hasattr(torch, "_grouped_mm"):
                assert "_grouped_mm" in ops.names, sorted(ops.names)
        _compare(out[True], out[False], 2e-2, f"bf16 {fmt}")


@needs_te
def test_plain_grouped_stand_in_matches_te_grouped_linear(megatron):
    from megatron_qrl.moe import RoutingReplay

    arch, tensors, x, route = _fp32_routed()
    out = []
    for aligned in (True, False):
        replay = RoutingReplay("all", arch.num_experts, arch.moe_top_k)
        state, model = _model(arch, tensors, torch.bfloat16, True, aligned=aligned, replay=replay)
        names = {type(m).__name__ for m in model.modules()}
        assert ("AlignedTEGroupedMLP" in names) == aligned, names
        out.append(_run(model, arch, x, state, plain=aligned, replay=replay, route=route))
    _compare(out[0], out[1], 2e-2, "plain grouped stand-in vs TE GroupedLinear")


@needs_te
def test_fused_router_records_the_unfused_routers_experts(megatron):
    """``--moe-router-fusion`` (TE's fused top-k): a forward that does not replay records the
    experts the unfused router chooses (as sets: the metric is set-based), fp32."""
    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.streaming import groups_from_parallel_state, load_hf_weights
    from megatron_qrl.moe import RoutingReplay, recorded_ids, replay_spec_hook

    hf, arch = tiny_hf("moe")
    tensors = hf_state(hf)
    x = ids(batch=4, seq=64).cuda()
    pos = torch.arange(x.shape[1], device="cuda")[None].expand_as(x)
    got = []
    for fused in (True, False):
        replay = RoutingReplay("recompute", arch.num_experts, arch.moe_top_k)
        model = build_model(arch, None, torch.float32, spec_hook=replay_spec_hook(replay),
                            use_te="transformer_engine", moe_grouped_gemm=True,
                            moe_router_fusion=fused)
        load_hf_weights(model, arch, tensors.__getitem__, groups_from_parallel_state())
        with torch.no_grad():
            model.cuda()(x, pos, attention_mask=None)
        got.append(recorded_ids(replay, arch.num_layers).sort(-1).values)
    assert torch.equal(got[0], got[1])
