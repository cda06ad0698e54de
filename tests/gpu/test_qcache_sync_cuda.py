"""H200: the weight sync packs the aligned forward's Q(W) cache on CUDA, bit for bit.

Tiny BF16 Qwen3 / Qwen3-MoE (stacked experts) on the GPU with the aligned forward (fp8 / int8
on the real GEMM: ``torch._scaled_mm`` / ``_int_mm`` codes; fp8_block, w4a16, nvfp4 on the
fake GEMM with their codes kept, the fused Triton quantizers where they run). After one
forward, the stream the sync packs from the cache (``pack_state_dict(quantized=...)``, expert
stacks as the in-place SGLang sync takes them) equals, name by name and byte by byte, the
stream the sync packed before (the GPU's stacked quantization windows), and no weight is
quantized during the sync.

Run: ``pytest tests/gpu/test_qcache_sync_cuda.py -rs`` (< 1 min).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from megatron_qrl.quant import get_spec  # noqa: E402
from megatron_qrl.rl.qcache_sync import QCacheSync  # noqa: E402
from tests.helpers.quant_calls import counting_quantizer, same_bytes  # noqa: E402

CASES = [("fp8", "real"), ("int8", "real"), ("fp8_block", "fake"), ("w4a16", "fake"),
         ("nvfp4", "fake")]


@pytest.fixture(scope="module")
def megatron():
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        yield


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("fmt,gemm", CASES)
def test_sync_packs_the_cache_bit_for_bit_on_cuda(megatron, kind, fmt, gemm):
    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.stacked_experts import stacked_experts_spec_hook
    from megatron_qrl.models.streaming import (
        groups_from_parallel_state,
        iter_hf_tensors,
        load_hf_weights,
    )
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook, compose_hooks
    from tests.helpers.te_quant_fixtures import hf_state, ids, tiny_hf

    if gemm == "real" and fmt == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 GEMMs need CUDA sm >= 89")
    hf, arch = tiny_hf(kind)
    spec = get_spec(fmt)
    state = AlignedForwardState(fmt, gemm=gemm)
    qcache = QCacheSync.plan(state, spec)
    hook = compose_hooks(stacked_experts_spec_hook if kind == "moe" else None,
                         aligned_spec_hook(state))
    model = build_model(arch, None, torch.bfloat16, spec_hook=hook, use_te=False,
                        use_cpu_initialization=False)
    load_hf_weights(model, arch, hf_state(hf).__getitem__, groups_from_parallel_state())
    model = model.cuda()
    x = ids(batch=2, seq=32).cuda()
    with torch.no_grad():
        model(x, torch.arange(x.shape[1], device="cuda")[None].expand_as(x), attention_mask=None)
    old = list(spec.pack_state_dict(iter_hf_tensors(model, arch), stack_experts=True))
    calls: list[str] = []
    with counting_quantizer(calls):
        new = list(spec.pack_state_dict(iter_hf_tensors(model, arch), stack_experts=True,
                                        quantized=qcache.lookup(model, arch)))
    assert calls == [], f"the sync quantized again: {calls[:4]}"
    assert qcache.reused > 0 and qcache.quantized == 0
    assert [n for n, _ in new] == [n for n, _ in old]
    for (name, a), (_, b) in zip(new, old):
        assert same_bytes(a, b), f"{fmt} {kind}: {name} differs"
