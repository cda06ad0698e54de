"""quant.expert_stacks and ``pack_state_dict(stack_experts=True)``: the packed experts stay
stacked from the pack stream to the wire — the same wire, bit for bit, without per-expert
copies on the trainer's side."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.pack_stream import pack_stream
from megatron_qrl.rl.sync import sync_weights
from megatron_qrl.rollout.base import Checksums
from megatron_qrl.rollout_sglang.sync.sender import (
    StreamTracker,
    packed_suffixes,
    requests,
    stack_experts,
)
from tests.quant.test_quant_pack_stream import FORMATS, assert_same_stream, moe_stream, reference


def test_stack_rows_is_a_view_of_neighbouring_rows_else_a_stack():
    from megatron_qrl.quant.expert_stacks import stack_rows

    base = torch.arange(24.0)
    rows = list(base.split(6))
    got = stack_rows([r.view(2, 3) for r in rows])
    assert got.data_ptr() == base.data_ptr() and got.shape == (4, 2, 3)  # no copy
    assert torch.equal(got, base.view(4, 2, 3))
    apart = [rows[0], rows[2]]  # one storage, not neighbours: a copy
    got = stack_rows(apart)
    assert got.data_ptr() != base.data_ptr() and torch.equal(got, torch.stack(apart))
    swapped = [rows[1], rows[0]]
    assert torch.equal(stack_rows(swapped), torch.stack(swapped))
    assert torch.equal(stack_rows([torch.ones(2), torch.zeros(2)]), torch.tensor([[1.0] * 2,
                                                                                 [0.0] * 2]))


@pytest.mark.parametrize("order", ["hf", "megatron"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_stacked_pack_is_the_reference_stacked(fmt, order):
    """Names, order, dtypes and bits of the reference stream with each layer's experts
    stacked per kind (``stack_experts`` of the one-at-a-time stream)."""
    spec = get_spec(fmt)
    stream = moe_stream(experts=4, expert_order=order)
    got = list(pack_stream(spec, iter(stream), stack_experts=True))
    want = list(stack_experts(reference(spec, stream)))
    assert sum("experts.*." in n for n, _ in want) == 2 * 3 * len(spec.packed_names(
        "model.layers.0.mlp.experts.0.up_proj.weight"))
    assert not any(".experts.0." in n for n, _ in want)
    assert_same_stream(got, want)
    ref = list(spec.pack_state_dict(iter(stream), stacked=False, stack_experts=True))
    assert_same_stream(ref, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the sync's device)")
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_stacked_pack_is_the_reference_stacked(fmt):
    """On the GPU (windows of the default size, one quantizer call per kind and layer): the
    stacked pack stream equals the reference's stacked, each stack on its tensors' device."""
    spec = get_spec(fmt)
    stream = [(n, w.cuda()) for n, w in moe_stream(experts=16, inter=256)]
    got = list(spec.pack_state_dict(iter(stream), stack_experts=True))
    want = list(stack_experts(spec.pack_state_dict(iter(stream), stacked=False)))
    assert_same_stream(got, want)
    assert all(t.device == ref.device for (_, t), (_, ref) in zip(got, want))


class FreshTensors(TorchDispatchMode):
    """Counts the tensors of more than one element that aten ops create with storage of their
    own (not a view of, nor written into, an input): allocations, copies, results. Scalars
    aside: nvfp4's per-weight amaxes (one ``_foreach_norm`` for a window) are numbers, not
    copies of expert data. ``dtypes``: only tensors of these dtypes count."""

    def __init__(self, dtypes: tuple[torch.dtype, ...] | None = None):
        super().__init__()
        self.count, self.dtypes = 0, dtypes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        self.count += sum(isinstance(t, torch.Tensor) and t.numel() > 1
                          and (self.dtypes is None or t.dtype in self.dtypes)
                          and t.untyped_storage().data_ptr() not in inputs
                          for t in tree_flatten(out)[0])
        return out


class WireEngine:
    """The trainer's side of the in-place SGLang sync with expert stacks (flat buckets, the
    engine's sender :func:`requests`), keeping what would go on the wire."""

    verifies_own_update = True
    stacked_experts = True
    quantizes_into = False  # RolloutEngine's: it takes the packed stream

    def __init__(self, spec, bucket_bytes):
        self.spec, self.bucket_bytes = spec, bucket_bytes
        self.wire, self.sent, self.version = [], {}, None

    def update_weights(self, named_tensors, version):
        sent = Checksums()
        tracker = StreamTracker(packed_suffixes(self.spec), direct_experts=True)
        self.wire = [items for items, _, _ in requests(
            named_tensors, sent, tracker, torch.device("cpu"), bucket_bytes=self.bucket_bytes,
            flat=True, stack=True)]
        self.sent, self.version = sent.result(), version

    def weight_version(self):
        return self.version


def _sync(spec, experts, count=False):
    """One sync through :class:`WireEngine`; counting: in one bucket (a bucket is a few
    tensors: control, meta, buffer)."""
    stream = moe_stream(experts=experts, hidden=128, inter=128, heads=2, head_dim=64)
    engine, fresh = WireEngine(spec, 1 << 30 if count else 1 << 18), FreshTensors()
    with fresh if count else torch.no_grad():
        res = sync_weights(iter(stream), engine, spec, version=1)
    return engine, res, fresh.count, stream


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_block", "w4a16", "nvfp4"])
def test_trainer_side_makes_no_per_expert_copies(fmt):
    """The tensors the trainer's side creates in a sync (pack, stack, fingerprint, bucket) do
    not grow with the number of experts: the experts' packed tensors are rows of the stacked
    quantization, stacked for the wire as views, never one tensor per expert (before: one
    quantizer result or one owned copy per expert, then a stack of them). The wire and the
    per-expert fingerprints are the per-expert stream's (the engine's side is unchanged)."""
    spec = get_spec(fmt)
    counts = [_sync(spec, experts, count=True)[2] for experts in (4, 16)]
    assert counts[0] == counts[1] > 0

    engine, res, _, stream = _sync(spec, 8)
    per_expert = reference(spec, stream)
    want = Checksums()
    for name, t in per_expert:
        want.add(name, t)
    assert engine.sent == want.result() and res.num_tensors == len(per_expert)
    sent = Checksums()  # the per-expert stream through the same sender: the same wire
    old = [items for items, _, _ in requests(iter(per_expert), sent, StreamTracker(
        packed_suffixes(spec), direct_experts=True), torch.device("cpu"), bucket_bytes=1 << 18,
        flat=True, stack=True)]
    assert len(old) == len(engine.wire) > 1
    for got, exp in zip(engine.wire, old):
        assert [n for n, _ in got] == [n for n, _ in exp]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, exp))


def test_the_sglang_engine_takes_expert_stacks_where_its_wire_stacks_them():
    """``stacked_experts``: in place with ``stack_experts`` (its default there) only; a
    supervisor answers for its engine (rl.sync.sync_weights reads it)."""
    from megatron_qrl.rollout.supervisor import EngineSupervisor
    from megatron_qrl.rollout_sglang import SGLangEngine, SGLangOptions

    def engine(fmt, **kw):
        eng = object.__new__(SGLangEngine)  # no sglang.Engine: only the options are read
        eng.options = SGLangOptions(**kw).resolve(fmt)
        return eng

    assert engine("int8").stacked_experts and engine("fp8", sync="inplace").stacked_experts
    assert not engine("int8", stack_experts=False).stacked_experts
    assert not engine("int8", direct_expert_loads=False).stacked_experts
    assert not engine("bf16").stacked_experts
    assert not engine("int8", sync="distributed").stacked_experts
    assert EngineSupervisor(lambda: engine("int8"), lambda e, v: None).stacked_experts
