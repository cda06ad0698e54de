"""Quantize once per step: the weight sync packs the aligned forward's cached codes and scales.

Tiny random Qwen3 / Qwen3-MoE models (tests.helpers.te_quant_fixtures) on megatron-core's CPU
gloo world, synced into the reference engine (:class:`~megatron_qrl.rollout.reference.
ReferenceEngine`, which checks that its model computes with the dequantized packed tensors).
Each case compares the bytes the engine received with (1) the codes and scales held by the
trainer's Q(W) cache and (2) what the sync sent before (quantizing in the sync), and counts
the quantizer's calls.
"""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.rl.qcache_sync import QCacheSync, reuse_applies
from tests.helpers.quant_calls import counting_quantizer
from tests.helpers.quant_calls import same_bytes as _same
from tests.helpers.te_quant_fixtures import build, hf_state, ids, tiny_cfg, tiny_hf

# (format, gemm, model kind, experts): every quantized format (nvfp4's fake GEMM runs on the
# CPU too: the fused group's shared amax), on the fake GEMM, the real one where torch has it,
# and the MoE experts' three layouts
CASES = [
    ("fp8", "fake", "dense", None), ("fp8", "real", "dense", None),
    ("int8", "fake", "dense", None), ("int8", "real", "dense", None),
    ("fp8_block", "fake", "dense", None), ("w4a16", "fake", "dense", None),
    ("fp8", "real", "moe", "sequential"), ("w4a16", "fake", "moe", "sequential"),
    ("fp8", "real", "moe", "stacked"), ("fp8_block", "fake", "moe", "stacked"),
    ("int8", "fake", "moe", "grouped"),
    ("nvfp4", "fake", "dense", None), ("nvfp4", "fake", "moe", "stacked"),
    # fp8_block's real GEMM (SGLang's kernels, the CPU stand-in): dense linears hold codes,
    # the experts stay on the fake path with kept codes
    ("fp8_block", "real", "dense", None), ("fp8_block", "real", "moe", "stacked"),
]


@pytest.fixture(scope="module", autouse=True)
def sglang_block_kernels():
    """fp8_block's real GEMM needs SGLang's kernels: the CPU stand-in for this module."""
    from tests.helpers.sglang_block_standin import sglang_standin

    with sglang_standin() as mod:
        yield mod


class Job:
    """One trainer model with the aligned forward, its sync plan and a reference engine."""

    def __init__(self, fmt: str, gemm: str, kind: str, experts: str | None):
        from megatron_qrl.models.stacked_experts import stacked_experts_spec_hook
        from megatron_qrl.rollout.reference import ReferenceEngine
        from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook, compose_hooks

        hf, self.arch = tiny_hf(kind)
        self.spec = get_spec(fmt)
        self.state = AlignedForwardState(fmt, gemm=gemm)
        self.qcache = QCacheSync.plan(self.state, self.spec)
        hook = compose_hooks(stacked_experts_spec_hook if experts == "stacked" else None,
                             aligned_spec_hook(self.state))
        if experts == "grouped":  # megatron's TE spec (TEGroupedMLP) on the CPU
            from megatron_qrl.models.streaming import groups_from_parallel_state, load_hf_weights
            from tests.helpers.te_spec_cpu import build_te_shaped

            self.model = build_te_shaped(self.arch, hook, moe_grouped_gemm=True)
            load_hf_weights(self.model, self.arch, hf_state(hf).__getitem__,
                            groups_from_parallel_state())
        else:
            self.model = build(self.arch, hf_state(hf), hook)
        self.engine = ReferenceEngine(tiny_cfg(kind), fmt)
        self.version = 0

    def forward(self) -> None:
        x = ids(batch=1, seq=4)  # (some experts get no token)
        with torch.no_grad():
            self.model(x, torch.arange(x.shape[1])[None], attention_mask=None)

    def stream(self):
        from megatron_qrl.models.streaming import iter_hf_tensors

        return iter_hf_tensors(self.model, self.arch)

    def sync(self, reuse: bool = True) -> dict[str, torch.Tensor]:
        """The tensors the engine received from one sync (reuse: the job's sync plan)."""
        from megatron_qrl.rl.sync import sync_weights

        self.version += 1
        quantized = self.qcache.lookup(self.model, self.arch) if reuse else None
        sync_weights(self.stream(), self.engine, self.spec, self.version, quantized=quantized)
        return dict(self.engine._packed)

    def old_path(self) -> list[tuple[str, torch.Tensor]]:
        """What the sync sent before: quantizing every weight in the packer."""
        return list(self.spec.pack_state_dict(self.stream()))

    def cache(self) -> dict[str, torch.Tensor]:
        """The packed form of the codes and scales the aligned modules hold now, read from
        their caches directly (no refresh)."""
        from megatron_qrl.models.mapping import rule_for
        from megatron_qrl.te_quant.qcodes import real_codes
        from megatron_qrl.te_quant.real_gemm import RealWeight

        out = {}
        for mod_name, m in self.model.named_modules():
            if getattr(m, "_qrl_cache", None) is None or not hasattr(m, "qrl_codes"):
                continue
            held = m._qrl_cache[1]
            grouped = hasattr(m, "weights")
            if isinstance(held, RealWeight):
                dtype = (m.weights() if grouped else [m.weight])[0].dtype
                pairs = [RealWeight(c, s) for c, s in zip(held.codes, held.scale)] \
                    if grouped else [held]
                codes = [real_codes(self.spec, p, m.qrl_layout, dtype) for p in pairs]
            else:
                codes = m._qrl_codes if grouped else [m._qrl_codes]
            for e, parts in enumerate(codes):
                param = f"{mod_name}.weight{e}" if grouped else f"{mod_name}.weight"
                for hf, q in zip(rule_for(param, self.arch).hf_names, parts, strict=True):
                    out.update(self.spec.pack_quantized(hf, q))
        return out

    def step(self) -> None:
        """One optimizer step that changes every weight (the cache goes stale)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.05)
        self.state.attach_to_optimizer(opt)
        gen = torch.Generator().manual_seed(self.version)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()

    def recomputes(self) -> int:
        return sum(m.qrl_recomputes for m in self.model.modules() if hasattr(m, "qrl_codes"))


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(x for x in c if x))
def job(request, megatron):
    return Job(*request.param)


def test_sent_bytes_are_the_cache_and_the_old_path(job):
    job.forward()  # the step's quantization, in the forward
    before = job.recomputes()
    calls: list[str] = []
    with counting_quantizer(calls):
        sent = job.sync()
    assert calls == [], f"the sync quantized again: {calls[:4]}"
    assert job.recomputes() == before  # and the cache was fresh: nothing recomputed
    cache = job.cache()
    assert cache and set(cache) <= set(sent)
    for name, t in cache.items():
        assert _same(sent[name], t), f"{name}: sent bytes differ from the Q(W) cache"
    old = job.old_path()
    assert [n for n, _ in old] == list(sent)  # same names, same order
    for name, t in old:
        assert _same(sent[name], t), f"{name}: sent bytes differ from quantizing in the sync"
    assert job.qcache.reused == len({n.rsplit(".", 1)[0] for n in cache})
    assert job.qcache.quantized == 0


def test_the_forward_computes_with_the_same_weights_when_codes_are_kept(job):
    """The fake GEMM's cached weight, dequantized from the kept codes, is the one it caches
    without them (``quantize_shard``), bit for bit."""
    from megatron_qrl.te_quant.shard_quant import quantize_shard

    job.forward()
    seen = 0
    for m in job.model.modules():
        if getattr(m, "_qrl_codes", None) is None:
            continue
        weights = m.weights() if hasattr(m, "weights") else [m.weight]
        held = m._qrl_cache[1] if hasattr(m, "weights") else [m._qrl_cache[1]]
        for w, q in zip(weights, held):
            assert torch.equal(q, quantize_shard(job.spec, w, m.qrl_layout)), type(m).__name__
            seen += 1
    assert seen or job.state.gemm == "real"


def test_every_sent_tensor_owns_its_storage(job):
    """A packed tensor that is a view of a fused (gate_up) or stacked cache entry would carry
    the whole entry when a transport pickles it."""
    job.forward()
    packed = job.spec.pack_state_dict(job.stream(), quantized=job.qcache.lookup(job.model,
                                                                                job.arch))
    for name, t in packed:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name


def test_after_a_step_the_sync_sends_the_new_codes_quantized_once(job):
    job.forward()
    stale = job.cache()
    job.step()
    before = job.recomputes()
    calls: list[str] = []
    with counting_quantizer(calls):
        sent = job.sync()
        after_sync = len(calls)
        job.forward()  # the next forward finds the cache the sync refreshed
    assert after_sync == len(calls), "the forward after the sync quantized again"
    assert job.recomputes() - before == sum(1 for m in job.model.modules()
                                            if hasattr(m, "qrl_codes") and m._qrl_cache)
    old = dict(job.old_path())
    changed = 0
    for name, t in job.cache().items():
        assert _same(sent[name], t) and _same(sent[name], old[name]), name
        changed += not _same(t, stale[name])
    assert changed, "the step changed no code: the test cannot see a stale cache"


def test_fallback_quantizes_in_the_sync_and_says_why(megatron):
    from megatron_qrl.te_quant import AlignedForwardState

    fp8 = get_spec("fp8")
    assert reuse_applies(None, fp8) == (False, reuse_applies(None, fp8)[1])
    assert "bf16" in reuse_applies(None, fp8)[1]
    assert "not the rollout's" in reuse_applies(AlignedForwardState("int8"), fp8)[1]
    assert "BF16 weights" in reuse_applies(AlignedForwardState("int8"), get_spec("bf16"))[1]

    class Staged:  # a pipeline stage: the cache holds this stage's layers only
        stage = object()

    state = AlignedForwardState("fp8")
    plan = QCacheSync.plan(state, fp8, Staged())
    assert not plan.reuses and "sharded" in plan.describe() and not state.keep_codes
    assert plan.lookup(None, None) is None
    assert plan.describe().startswith("quantized by the sync")
    ok = QCacheSync.plan(AlignedForwardState("fp8", gemm="real"), fp8)
    assert ok.reuses and ok.describe().startswith("reused from the aligned forward's Q(W) cache")

