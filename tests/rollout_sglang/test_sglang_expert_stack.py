"""Expert-stacked wire tensors (megatron_qrl.rollout_sglang.sync: ``stack_experts``).

The stream transform (order, what stacks and what passes through, one layer held), and the
in-place sync with stacked tensors against the per-tensor sync: SGLangEngine's real bucketing
(flat and not, buckets splitting layers) into ``load_packed`` on the SGLang-like FusedMoE fake
of tests/rollout_sglang/sglang_fused_moe_fake.py, bit-identical for every format at TP 1 and 2; the batched
direct-load tests of test_sglang_expert_batch re-run with every bucket stacked (fallback groups
included); the engine end to end with per-expert fingerprints and ``verify``.

``python -m tests.rollout_sglang.test_sglang_expert_stack`` prints the CPU per-tensor cost of a 128-expert
layer through ``load_packed``, direct loads vs direct + stacked.
"""

from __future__ import annotations

import re
import weakref

import pytest
import torch
from torch import nn

from megatron_qrl.rollout.base import Checksums, WeightManifest, tensor_checksum
from megatron_qrl.rollout_sglang import SGLangEngine, SGLangOptions
from megatron_qrl.rollout_sglang.sync.loader import experts as expert_loads
from megatron_qrl.rollout_sglang.sync.loader import load_packed
from megatron_qrl.rollout_sglang.sync.loader.experts import unstack, unstack_all
from megatron_qrl.rollout_sglang.sync.protocol import expert_name, module_key, parse_stacked
from megatron_qrl.rollout_sglang.sync.sender import StreamTracker, requests, stack_experts
from tests.rollout_sglang import sglang_fused_moe_fake as fake
from tests.rollout_sglang import test_sglang_expert_batch as batch
from tests.rollout_sglang.test_sglang_engine_sync import fake_io_struct  # noqa: F401  (sglang io_struct stub)
from tests.rollout_sglang.test_sglang_expert_batch import FORMATS, _rand, init_params, make_moe

PROJS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def no_metadata(monkeypatch):
    monkeypatch.setattr(fake, "META", None)


# ---- the stream transform ------------------------------------------------------------
def _layer(i, experts=range(4), leaves=("weight", "weight_scale"), make=None):
    """A decoder layer's HF stream: a norm, the experts (per expert: gate, up, down; per
    projection its leaves), a norm after the experts."""
    make = make or (lambda name, e: torch.full((2, 3), float(e)) + len(name))
    pre = f"model.layers.{i}."
    out = [(f"{pre}input_layernorm.weight", torch.ones(3))]
    out += [(f"{pre}mlp.experts.{e}.{p}.{leaf}", None) for e in experts for p in PROJS
            for leaf in leaves]
    out.append((f"{pre}post_attention_layernorm.weight", torch.ones(3)))
    return [(n, make(n, int(n.split(".")[5])) if t is None else t) for n, t in out]


def _kinds(i, leaves=("weight", "weight_scale")):
    return [f"model.layers.{i}.mlp.experts.*.{p}.{leaf}" for p in PROJS for leaf in leaves]


def test_stacks_each_layer_per_kind_in_first_appearance_order():
    src = [("model.embed_tokens.weight", torch.ones(5))] + _layer(0) + _layer(1) + [
        ("model.norm.weight", torch.ones(3))]
    out = list(stack_experts(iter(src)))
    norms = lambda i: [f"model.layers.{i}.input_layernorm.weight",  # noqa: E731
                       f"model.layers.{i}.post_attention_layernorm.weight"]
    # non-expert tensors at once, each layer's stacked kinds when the layer ends
    assert [n for n, _ in out] == (["model.embed_tokens.weight"] + norms(0) + _kinds(0)
                                   + norms(1) + _kinds(1) + ["model.norm.weight"])
    per = dict(src)
    for name, t in out:
        if parse_stacked(name):
            assert t.shape == (4, 2, 3)
            for e in range(4):
                assert torch.equal(t[e], per[expert_name(name, e)])
        else:
            assert t is per[name]
    # the inverse: every per-expert tensor back, bit for bit, experts in order per kind
    back = unstack_all(out)
    assert sorted(n for n, _ in back) == sorted(per)
    assert all(torch.equal(t, per[n]) for n, t in back)
    assert [n for n, _ in back if ".gate_proj.weight" in n][:4] == [
        f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(4)]


def test_unstack_gives_views_and_names():
    t = torch.arange(24.0).view(4, 2, 3)
    pairs = unstack("model.layers.7.mlp.experts.*.down_proj.weight_scale_inv", t)
    assert [n for n, _ in pairs] == [
        f"model.layers.7.mlp.experts.{e}.down_proj.weight_scale_inv" for e in range(4)]
    for e, (_, v) in enumerate(pairs):
        assert v.data_ptr() == t[e].data_ptr() and torch.equal(v, t[e])  # views, no copies
    assert parse_stacked("model.layers.7.mlp.experts.*.up_proj.weight") == (
        "model.layers.7.mlp.experts", "up_proj", "weight")
    assert parse_stacked("model.layers.7.mlp.experts.3.up_proj.weight") is None
    assert parse_stacked("model.layers.7.mlp.gate.weight") is None
    with pytest.raises(ValueError, match="is not a stacked expert name"):
        unstack("model.layers.7.mlp.experts.3.up_proj.weight", t)
    assert module_key("model.layers.7.mlp.experts.*.up_proj.weight") == (
        "model.layers.7.mlp.experts")


@pytest.mark.parametrize("case", ["missing", "out_of_order", "shape", "dtype", "duplicate"])
def test_kinds_that_cannot_stack_pass_through_per_expert(case):
    src = _layer(0)
    bad = "model.layers.0.mlp.experts.2.up_proj.weight_scale"
    if case == "missing":
        src = [(n, t) for n, t in src if n != bad]
    elif case == "shape":
        src = [(n, torch.zeros(3, 2) if n == bad else t) for n, t in src]
    elif case == "dtype":
        src = [(n, t.double() if n == bad else t) for n, t in src]
    elif case == "duplicate":  # expert 2's entry names expert 1 again
        src = [(n.replace(".2.up_proj.weight_scale", ".1.up_proj.weight_scale"), t)
               for n, t in src]
    else:  # the whole layer's experts in the order 0, 2, 1, 3
        order = {e: i for i, e in enumerate([0, 2, 1, 3])}
        src = sorted(src, key=lambda p: order.get(int(p[0].split(".")[5]), -1)
                     if ".experts." in p[0] else (-2 if "input" in p[0] else 9))
    out = list(stack_experts(iter(src)))
    kind = "model.layers.0.mlp.experts.*.up_proj.weight_scale"
    src_kind = [(n, t) for n, t in src if re.sub(r"experts\.\d+", "experts.*", n) == kind]
    if case == "out_of_order":  # no kind stacks: the layer exactly as it came
        names = [n for n, _ in src]
        names.remove("model.layers.0.post_attention_layernorm.weight")
        names.insert(1, "model.layers.0.post_attention_layernorm.weight")
        assert [n for n, _ in out] == names
        return
    # only the bad kind per expert (stream order, same tensors), at its place among the kinds
    got_names = [n for n, _ in out if ".experts." in n]
    i = got_names.index(src_kind[0][0])
    assert got_names[:i] == _kinds(0)[:3]
    assert [(n, t) for n, t in out if n in dict(src_kind)] == src_kind
    assert got_names[i + len(src_kind):] == _kinds(0)[4:]


def test_holds_one_layer_of_experts_at_most():
    alive, pulled = set(), []

    def produce():  # fresh tensors, held by nobody but the consumer of this generator
        for i in range(3):
            for n, tmpl in _layer(i, experts=range(8)):
                t = tmpl.clone()
                key = len(pulled)
                pulled.append(n)
                alive.add(key)
                weakref.finalize(t, alive.discard, key)
                yield n, t
                del t

    per_layer = 8 * 6
    most = 0
    for name, t in stack_experts(produce()):
        most = max(most, len(alive))
        if parse_stacked(name):  # a stacked kind is out before the next layer is read
            layer = int(name.split(".")[2])
            assert len(pulled) <= (layer + 1) * (per_layer + 2) + 1
        del t
    assert per_layer <= most <= per_layer + 2


# ---- in-place sync through the real sender ---------------------------------------------
LAYERS = 2
_EXPERT_NAME = re.compile(r"^(?P<moe>model\.layers\.\d+\.mlp\.experts)\.(?P<e>\d+)\."
                          r"(?P<proj>\w+)\.(?P<leaf>\w+)$")


class Norm(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.weight = nn.Parameter(torch.full((batch.H,), value), requires_grad=False)


class Qwen3MoeForCausalLM(nn.Module):  # expert_loads.MODELS; LAYERS layers of FusedMoE fakes
    def __init__(self, fmt, tp):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        for i in range(LAYERS):
            layer = nn.Module()
            layer.input_layernorm, layer.post_attention_layernorm = Norm(i), Norm(-i)
            layer.mlp = nn.Module()
            layer.mlp.experts = make_moe(fmt, tp)
            init_params(layer.mlp.experts, seed=7 + i)
            self.model.layers.append(layer)
        self.seen: list[str] = []

    def load_weights(self, weights):  # SGLang's: per-expert names mapped, unknown ones skipped
        params = dict(self.named_parameters())
        for name, t in weights:
            self.seen.append(name)
            m = _EXPERT_NAME.match(name)
            if m is None:
                if name in params:
                    params[name].data.copy_(t)
                continue
            prefix, shard = {"gate_proj": ("w13_", "w1"), "up_proj": ("w13_", "w3"),
                             "down_proj": ("w2_", "w2")}[m["proj"]]
            pname = f"{m['moe']}.{prefix}{m['leaf']}"
            if pname in params:
                params[pname].weight_loader(params[pname], t, pname, shard_id=shard,
                                            expert_id=int(m["e"]))


def model_stream(fmt, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        out.append((f"{pre}input_layernorm.weight", torch.randn(batch.H, generator=g)))
        for e in range(batch.E):
            for proj in PROJS:
                for leaf, (gu, down, dt) in FORMATS[fmt][2].items():
                    shape = down if proj == "down_proj" else gu
                    t = torch.ones(()) if dt == "one" else _rand(shape, dt or torch.float32, g)
                    out.append((f"{pre}mlp.experts.{e}.{proj}.{leaf}", t))
        out.append((f"{pre}post_attention_layernorm.weight", torch.randn(batch.H, generator=g)))
    return out


def send(model, stream, fmt, *, flat, direct, stacked, bucket_bytes, sent=None):
    """SGLangEngine's in-place bucketing (fingerprints, stacking, tracker, flat buckets), each
    bucket applied by ``load_packed`` as the engine's scheduler would."""
    tracker = StreamTracker(tuple(FORMATS[fmt][2]), direct_experts=direct)
    n = 0
    for items, _, _ in requests(iter(stream), sent or Checksums(), tracker, torch.device("cpu"),
                                bucket_bytes=bucket_bytes, flat=flat, stack=stacked):
        load_packed(model, items)
        n += 1
    return n


def assert_same_model(ref, got):
    for (name, a), (name_b, b) in zip(ref.named_parameters(), got.named_parameters(),
                                      strict=True):
        assert name == name_b
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), name


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("tp", [(1, 0), (2, 1)])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_stacked_inplace_sync_is_bit_identical_to_per_tensor_sync(fmt, tp, flat, tmp_path,
                                                                  monkeypatch):
    from megatron_qrl.rollout_sglang.sync.debug import PROFILE_ENV, summarize

    stream = model_stream(fmt)
    ref = Qwen3MoeForCausalLM(fmt, tp)
    send(ref, stream, fmt, flat=flat, direct=False, stacked=False, bucket_bytes=1 << 30)
    got = Qwen3MoeForCausalLM(fmt, tp)
    stacked_bytes = max(t.numel() * t.element_size() for _, t in stream) * batch.E
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "phases.jsonl"))
    sent = Checksums()
    buckets = send(got, stream, fmt, flat=flat, direct=True, stacked=True,
                   bucket_bytes=stacked_bytes, sent=sent)
    assert buckets > 2 * LAYERS  # buckets end inside layers and inside the experts module
    assert_same_model(ref, got)
    assert not any(".experts." in n for n in got.seen)  # all loaded directly
    assert not vars(got)["_qrl_inplace_pending"]
    # fingerprints per expert; the loader counted wire tensors, and loads per expert
    assert sent.result() == {n: tensor_checksum(t) for n, t in stream}
    (row,) = summarize(tmp_path / "phases.jsonl")
    n_expert = sum(".experts." in n for n, _ in stream)
    assert row["experts"] == row["experts_batched"] == n_expert
    assert row["tensors"] == len(stream) - n_expert + LAYERS * 3 * len(FORMATS[fmt][2])


@pytest.mark.parametrize("flat", [False, True])
def test_stacked_tensors_are_unstacked_without_direct_loads(flat):
    """The control message without direct loads (or a model class not in MODELS): the
    stacked tensors reach load_weights as per-expert views, never by their stacked name."""
    fmt = "fp8_block"
    stream = model_stream(fmt)
    ref = Qwen3MoeForCausalLM(fmt, (2, 0))
    send(ref, stream, fmt, flat=flat, direct=False, stacked=False, bucket_bytes=1 << 30)
    got = Qwen3MoeForCausalLM(fmt, (2, 0))
    send(got, stream, fmt, flat=flat, direct=False, stacked=True, bucket_bytes=2000)
    assert_same_model(ref, got)
    assert ref.seen == [n for n, _ in stream]
    assert sorted(got.seen) == sorted(ref.seen)  # per expert, never a stacked name


def test_a_stacked_name_reaching_load_weights_fails_the_module():
    """Were a stacked tensor handed to load_weights by name, SGLang would skip it: the
    shard-load check must catch that (it is why the loader unstacks)."""
    from megatron_qrl.rollout_sglang.sync.loader import packed
    from megatron_qrl.rollout_sglang.sync.protocol import InplaceSyncError

    fmt = "int8"
    got = Qwen3MoeForCausalLM(fmt, (1, 0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packed, "unstack_all", lambda weights: list(weights))
        with pytest.raises(InplaceSyncError, match=r"experts: 'w13_weight' got 0 of 8"):
            send(got, model_stream(fmt), fmt, flat=False, direct=False, stacked=True,
                 bucket_bytes=1 << 30)


# ---- the batched direct-load tests, every bucket stacked ------------------------------
@pytest.fixture
def stacked_buckets(monkeypatch):
    """test_sglang_expert_batch's direct loads, with each bucket stacked first."""
    real = expert_loads.load_experts_directly
    wire = []

    def stacked(model, modules, bucket, counts=None):
        out = list(stack_experts(bucket))
        wire.extend(n for n, _ in out)
        return real(model, modules, out, counts)

    monkeypatch.setattr(expert_loads, "load_experts_directly", stacked)
    yield wire
    assert wire and all(parse_stacked(n) for n in wire)  # every kind did stack


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("tp", [(1, 0), (2, 0), (2, 1)])
def test_batched_loads_with_stacked_tensors(fmt, tp, stacked_buckets):
    batch.test_batched_loads_are_bit_identical_to_per_tensor_loads(fmt, tp)


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_expert_maps_and_up_first_with_stacked_tensors(fmt, stacked_buckets, monkeypatch):
    batch.test_up_first_and_non_gated_and_expert_maps(fmt, monkeypatch)


def test_non_gated_last_write_with_stacked_tensors(stacked_buckets):
    batch.test_non_gated_w13_per_tensor_scales_keep_the_last_write()


@pytest.mark.parametrize("case", ["method", "flag", "subclass", "input_scale_check"])
def test_fallback_groups_with_stacked_tensors(case, stacked_buckets, monkeypatch):
    batch.test_unsupported_groups_fall_back_to_per_tensor_loads(case, monkeypatch)


def test_stacked_tensors_without_a_loader_are_returned_unstacked():
    moe = make_moe("int8")
    model = batch.Qwen3MoeForCausalLM(moe)
    modules = dict(model.named_modules())
    bucket = list(stack_experts(batch.stream("int8")))
    del moe._parameters["w2_weight_scale"]  # no parameter: back to load_weights, per expert
    rest = expert_loads.load_experts_directly(model, modules, bucket)
    assert [n for n, _ in rest] == [f"{batch.PRE}.{e}.down_proj.weight_scale"
                                    for e in range(batch.E)]
    other = type("OtherMoeModel", (nn.Module,), {})()  # not in MODELS: everything unstacked
    assert [n for n, _ in expert_loads.load_experts_directly(other, modules, bucket)] == [
        n for n, _ in unstack_all(bucket)]


# ---- the engine end to end -------------------------------------------------------------
@pytest.mark.parametrize("flatten,prefetch", [(False, 0), (True, 1)])
def test_engine_stacked_sync_verifies_per_expert_manifest(flatten, prefetch, monkeypatch):
    from tests.rollout_sglang.test_sglang_engine_sync import _engine
    from tests.rollout_sglang.test_sglang_inplace import FakeModel, live_tensors, weights

    monkeypatch.setattr(expert_loads, "MODELS", expert_loads.MODELS | {"FakeModel"})
    for in_models in (True, False):
        if not in_models:  # a model whose mapping was not read: unstacked, via load_weights
            monkeypatch.setattr(expert_loads, "MODELS", expert_loads.MODELS - {"FakeModel"})
        model = FakeModel()
        seen = []
        real = model.load_weights
        model.load_weights = lambda ws, _r=real, _s=seen: _s.extend(n for n, _ in ws) or _r(ws)
        eng = _engine(model, bucket_bytes=300, flatten=flatten, prefetch=prefetch,
                      direct=True, stacked=True)
        manifest = WeightManifest()
        eng.update_weights(manifest.record(iter(weights(1))), version=3)
        eng.verify(manifest)  # per-expert names and fingerprints
        assert set(manifest.checksums) == {n for n, _ in weights(1)}
        want = live_tensors(FakeModel(seed=1))
        for k, t in live_tensors(model).items():
            torch.testing.assert_close(t, want[k], rtol=0, atol=0, msg=k)
        assert not any("*" in n for n in seen)
        assert any(".experts." in n for n in seen) == (not in_models)


def test_engine_option_errors():
    with pytest.raises(ValueError, match="stack-experts needs direct expert loads"):
        SGLangEngine("/nonexistent", "int8", SGLangOptions(
            sync="inplace", direct_expert_loads=False, stack_experts=True))
    with pytest.raises(ValueError, match="stack-experts apply to the in-place sync.*with disk"):
        SGLangEngine("/nonexistent", "fp8_block", SGLangOptions(
            sync="disk", sync_dir="/tmp", direct_expert_loads=False, stack_experts=True))


# ---- CPU timing: python -m tests.rollout_sglang.test_sglang_expert_stack ---------------
def _time_layer(fmt="fp8_block", experts=128, runs=7):
    """Median seconds per expert tensor of one ``experts``-expert layer through
    ``load_packed`` (one flat bucket, direct loads; the sender's bucket prepared before)."""
    import statistics
    import time

    old = batch.E
    batch.E = experts
    try:
        stream = [(n, t) for n, t in model_stream(fmt) if n.startswith("model.layers.0.")]
        n_expert = sum(".experts." in n for n, _ in stream)
        out = {}
        for label, stacked in (("direct", False), ("direct+stacked", True)):
            times = []
            for _ in range(runs):
                tracker = StreamTracker(tuple(FORMATS[fmt][2]), direct_experts=True)
                buckets = [items for items, _, _ in requests(
                    iter(stream), Checksums(), tracker, torch.device("cpu"),
                    bucket_bytes=1 << 30, flat=True, stack=stacked)]
                model = Qwen3MoeForCausalLM(fmt, (1, 0))
                t0 = time.perf_counter()
                for items in buckets:
                    load_packed(model, items)
                times.append(time.perf_counter() - t0)
            out[label] = statistics.median(times) / n_expert * 1e6
        return n_expert, out
    finally:
        batch.E = old


if __name__ == "__main__":
    torch.set_num_threads(1)
    fake.META = None
    for fmt in FORMATS:
        n, us = _time_layer(fmt)
        print(f"{fmt:10s} {n:5d} expert tensors of one 128-expert layer, load_packed (flat, "
              "direct): " + ", ".join(f"{k} {v:.2f} us" for k, v in us.items())
              + " per expert tensor")


@pytest.fixture
def planners(monkeypatch):
    """Which planner wrote each parameter: ``stacked`` (one step per stack) or ``views``."""
    from megatron_qrl.rollout_sglang.sync.loader import expert_batch as eb

    used = {"stacked": 0, "views": 0}
    real_stacked, real_views = eb._plan_stacked, eb._plan

    def stacked(ctx, loads):
        plan = real_stacked(ctx, loads)
        used["stacked"] += plan is not None
        return plan

    def views(ctx, loads):
        used["views"] += 1
        return real_views(ctx, loads)

    monkeypatch.setattr(eb, "_plan_stacked", stacked)
    monkeypatch.setattr(eb, "_plan", views)
    return used


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_whole_stacks_are_planned_once_per_stack(fmt, stacked_buckets, planners):
    batch.test_batched_loads_are_bit_identical_to_per_tensor_loads(fmt, (2, 1))
    # per parameter (w13_ and w2_ of each leaf); gate and up writing one region (nvfp4's
    # w13_input_scale, w4a16's w13_weight_shape: the last write wins) go view by view
    views = {"nvfp4": 1, "w4a16": 1}.get(fmt, 0)
    assert planners == {"stacked": len(FORMATS[fmt][2]) * 2 - views, "views": views}


def test_stacks_whose_experts_share_a_slot_are_planned_view_by_view(stacked_buckets, planners,
                                                                    monkeypatch):
    """Two experts in one slot (the last write wins, as per tensor): index_copy_ with repeated
    indices has no defined winner on CUDA, so the stacked planner declines."""
    monkeypatch.setattr(fake.FusedMoE, "_map_global_expert_id_to_local_expert_id",
                        lambda self, e: e // 2)
    ref, got, (calls, batched_n) = batch.load_both("int8", [batch.stream("int8")])
    batch.assert_same(ref, got)
    assert planners == {"stacked": 0, "views": 4} and sum(calls.values()) == 0


def test_a_scalar_under_a_stacked_name_is_refused():
    from megatron_qrl.rollout_sglang.sync.protocol import expert_views

    name = "model.layers.0.mlp.experts.*.up_proj.weight"
    for fn in (expert_views, unstack):
        with pytest.raises(ValueError, match="is a scalar; expected"):
            fn(name, torch.tensor(1.0))
    assert [v.tolist() for v in expert_views(name, torch.arange(4).view(2, 2))] == [[0, 1], [2, 3]]
