"""CPU tests of the in-place reload loader (megatron_qrl.rollout_sglang.sync.loader).

SGLang cannot be imported here, so the model below follows SGLang 0.5.17's protocol with
small fakes: quant methods whose ``create_weights`` register checkpoint-layout parameters
carrying ``weight_loader`` and whose ``process_weights_after_loading`` REPLACES them with
transposed / rescaled tensors (like w8a8_int8 and the Marlin repacks) and allocates a new
workspace; a model whose ``load_weights`` fuses q/k/v and gate/up, stacks experts, and
silently skips names it has no parameter for (as Qwen3MoeForCausalLM.load_weights does).
"""

import json

import pytest
import torch
from torch import nn

from megatron_qrl.rollout.wire import flatten
from megatron_qrl.rollout_sglang.sync.loader import load_packed
from megatron_qrl.rollout_sglang.sync.protocol import (
    CONTROL,
    FLAT,
    RECV,
    InplaceSyncError,
    encode_control,
    module_key,
)
from megatron_qrl.rollout_sglang.sync.sender import StreamTracker

H, FFN, E, HEAD = 8, 6, 3, 4
SUFFIXES = ("weight", "weight_scale")


def _param(t, loader):
    p = nn.Parameter(t, requires_grad=False)
    p.weight_loader = loader
    return p


class FakeLinearMethod:
    """Checkpoint: weight [out, in] + per-row weight_scale; live: (weight*scale).T, 2*scale."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype, **extra):
        out = sum(output_partition_sizes)
        loader = extra["weight_loader"]
        layer.register_parameter("weight", _param(torch.empty(out, input_size_per_partition),
                                                  loader))
        layer.register_parameter("weight_scale", _param(torch.empty(out, 1), loader))

    def process_weights_after_loading(self, layer):
        self.workspace = torch.zeros(4)  # new every time, like marlin_make_workspace
        layer.weight = nn.Parameter((layer.weight * layer.weight_scale).t(), requires_grad=False)
        layer.weight_scale = nn.Parameter(layer.weight_scale.data * 2, requires_grad=False)
        # a derived scale written like SGLang's copy_or_rebind_param, then re-typed (as the
        # NVFP4 Marlin path does): the live float64 tensor differs in dtype from the fp32 value
        new = layer.weight_scale.max().float()
        old = getattr(layer, "global_scale", None)
        if old is None:
            layer.global_scale = nn.Parameter(new, requires_grad=False)
        elif old.dtype == new.dtype:
            old.data.copy_(new)
        else:
            old.data = new
        layer.global_scale = nn.Parameter(layer.global_scale.double(), requires_grad=False)


class FakeMoEMethod:
    """Checkpoint: w13 [E, 2I, H], w2 [E, H, FFN] + scales; live: transposed, scaled copies."""

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra):
        ld = extra["weight_loader"]
        n = intermediate_size_per_partition
        for name, shape in (("w13_weight", (num_experts, 2 * n, hidden_size)),
                            ("w2_weight", (num_experts, hidden_size, n)),
                            ("w13_weight_scale", (num_experts, 2 * n, 1)),
                            ("w2_weight_scale", (num_experts, hidden_size, 1))):
            layer.register_parameter(name, _param(torch.empty(shape), ld))

    def process_weights_after_loading(self, layer):
        if getattr(layer, "is_marlin_converted", False):  # as compressed-tensors WNA16 MoE
            return
        for w in ("w13", "w2"):
            q = getattr(layer, f"{w}_weight") * getattr(layer, f"{w}_weight_scale")
            setattr(layer, f"{w}_weight", nn.Parameter(q.transpose(1, 2).contiguous(),
                                                       requires_grad=False))
        layer.workspace = torch.zeros(2)
        layer.is_marlin_converted = True


class FakeLinear(nn.Module):
    def __init__(self, in_size, out_sizes, shards=None):
        super().__init__()
        self.input_size, self.output_size = in_size, sum(out_sizes)
        self.input_size_per_partition = in_size
        self.output_partition_sizes = list(out_sizes)
        self.shards = shards or [None]
        self.params_dtype = torch.float32
        self.quant_method = FakeLinearMethod()
        self.quant_method.create_weights(self, in_size, out_sizes, in_size, sum(out_sizes),
                                         torch.float32, weight_loader=self.weight_loader)

    def weight_loader(self, param, loaded, shard_id=None):
        i = self.shards.index(shard_id)
        start = sum(self.output_partition_sizes[:i])
        param.data[start:start + loaded.shape[0]].copy_(loaded)


class FakeMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = self.num_local_experts = E
        self.hidden_size, self.intermediate_size_per_partition = H, FFN
        self.params_dtype = torch.float32
        self.expert_map = torch.arange(E)  # an init-time tensor the loader reads
        self.quant_method = FakeMoEMethod()
        self.quant_method.create_weights(self, E, H, FFN, torch.float32,
                                         weight_loader=self.weight_loader)

    def weight_loader(self, param, loaded, name, shard_id, expert_id):
        off = {"w1": 0, "w3": FFN, "w2": 0}[shard_id]
        param.data[int(self.expert_map[expert_id]), off:off + loaded.shape[0]].copy_(loaded)


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H), requires_grad=False)


class FakeModel(nn.Module):
    STACKED = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
               ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
               ("gate_up_proj", "up_proj", 1)]

    def __init__(self, seed=0):
        super().__init__()
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.qkv_proj = FakeLinear(H, [HEAD, HEAD, HEAD], ["q", "k", "v"])
        layer.self_attn.o_proj = FakeLinear(HEAD, [H])
        # a bias the layer registers itself (not create_weights), loaded directly
        layer.self_attn.o_proj.bias = _param(torch.zeros(H), lambda p, x: p.data.copy_(x))
        layer.mlp = nn.Module()
        layer.mlp.experts = FakeMoE()
        layer.input_layernorm = Norm()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])
        self.initial_load(weights(seed))

    def initial_load(self, named):
        self.load_weights(named)
        for m in self.modules():
            if hasattr(m, "quant_method"):
                m.quant_method.process_weights_after_loading(m)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            for pname, wname, shard in self.STACKED:
                if wname in name and "mlp.experts" not in name:
                    name = name.replace(wname, pname)
                    if name in params:
                        params[name].weight_loader(params[name], w, shard)
                    break
            else:
                for e in range(E):
                    for wname, pname, shard in ((f"experts.{e}.gate_proj.", "experts.w13_", "w1"),
                                                (f"experts.{e}.up_proj.", "experts.w13_", "w3"),
                                                (f"experts.{e}.down_proj.", "experts.w2_", "w2")):
                        if wname in name:
                            name = name.replace(wname, pname)
                            if name in params:
                                params[name].weight_loader(params[name], w, name, shard, e)
                            break
                if name in params and "experts" not in name:
                    getattr(params[name], "weight_loader",
                            lambda p, x: p.data.copy_(x))(params[name], w)


def weights(seed):
    """HF-named packed stream, in checkpoint order (each module's tensors together)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    pre = "model.layers.0."
    for proj, o, i in (("q_proj", HEAD, H), ("k_proj", HEAD, H), ("v_proj", HEAD, H),
                       ("o_proj", H, HEAD)):
        out += [(f"{pre}self_attn.{proj}.weight", torch.randn(o, i, generator=g)),
                (f"{pre}self_attn.{proj}.weight_scale", torch.rand(o, 1, generator=g) + 0.5)]
    out.append((f"{pre}self_attn.o_proj.bias", torch.randn(H, generator=g)))
    for e in range(E):
        for proj, o, i in (("gate_proj", FFN, H), ("up_proj", FFN, H), ("down_proj", H, FFN)):
            out += [(f"{pre}mlp.experts.{e}.{proj}.weight", torch.randn(o, i, generator=g)),
                    (f"{pre}mlp.experts.{e}.{proj}.weight_scale",
                     torch.rand(o, 1, generator=g) + 0.5)]
    out.append((f"{pre}input_layernorm.weight", torch.randn(H, generator=g)))
    return out


def live_tensors(model):
    out = {}
    for name, m in model.named_modules():
        for k, v in {**vars(m), **m._parameters}.items():
            if isinstance(v, torch.Tensor):
                out[f"{name}.{k}"] = v
        qm = getattr(m, "quant_method", None)
        for k, v in vars(qm).items() if qm is not None else ():
            if isinstance(v, torch.Tensor):
                out[f"{name}.quant_method.{k}"] = v
    return out


def sync(model, stream, per_bucket, suffixes=SUFFIXES, flat=False):
    """The sender: buckets of ``per_bucket`` tensors, each with its control tensor
    (``flat``: each bucket as one flattened buffer + its metadata, as SGLangEngine's
    ``flatten_buckets`` sends it)."""
    tracker, bucket = StreamTracker(suffixes), []

    def send(final):
        items = bucket
        if flat and bucket:
            buf, meta = flatten(bucket)
            items = [(RECV, encode_control({"meta": meta})), (FLAT, buf)]
        load_packed(model, items + [(CONTROL, tracker.control(final=final))])

    for name, t in stream:
        tracker.add(name)
        bucket.append((name, tracker.send_as(name, t)))
        if len(bucket) == per_bucket:
            send(False)
            bucket = []
    send(True)


def test_module_key_maps_hf_names_to_sglang_modules():
    assert module_key("model.layers.3.self_attn.v_proj.weight_scale_2") == (
        "model.layers.3.self_attn.qkv_proj")
    assert module_key("model.layers.0.mlp.experts.11.up_proj.weight_packed") == (
        "model.layers.0.mlp.experts")
    assert module_key("model.layers.0.mlp.gate_proj.weight") == "model.layers.0.mlp.gate_up_proj"
    assert module_key("model.layers.0.mlp.gate.weight") == "model.layers.0.mlp.gate"
    assert module_key("lm_head.weight") == "lm_head"


@pytest.mark.parametrize("per_bucket,flat", [(1, False), (3, False), (5, False), (1000, False),
                                             (3, True), (1000, True)])
def test_inplace_sync_keeps_storage_and_equals_a_fresh_load(per_bucket, flat):
    model = FakeModel()
    before = {k: (v.data_ptr(), v.stride()) for k, v in live_tensors(model).items()}
    sync(model, weights(1), per_bucket, flat=flat)
    want = FakeModel(seed=1)  # an engine started on B: the post-processed expected values
    got, exp = live_tensors(model), live_tensors(want)
    assert set(got) == set(before) == set(exp)
    for k, t in got.items():
        assert (t.data_ptr(), t.stride()) == before[k], f"{k} lost its storage"
        torch.testing.assert_close(t, exp[k], rtol=0, atol=0, msg=k)
    assert not model.model.layers[0].self_attn.qkv_proj.weight.is_contiguous()  # live layout
    assert not vars(model)["_qrl_inplace_pending"], "pending state left after the sync"


def test_inplace_sync_changes_values():
    model = FakeModel()
    old = model.model.layers[0].mlp.experts.w2_weight.clone()
    sync(model, weights(2), 4)
    assert not torch.equal(model.model.layers[0].mlp.experts.w2_weight, old)


def test_missing_tensor_names_the_module_and_parameter():
    stream = [(n, t) for n, t in weights(1) if n != "model.layers.0.self_attn.v_proj.weight_scale"]
    model = FakeModel()
    with pytest.raises(InplaceSyncError, match=r"self_attn\.qkv_proj: 'weight_scale' got 2 of 3"):
        sync(model, stream, 3)


def test_missing_expert_tensor_names_the_moe_module():
    stream = [(n, t) for n, t in weights(1) if n != "model.layers.0.mlp.experts.2.up_proj.weight"]
    with pytest.raises(InplaceSyncError, match=r"mlp\.experts: 'w13_weight' got 5 of 6"):
        sync(FakeModel(), stream, 7)


def test_stream_cut_before_final_names_the_half_loaded_module():
    model = FakeModel()
    tracker = StreamTracker(SUFFIXES)
    bucket = []
    for name, t in weights(1)[:3]:  # q weight+scale, k weight: qkv_proj half-loaded
        tracker.add(name)
        bucket.append((name, t))
    load_packed(model, bucket + [(CONTROL, tracker.control(final=False))])
    ctl = {"begin": False, "final": True, "done": {}, "suffixes": list(SUFFIXES)}
    from megatron_qrl.rollout_sglang.sync.protocol import encode_control

    with pytest.raises(InplaceSyncError, match=r"never completed.*qkv_proj"):
        load_packed(model, [(CONTROL, encode_control(ctl))])


def test_shape_mismatch_names_module_and_tensor():
    """A stream for another shape (o_proj in 6 instead of 4) cannot be copied into live."""
    stream = [(n, torch.randn(H, HEAD + 2) if n.endswith("o_proj.weight") else t)
              for n, t in weights(1)]
    model = FakeModel()
    # a loader that accepts any shape, so the mismatch reaches the copy into live tensors
    model.model.layers[0].self_attn.o_proj.weight_loader = (
        lambda p, x, s=None: setattr(p, "data", x.clone()))
    with pytest.raises(InplaceSyncError, match=r"o_proj\.weight: reloaded tensor is \(6, 8\)"):
        sync(model, stream, 1000)


def test_module_reappearing_in_the_stream_is_refused_by_the_sender():
    tracker = StreamTracker(SUFFIXES)
    tracker.add("model.layers.0.self_attn.q_proj.weight")
    tracker.add("model.layers.0.self_attn.o_proj.weight")
    with pytest.raises(InplaceSyncError, match="arrives after the stream moved on"):
        tracker.add("model.layers.0.self_attn.v_proj.weight")


def test_engine_defaults_to_inplace_for_weight_quantized_formats():
    from megatron_qrl.quant import get_spec
    from megatron_qrl.rollout_sglang.options import default_sync
    from megatron_qrl.rollout_sglang.sync.sender import packed_suffixes

    assert default_sync("bf16") == "tensor"
    assert {default_sync(f) for f in ("int8", "fp8", "fp8_block", "w4a16", "nvfp4")} == {
        "inplace"}
    assert packed_suffixes(get_spec("fp8_block")) == ("weight", "weight_scale_inv")
    assert packed_suffixes(get_spec("w4a16")) == ("weight_packed", "weight_scale", "weight_shape")


def test_auto_sync_is_resolved_in_one_place():
    from megatron_qrl.rollout_sglang.options import SGLangOptions

    auto = SGLangOptions()
    assert [auto.sync_for(f) for f in ("bf16", "int8")] == ["tensor", "inplace"]
    assert auto.sync_for("bf16", lora=True) == "inplace"  # LoRA wrappers: our loader only
    assert SGLangOptions(sync="disk").sync_for("bf16", lora=True) == "disk"
    assert auto.resolve("bf16").sync == "tensor" and auto.resolve("fp8").sync == "inplace"


def test_float8_tensors_travel_as_uint8_and_arrive_as_float8():
    seen = {}
    model = FakeModel()
    orig = model.load_weights
    model.load_weights = lambda ws: (seen.update({n: t.dtype for n, t in ws}), orig(ws))[1]
    stream = weights(1)
    name = "model.layers.0.input_layernorm.weight"
    stream = [(n, t.to(torch.float8_e4m3fn) if n == name else t) for n, t in stream]
    tracker = StreamTracker(SUFFIXES)
    for n, _ in stream:
        tracker.add(n)
    sent = tracker.send_as(name, dict(stream)[name])
    assert sent.dtype == torch.uint8
    sync(model, stream, 4)
    assert seen[name] == torch.float8_e4m3fn
    torch.testing.assert_close(model.model.layers[0].input_layernorm.weight,
                               dict(stream)[name].float())


def test_phase_log_records_each_bucket_and_sums_per_sync(tmp_path, monkeypatch):
    from megatron_qrl.rollout_sglang.sync.debug import PROFILE_ENV, summarize

    path = tmp_path / "phases.jsonl"
    model = FakeModel()
    sync(model, weights(1), 5)  # not profiled: writes nothing
    assert not path.exists()
    monkeypatch.setenv(PROFILE_ENV, str(path))
    n = len(list(weights(1)))
    sync(model, weights(1), 5)
    sync(model, weights(2), 1000)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(recs) == -(-n // 5) + 1 and recs[0]["begin"] and recs[-2]["final"]
    assert {"unpack_s", "enter_s", "load_weights_s", "leave_s", "process_s"} <= set(recs[0])
    rows = summarize(path)
    assert [(r["buckets"], r["tensors"]) for r in rows] == [(-(-n // 5), n), (1, n)]
    assert all(r["total_s"] > 0 and r["process_s"] > 0 for r in rows)


def test_state_digest_written_once_per_sync_and_tells_which_tensor_changed(tmp_path, monkeypatch):
    from megatron_qrl.rollout_sglang.sync.debug import DIGEST_ENV, digest_diff, read_digests

    path = tmp_path / "digest.jsonl"
    model = FakeModel()
    sync(model, weights(1), 5)  # unset: writes nothing
    assert not path.exists() and read_digests(path) == []
    monkeypatch.setenv(DIGEST_ENV, str(path))
    sync(model, weights(1), 5)  # one line per sync (after its final bucket), not per bucket
    sync(model, weights(1), 1000, flat=True)  # the same weights another way: the same bits
    changed = [(n, t.clone()) for n, t in weights(1)]
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    w = dict(changed)[name]
    w.view(-1)[7] = torch.nextafter(w.view(-1)[7], torch.tensor(1e9))  # one ulp, one element
    sync(model, changed, 5)
    a, b, c = read_digests(path)
    qm = {f"{k.rsplit('.quant_method.', 1)[0]}:quant_method.{k.rsplit('.', 1)[1]}"
          for k in live_tensors(model) if ".quant_method." in k}
    assert qm and set(a) == set(dict(model.named_parameters())) | qm
    assert a == b
    assert digest_diff(b, c) == ["model.layers.0.mlp.experts.w2_weight"]
    assert digest_diff(b, {**b, "extra": "x"}) == ["extra"]


@pytest.mark.parametrize("make", [lambda: torch.empty(64, 64), lambda: torch.empty_strided(
    (64, 64), (64, 1)), lambda: torch.empty_like(torch.ones(64, 64)),
    lambda: torch.ones(1).new_empty(64, 64)])
def test_creation_context_zero_fills_empty_allocations(make):
    """Re-created checkpoint params start at zeros, not at freed memory (here: a block
    of 7s just released, which the allocator hands back to the next same-size request)."""
    from megatron_qrl.rollout_sglang.sync.loader.module_state import creation_context

    dirty = []
    for _ in range(8):  # several sizes of freed blocks, so some reuse happens unpatched
        dirty.append(torch.full((64, 64), 7.0))
    del dirty
    with creation_context(torch.device("cpu"), torch.float32):
        t = make()
        plain = torch.full((3,), 5.0)  # non-empty factories keep their values
    assert torch.count_nonzero(t) == 0
    assert plain.tolist() == [5.0, 5.0, 5.0]
    assert torch.get_default_dtype() == torch.float32


class PlaceholderMoEMethod(FakeMoEMethod):
    """As ModelOpt NVFP4 on Hopper's Marlin path: ``create_weights`` also derives a tensor from
    an EMPTY scale (``w13_blockscale_swizzled``) that no load and no processing writes."""

    def create_weights(self, layer, *args, **extra):
        super().create_weights(layer, *args, **extra)
        layer.placeholder = nn.Parameter(torch.empty(E, 2 * FFN, 1) * 1, requires_grad=False)


def test_untouched_placeholder_is_the_same_after_every_sync():
    """Two syncs of the same weights leave equal engine bits, placeholder included (the H200
    nvfp4 digest of 2026-11-29 differed only in such placeholders)."""
    model = FakeModel()
    moe = model.model.layers[0].mlp.experts
    moe.quant_method = PlaceholderMoEMethod()
    moe.placeholder = nn.Parameter(torch.full((E, 2 * FFN, 1), 7.0), requires_grad=False)
    ptr = moe.placeholder.data_ptr()
    sync(model, weights(1), 4)
    assert moe.placeholder.data_ptr() == ptr, "the placeholder lost its storage"
    assert torch.count_nonzero(moe.placeholder) == 0
    first = {k: v.clone() for k, v in live_tensors(model).items()}
    junk = [torch.full((E, 2 * FFN, 1), 9.0) for _ in range(8)]  # dirty the allocator again
    del junk
    sync(model, weights(1), 3)
    for k, v in live_tensors(model).items():
        torch.testing.assert_close(v, first[k], rtol=0, atol=0, msg=k)
