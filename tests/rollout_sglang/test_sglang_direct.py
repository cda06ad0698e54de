"""CPU tests of the direct sync (``sync="direct"``): the engine's storage described in its own
layout (megatron_qrl.rollout_sglang.sync.loader.live_storage), the trainer's writer into it
(sync.writer), the read-back digest, re-taking moved storage, and the refusals.

SGLang cannot be imported here. The engine-like model follows SGLang 0.5.17 for the three
formats the writer serves: fused linears whose shard loader writes q/k/v (gate/up) rows and,
for block scales, block rows (``BlockQuantScaleParameter``), with ``W8A8Fp8LinearMethod`` /
``W8A8Int8LinearMethod`` (post-load: ``weight.t()``) and block ``Fp8LinearMethod``
(post-load: unchanged); the ``FusedMoE`` stand-in of sglang_fused_moe_fake.py with
``W8A8FP8MoEMethod`` / ``W8A8Int8MoEMethod`` / block ``Fp8MoEMethod``; a padded vocabulary;
norms and the router as plain parameters. The
reference is the in-place loader (``load_packed``) fed the same packed stream in buckets.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_qrl.quant import get_spec
from megatron_qrl.rollout_sglang.options import SGLangOptions
from megatron_qrl.rollout_sglang.sync.loader import load_packed
from megatron_qrl.rollout_sglang.sync.loader.live_storage import describe
from megatron_qrl.rollout_sglang.sync.loader.storage import handle
from megatron_qrl.rollout_sglang.sync.sender import StreamTracker, packed_suffixes
from megatron_qrl.rollout_sglang.sync.storage_client import EngineStorage
from megatron_qrl.rollout_sglang.sync.writer import check_digest, writer_for
from megatron_qrl.sync.protocol.checksums import Checksums, WeightSyncError
from megatron_qrl.sync.protocol.engine_layout import EngineLayoutError, HeldTensorError
from megatron_qrl.sync.protocol.inplace import CONTROL
from megatron_qrl.utils.hf_names import parse
from tests.rollout_sglang import sglang_fused_moe_fake as fake
from tests.rollout_sglang.test_sglang_engine_sync import fake_io_struct  # noqa: F401  (io_struct stub)

F8 = torch.float8_e4m3fn
H, Q, KV, FFN, E, V, LAYERS, BLOCK = 128, 256, 128, 128, 2, 60, 2, 128
SHARD = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": 0, "up_proj": 1}
MOE = {"gate_proj": ("w13_", "w1"), "up_proj": ("w13_", "w3"), "down_proj": ("w2_", "w2")}


def _param(t, loader, **attrs):
    p = nn.Parameter(t, requires_grad=False)
    p.weight_loader = loader
    vars(p).update(attrs)
    return p


class W8A8Fp8LinearMethod:
    """w8a8_fp8.py: checkpoint fp8 weight [out, in] + fp32 scale [out, 1]; live weight.t()."""

    codes = F8

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype, weight_loader, **_):
        out = sum(output_partition_sizes)
        layer.register_parameter("weight", _param(
            torch.empty(out, input_size_per_partition, dtype=self.codes), weight_loader))
        layer.register_parameter("weight_scale", _param(torch.empty(out, 1, dtype=torch.float32), weight_loader))

    def process_weights_after_loading(self, layer):
        layer.weight = nn.Parameter(layer.weight.t(), requires_grad=False)
        layer.weight_scale = nn.Parameter(layer.weight_scale.detach(), requires_grad=False)


class W8A8Int8LinearMethod(W8A8Fp8LinearMethod):
    """w8a8_int8.py on CUDA: int8 weight [out, in] + fp32 scale [out, 1]; live weight.t()."""

    codes = torch.int8


class Fp8LinearMethod:
    """fp8.py with weight_block_size: fp8 weight + fp32 weight_scale_inv per 128x128 block."""

    block_quant = True

    def __init__(self):
        self.quant_config = type("Cfg", (), {"weight_block_size": [BLOCK, BLOCK]})()

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype, weight_loader, **_):
        out, k = sum(output_partition_sizes), input_size_per_partition
        layer.register_parameter("weight", _param(torch.empty(out, k, dtype=F8), weight_loader))
        layer.register_parameter("weight_scale_inv", _param(
            torch.empty(-(-out // BLOCK), -(-k // BLOCK), dtype=torch.float32), weight_loader, block=BLOCK))

    def process_weights_after_loading(self, layer):
        layer.weight.data = layer.weight.data  # Hopper, Triton path: kept as loaded


class W8A8FP8MoEMethod(fake._Method):
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra):
        i, e = intermediate_size_per_partition, num_experts
        fake._reg(layer, "w13_weight", torch.empty(e, 2 * i, hidden_size, dtype=F8), extra)
        fake._reg(layer, "w2_weight", torch.empty(e, hidden_size, i, dtype=F8), extra)
        extra = {**extra, "quant_method": "channel"}
        fake._reg(layer, "w13_weight_scale", torch.ones(e, 2 * i, 1, dtype=torch.float32), extra)
        fake._reg(layer, "w2_weight_scale", torch.ones(e, hidden_size, 1, dtype=torch.float32), extra)


class Fp8MoEMethod(fake.Fp8MoEMethod):
    block_quant = True


class Fp8KVCacheMethod:
    """fp8.py's KV-cache method (``BaseKVCacheMethod``): k/v scales on the attention module,
    from the checkpoint's KV scales (none here: -1, then 1.0), never in a weight sync."""

    def create_weights(self, layer):
        layer.k_scale = nn.Parameter(torch.tensor(-1.0), requires_grad=False)
        layer.v_scale = nn.Parameter(torch.tensor(-1.0), requires_grad=False)

    def process_weights_after_loading(self, layer):
        layer.k_scale.data.fill_(1.0)
        layer.v_scale.data.fill_(1.0)


class Linear(nn.Module):
    """``MergedColumnParallelLinear`` / ``QKVParallelLinear`` / ``RowParallelLinear`` at TP 1."""

    def __init__(self, in_size, out_sizes, method, shards=None):
        super().__init__()
        self.input_size = self.input_size_per_partition = in_size
        self.output_partition_sizes, self.output_size = list(out_sizes), sum(out_sizes)
        self.shards, self.params_dtype, self.quant_method = shards, torch.bfloat16, method
        method.create_weights(self, in_size, out_sizes, in_size, sum(out_sizes), torch.bfloat16,
                              weight_loader=self.weight_loader)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:
            param.data.copy_(loaded)
            return
        i = self.shards.index(shard_id)
        start, size = sum(self.output_partition_sizes[:i]), self.output_partition_sizes[i]
        block = getattr(param, "block", None)
        if block:  # BlockQuantScaleParameter: shard offsets and sizes in blocks
            start, size = start // block, -(-size // block)
        param.data.narrow(0, start, size).copy_(loaded)


def _plain(shape, pad_rows=0):
    def load(p, x):  # VocabParallelEmbedding.weight_loader: the padding is zeroed
        p.data[: x.shape[0]].copy_(x)
        p.data[x.shape[0]:].fill_(0)
    return _param(torch.zeros(shape[0] + pad_rows, *shape[1:], dtype=torch.bfloat16), load)


def engine_skeleton(model):
    """``model.model`` with the padded embedding and an empty layer list (the engine-like
    models' common frame)."""
    model.model = nn.Module()
    model.model.embed_tokens = nn.Module()
    model.model.embed_tokens.weight = _plain((V, H), pad_rows=4)
    model.model.layers = nn.ModuleList()


def add_layer(model, layer, experts):
    """Give ``layer`` its MoE block (router gate + ``experts``) and input norm and append it to
    ``model.model.layers``."""
    layer.mlp = nn.Module()
    layer.mlp.gate = nn.Module()
    layer.mlp.gate.weight = _plain((E, H))
    layer.mlp.experts = experts
    layer.input_layernorm = nn.Module()
    layer.input_layernorm.weight = _plain((H,))
    model.model.layers.append(layer)


class EngineModel(nn.Module):
    """Qwen3-MoE-shaped layers as SGLang builds them for ``fmt``."""

    def __init__(self, fmt):
        super().__init__()
        lin = {"fp8": W8A8Fp8LinearMethod, "int8": W8A8Int8LinearMethod}.get(fmt, Fp8LinearMethod)
        moe = {"fp8": W8A8FP8MoEMethod, "int8": fake.W8A8Int8MoEMethod}.get(
            fmt, lambda: Fp8MoEMethod((BLOCK, BLOCK)))
        engine_skeleton(self)
        for _ in range(LAYERS):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.qkv_proj = Linear(H, [Q, KV, KV], lin(), ["q", "k", "v"])
            layer.self_attn.o_proj = Linear(Q, [H], lin())
            if fmt == "fp8_block":  # Fp8Config gives the attention a KV-cache method
                layer.self_attn.attn = nn.Module()
                layer.self_attn.attn.quant_method = Fp8KVCacheMethod()
                layer.self_attn.attn.quant_method.create_weights(layer.self_attn.attn)
            old = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                experts = fake.FusedMoE(moe(), E, H, FFN)
            finally:
                torch.set_default_dtype(old)
            add_layer(self, layer, experts)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            p = parse(name)
            if p is not None and p.expert is not None:
                prefix, shard = MOE[p.proj]
                pname = f"{p.experts_module}.{prefix}{p.leaf}"
                params[pname].weight_loader(params[pname], w, pname, shard, p.expert)
            elif p is not None:
                pname = f"{p.engine_module}.{p.leaf}"
                params[pname].weight_loader(params[pname], w, SHARD.get(p.proj))
            else:
                params[name].weight_loader(params[name], w)

    def initial_load(self, weights):
        self.load_weights(weights)
        for m in self.modules():
            if hasattr(m, "quant_method") and not isinstance(m, nn.ModuleList):
                m.quant_method.process_weights_after_loading(m)


def hf_weights(seed):
    """A bf16 HF checkpoint of the model (each module's tensors together)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (0.05 * torch.randn(*shape, generator=g)).to(torch.bfloat16)

    out = [("model.embed_tokens.weight", r(V, H))]
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        out += [(f"{pre}self_attn.q_proj.weight", r(Q, H)), (f"{pre}self_attn.k_proj.weight", r(KV, H)),
                (f"{pre}self_attn.v_proj.weight", r(KV, H)), (f"{pre}self_attn.o_proj.weight", r(H, Q)),
                (f"{pre}mlp.gate.weight", r(E, H))]
        for e in range(E):
            out += [(f"{pre}mlp.experts.{e}.gate_proj.weight", r(FFN, H)),
                    (f"{pre}mlp.experts.{e}.up_proj.weight", r(FFN, H)),
                    (f"{pre}mlp.experts.{e}.down_proj.weight", r(H, FFN))]
        out.append((f"{pre}input_layernorm.weight", 1 + r(H)))
    return out


def packed(fmt, seed, stack=False):
    return list(get_spec(fmt).pack_state_dict(hf_weights(seed), stack_experts=stack))


def engine(fmt, seed=0):
    m = EngineModel(fmt)
    m.initial_load(packed(fmt, seed))
    return m


def inplace_sync(model, fmt, stream, per_bucket=5):
    tracker, bucket = StreamTracker(packed_suffixes(get_spec(fmt))), []
    for i, (name, t) in enumerate(stream):
        tracker.add(name)
        bucket.append((name, tracker.send_as(name, t)))
        last = i == len(stream) - 1
        if len(bucket) == per_bucket or last:
            load_packed(model, bucket + [(CONTROL, tracker.control(final=last))])
            bucket = []


def state(model):
    return {n: p.detach().reshape(-1).contiguous().view(torch.uint8).clone()
            for n, p in model.named_parameters()}


def direct_sync(model, fmt, stream):
    layout, tensors = describe(model)
    writer = writer_for(get_spec(fmt), layout, tensors)
    writer.write_all(stream)
    sent = writer.sent.result()
    held = handle(model, {"what": "digest", "names": writer.shapes})["digest"]
    check_digest(sent, held)
    return sent


# ---- the writer against the in-place loader -------------------------------------------
@pytest.mark.parametrize("fmt", ["fp8", "fp8_block", "int8"])
@pytest.mark.parametrize("stack", [False, True], ids=["per_expert", "stacked"])
def test_direct_writes_the_bits_the_inplace_loader_leaves(fmt, stack):
    """Catches: a wrong fused-member row offset (q/k/v, gate/up, block rows), a transpose
    missed for w8a8_fp8's / w8a8_int8's ``weight.t()`` (int8: ``W8A8Int8LinearMethod``
    missing from ``LINEAR_T``), an expert written to the wrong index, the padded vocabulary
    overwritten."""
    ref, got = engine(fmt, seed=0), engine(fmt, seed=0)
    inplace_sync(ref, fmt, packed(fmt, 1, stack=False))
    direct_sync(got, fmt, packed(fmt, 1, stack=stack))
    a, b = state(ref), state(got)
    assert a.keys() == b.keys()
    changed = [n for n in a if not torch.equal(a[n], state(engine(fmt, 0))[n])]
    assert len(changed) > len(a) // 2  # the sync changed the engine (seed 1 != seed 0)
    for n in a:
        assert torch.equal(a[n], b[n]), n


def test_live_storage_is_written_in_place():
    """Catches: a writer that rebinds parameters (CUDA graphs would keep reading the old)."""
    m = engine("fp8")
    ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
    direct_sync(m, "fp8", packed("fp8", 3))
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == ptrs


def test_layout_of_fused_and_stacked_parameters():
    layout, tensors = describe(engine("fp8_block"))
    qkv = layout.params["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
    assert qkv.shards == {"q_proj": (0, 2), "k_proj": (2, 3), "v_proj": (3, 4)}
    w13 = layout.params["model.layers.1.mlp.experts.w13_weight"]
    assert w13.experts and w13.shards == {"gate_proj": (0, FFN), "up_proj": (FFN, 2 * FFN)}
    for fmt in ("fp8", "int8"):
        t = describe(engine(fmt))[0].params["model.layers.0.self_attn.qkv_proj.weight"]
        assert t.transposed and t.shape == (Q + 2 * KV, H), fmt
    int8 = describe(engine("int8"))[0].params
    assert int8["model.layers.0.self_attn.qkv_proj.weight_scale"].shape == (Q + 2 * KV, 1)
    assert int8["model.layers.0.self_attn.qkv_proj.weight_scale"].dtype == "float32"
    w13 = int8["model.layers.1.mlp.experts.w13_weight_scale"]
    assert w13.experts and w13.shape == (E, 2 * FFN, 1) and not w13.transposed


# ---- the digest -----------------------------------------------------------------------
def test_digest_catches_a_flipped_byte_and_names_the_layer():
    """Catches: a read-back that re-reads the trainer's copy (or nothing) instead of the
    engine's tensors; a digest without the layer in its message."""
    m = engine("fp8_block")
    layout, tensors = describe(m)
    writer = writer_for(get_spec("fp8_block"), layout, tensors)
    writer.write_all(packed("fp8_block", 2, stack=True))
    sent = writer.sent.result()
    w13 = m.model.layers[1].mlp.experts.w13_weight
    w13.data.view(torch.uint8)[1, FFN + 5, 7] ^= 1  # expert 1's up_proj, layer 1
    held = handle(m, {"what": "digest", "names": writer.shapes})["digest"]
    with pytest.raises(WeightSyncError, match=r"experts\.1\.up_proj\.weight.*\(layer 1\)"):
        check_digest(sent, held)


@pytest.mark.parametrize("where", ["dense", "expert_scale"])
def test_int8_digest_catches_a_flipped_byte_in_the_live_tensors(where):
    """int8 (w8a8_int8): one bit flipped in the engine's live storage after the write — in the
    transposed ``qkv_proj.weight`` the GEMM reads (``[in, out]``: column ``Q + 3`` is k_proj's
    row 3), or in an expert's per-channel ``w2_weight_scale`` — fails the check naming the
    tensor and layer. Catches: a read-back of the checkpoint view's copy instead of the live
    storage, a digest that skips scales, a member's rows mapped to the wrong fused member."""
    m = engine("int8")
    layout, tensors = describe(m)
    writer = writer_for(get_spec("int8"), layout, tensors)
    writer.write_all(packed("int8", 2, stack=True))
    sent = writer.sent.result()
    held = handle(m, {"what": "digest", "names": writer.shapes})["digest"]
    check_digest(sent, held)
    if where == "dense":
        live = m.model.layers[0].self_attn.qkv_proj.weight  # weight.t(): [in, out]
        assert live.shape == (H, Q + 2 * KV)
        live.data.view(torch.uint8)[5, Q + 3] ^= 4
        match = r"layers\.0\.self_attn\.k_proj\.weight' \(layer 0\)"
    else:
        m.model.layers[1].mlp.experts.w2_weight_scale.data.view(torch.uint8)[1, 9, 2] ^= 1  # [E, H, 1] fp32 -> [E, H, 4] bytes
        match = r"layers\.1\.mlp\.experts\.1\.down_proj\.weight_scale' \(layer 1\)"
    held = handle(m, {"what": "digest", "names": writer.shapes})["digest"]
    with pytest.raises(WeightSyncError, match=match):
        check_digest(sent, held)


def test_missing_tensor_is_refused_naming_the_parameter():
    """Catches: a sync that leaves half a fused parameter stale without a word."""
    m = engine("fp8")
    layout, tensors = describe(m)
    stream = [(n, t) for n, t in packed("fp8", 2) if n != "model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(WeightSyncError, match=r"layers\.1\.self_attn\.qkv_proj\.weight got"):
        writer_for(get_spec("fp8"), layout, tensors).write_all(stream)


# ---- moved storage --------------------------------------------------------------------
def test_moved_storage_is_taken_again():
    """Catches: handles kept after SGLang re-created a parameter (writes would land in freed
    memory and the engine would keep its old weights)."""
    m = engine("fp8")
    calls = []

    def call(msg):
        calls.append(msg["what"])
        return handle(m, msg)

    store = EngineStorage(call)
    layout, tensors = store.current()
    assert store.current()[0] is layout and store.taken == 1
    o = m.model.layers[0].self_attn.o_proj  # re-created, as a re-processed module would be
    o.weight_scale = nn.Parameter(o.weight_scale.detach().clone(), requires_grad=False)
    layout2, tensors2 = store.current()
    assert store.taken == 2 and layout2.fingerprint != layout.fingerprint
    assert calls == ["export", "fingerprint", "fingerprint", "export"]
    writer = writer_for(get_spec("fp8"), layout2, tensors2)
    writer.write_all(packed("fp8", 4))
    assert torch.equal(o.weight_scale, dict(packed("fp8", 4))[
        "model.layers.0.self_attn.o_proj.weight_scale"])


# ---- refusals -------------------------------------------------------------------------
def test_formats_the_writer_does_not_serve_are_refused_naming_the_flag():
    layout, tensors = describe(engine("fp8"))
    with pytest.raises(ValueError, match=r"--qrl-rollout-sglang-sync direct: format 'nvfp4'"
                       r".*serve \['fp8', 'fp8_block', 'int8', 'w4a16'\]"):
        writer_for(get_spec("nvfp4"), layout, tensors)
    with pytest.raises(ValueError, match=r"sync direct .*'nvfp4'.*sync inplace"):
        SGLangOptions(sync="direct").resolve("nvfp4")
    assert SGLangOptions(sync="direct", release_memory=False).resolve("fp8_block").sync == "direct"


def test_engine_methods_that_rewrite_weights_are_refused():
    m = engine("fp8_block")
    m.model.layers[0].self_attn.o_proj.quant_method.use_marlin = True
    with pytest.raises(EngineLayoutError, match=r"o_proj runs Fp8LinearMethod .*use_marlin"):
        describe(m)
    m = engine("fp8_block")
    m.model.layers[1].mlp.experts.quant_method.block_quant = False  # per-tensor fp8 experts
    with pytest.raises(EngineLayoutError, match=r"layers\.1\.mlp\.experts runs Fp8MoEMethod "
                       r"\(flags \['per-tensor scales"):
        describe(m)


def test_a_tensor_of_another_model_is_refused():
    layout, tensors = describe(engine("fp8"))
    w = writer_for(get_spec("fp8"), layout, tensors, Checksums())
    with pytest.raises(EngineLayoutError, match=r"model\.layers\.7\.self_attn.*no engine parameter"):
        w.write("model.layers.7.self_attn.q_proj.weight", torch.zeros(Q, H, dtype=F8))
    with pytest.raises(EngineLayoutError, match=r"is \(256, 128\) in the engine, the trainer sends"):
        w.write("model.layers.0.self_attn.q_proj.weight", torch.zeros(Q + 1, H, dtype=F8))


# ---- the engine's direct sync end to end (the storage service in process) --------------
def _direct_engine(model, fmt="fp8", release_memory=False, bucket_bytes=1 << 20):
    """SGLangEngine without sglang.Engine: its storage requests (and the tensors of a
    ``write``) answered in this process (what the scheduler's ``serve`` computes, without the
    answer file and the IPC hop); ``requests``: each request's ``what``, ``writes``: each
    write's ``(first, last, tensors)``."""
    from megatron_qrl.rollout_sglang import SGLangEngine

    eng = object.__new__(SGLangEngine)
    eng.options = SGLangOptions(sync="direct", release_memory=release_memory).resolve(fmt)
    eng.spec, eng.trainer_device = get_spec(fmt), torch.device("cpu")
    eng.bucket_bytes, eng.processes, eng.model_path = bucket_bytes, 1, None
    version = [None]
    eng.engine = SimpleNamespace(get_server_info=lambda: {"weight_version": version[0]})
    eng.requests, eng.writes = [], []

    def call(msg, tensors=()):
        msg = dict(msg)
        v = msg.pop("version", None)
        eng.requests.append(msg["what"])
        if msg["what"] == "write":
            eng.writes.append((msg["first"], msg["last"], len(tensors)))
        try:
            out = handle(model, msg, list(tensors))
        finally:  # SGLang applies a request's version whatever the loader answered
            if v is not None:
                version[0] = str(v)
        return out

    eng._storage_call = call
    eng._reset_sync_state()
    return eng


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_engine_direct_sync_end_to_end(fmt):
    """Catches: the engine not verifying the read-back digest, the version not set by the
    digest request, handles taken again on every sync, a stream not expert-stacked; int8:
    the options refusing it (``EngineFacts.direct_write`` unset)."""
    ref, m = engine(fmt), engine(fmt)
    eng = _direct_engine(m, fmt)
    assert eng.stacked_experts
    for v in (1, 2):
        stream = get_spec(fmt).pack_state_dict(hf_weights(v), stack_experts=eng.stacked_experts)
        eng.update_weights(stream, version=v)
    inplace_sync(ref, fmt, packed(fmt, 2))
    assert eng.weight_version() == 2 and eng.last_sync["verified"] == "digest"
    assert eng.last_sync["handles_taken"] == 1
    assert eng.requests == ["export", "digest", "fingerprint", "digest"]
    assert eng.held_checksums() == eng.sent_checksums()
    assert "model.layers.1.mlp.experts.1.down_proj.weight" in eng.sent_checksums()
    a, b = state(ref), state(m)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_direct_sync_times_the_wait_on_its_stream(monkeypatch):
    """``last_sync["stream_s"]``: the part of ``write_s`` spent producing the incoming stream
    (the trainer's weights, expert stacks), on a clock that only the stream advances. Catches:
    the wait not recorded, or the writer's own time counted as the stream's."""
    from megatron_qrl.rollout_sglang.sync import prefetch

    now = [0.0]
    monkeypatch.setattr(prefetch, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    eng = _direct_engine(engine("fp8"), "fp8")
    stream = list(get_spec("fp8").pack_state_dict(hf_weights(3), stack_experts=True))

    def slow():
        for item in stream:
            now[0] += 10.0
            yield item

    eng.update_weights(slow(), version=1)
    assert eng.last_sync["stream_s"] == 10.0 * len(stream)


def test_engine_direct_sync_fails_when_the_engine_holds_other_bytes():
    """Catches: an engine-side write that is lost (e.g. a stale handle) passing as synced."""
    m = engine("fp8_block")
    eng = _direct_engine(m, "fp8_block")
    call = eng._storage_call

    def corrupting(msg):
        if msg["what"] == "digest":
            m.model.layers[0].self_attn.qkv_proj.weight_scale_inv.data[3, 0] += 1
        return call(msg)

    eng._storage_call = corrupting
    with pytest.raises(WeightSyncError, match=r"v_proj\.weight_scale_inv.*\(layer 0\)"):
        eng.update_weights(get_spec("fp8_block").pack_state_dict(hf_weights(5)), version=1)


def test_direct_sync_is_refused_off_the_gpu_and_over_tensor_parallel_ranks():
    from megatron_qrl.rollout_sglang.sync.transports.direct import check_placement

    with pytest.raises(ValueError, match=r"--qrl-rollout-sglang-sync direct writes .*cpu"):
        check_placement(torch.device("cpu"), {"tp_size": 1})
    with pytest.raises(ValueError, match=r"has tp_size=2, ep_size=2; use --qrl-rollout-sglang"):
        check_placement(torch.device("cuda:0"), {"tp_size": 2, "ep_size": 2})
    with pytest.raises(ValueError, match=r"starts on cuda:3 \(--qrl-rollout-sglang-base-gpu\)"):
        check_placement(torch.device("cuda:0"), {"tp_size": 1, "base_gpu_id": 3})
    check_placement(torch.device("cuda:3"), {"tp_size": 1, "base_gpu_id": 3})


def test_storage_answers_travel_through_the_answer_file(tmp_path):
    """The scheduler side (``serve``: control tensor in, answer file out) and the trainer
    side (``storage_request``) of the fingerprint and digest requests. Catches: an answer
    file left from an earlier request read as this one's."""
    from megatron_qrl.rollout_sglang.sync.loader.storage import serve
    from megatron_qrl.rollout_sglang.sync.storage_client import storage_request

    m = engine("fp8")
    sent = []

    def request(method, req, first):
        assert method == "update_weights_from_tensor" and req.load_format.endswith(".serve")
        sent.append((req.flush_cache, req.weight_version))
        serve(m, req.serialized_named_tensors)
        return True, "ok"

    out = str(tmp_path / "storage")
    (tmp_path / "storage.999").write_text('{"fingerprint": "stale"}')  # an earlier answer
    fp = storage_request(request, list, torch.device("cpu"), out, {"what": "fingerprint"})
    assert fp["fingerprint"] == describe(m)[0].fingerprint
    names = {"model.layers.0.self_attn.q_proj.weight": [Q, H]}
    got = storage_request(request, list, torch.device("cpu"), out,
                          {"what": "digest", "names": names}, version=7)
    assert list(got["digest"]) == list(names) and sent == [(False, None), (True, "7")]


def test_storage_failures_are_answered_not_raised_in_the_engine(tmp_path, monkeypatch):
    """A request that fails inside the scheduler (an export the memory saver's memory cannot
    be shared for, a digest of a tensor the engine has no place for) comes back through the
    answer file and is raised in the trainer with the engine's message; ``serve`` itself
    returns (raising would end SGLang's scheduler). Catches: ``serve`` raising, the client
    reading the error answer as a result, an engine-side failure losing its message."""
    from megatron_qrl.rollout_sglang.sync.loader.storage import serve
    from megatron_qrl.rollout_sglang.sync.storage_client import storage_request

    m = engine("fp8")

    def request(method, req, first):
        try:
            serve(m, req.serialized_named_tensors)
        except Exception as exc:  # noqa: BLE001  (what SGLang's scheduler does with it)
            raise AssertionError(f"the engine's scheduler would die of: {exc}") from exc
        return True, "ok"

    def unshareable(obj):
        raise RuntimeError("CUDA error: invalid argument")  # cudaIpcGetMemHandle on VMM memory

    utils = types.ModuleType("sglang.srt.utils")  # SGLang's serializer, as on a saver's memory
    utils.MultiprocessingSerializer = SimpleNamespace(serialize=unshareable)
    monkeypatch.setitem(sys.modules, "sglang.srt.utils", utils)
    out = str(tmp_path / "storage")
    with pytest.raises(EngineLayoutError, match=r"cannot be shared by CUDA IPC \(CUDA error: "
                       r"invalid argument\).*--no-qrl-rollout-sglang-release-memory"):
        storage_request(request, list, torch.device("cpu"), out, {"what": "export"})
    names = {"model.layers.7.self_attn.q_proj.weight": [Q, H]}
    with pytest.raises(EngineLayoutError, match=r"model\.layers\.7\.self_attn.*no engine param"):
        storage_request(request, list, torch.device("cpu"), out, {"what": "digest", "names": names})
    with pytest.raises(WeightSyncError, match=r"failed 'bogus' \(ValueError: engine storage "
                       r"request 'bogus'"):
        storage_request(request, list, torch.device("cpu"), out, {"what": "bogus"})
    held = {"what": "write", "format": "fp8", "first": True, "last": True,
            "refs": [[0, "model.norm.weight"]], "ref_sums": {}}  # a tensor it does not hold
    with pytest.raises(HeldTensorError, match=r"holds no tensor for model\.norm\.weight"):
        storage_request(request, list, torch.device("cpu"), out, held)
    assert not list(tmp_path.iterdir())  # every answer read and removed
    fp = storage_request(request, list, torch.device("cpu"), out, {"what": "fingerprint"})
    assert fp["fingerprint"] == describe(m)[0].fingerprint  # the service still answers


def test_cached_codes_reach_the_engine_as_they_are():
    """Quantize once per step: the aligned forward's Q(W) codes (``pack_state_dict``'s
    ``quantized``, rl.qcache_sync) are what the engine ends up holding, not a second
    quantization of the weights. The cache here holds another weight's codes for one
    projection, so only a copy of the cache gives them. Catches: a direct path that
    quantizes the HF weights itself."""
    spec = get_spec("fp8_block")
    other = dict(hf_weights(9))["model.layers.1.self_attn.v_proj.weight"]
    cached = spec.quantize_weight(other)
    m = engine("fp8_block")
    eng = _direct_engine(m, "fp8_block")
    stream = spec.pack_state_dict(hf_weights(4), stack_experts=eng.stacked_experts,
                                  quantized=lambda n: cached if n.endswith("1.self_attn.v_proj.weight")
                                  else None)
    eng.update_weights(stream, version=1)
    qkv = m.model.layers[1].self_attn.qkv_proj
    assert torch.equal(qkv.weight[Q + KV:].view(torch.uint8), cached.codes.view(torch.uint8))
    assert torch.equal(qkv.weight_scale_inv[3:], cached.scale)


def test_regions_are_looked_up_once_per_opened_storage(monkeypatch):
    """The writer's regions (``writer.Places``) are kept across syncs while the engine's
    handles hold and dropped with them. Catches: every name located again on every sync;
    the regions of the old storage written after SGLang re-created a parameter (the engine
    would keep its old weights: the digest fails)."""
    from megatron_qrl.quant.pack_stream import writer_stream
    from megatron_qrl.rollout_sglang.sync import writer as writer_module

    spec, m = get_spec("fp8"), engine("fp8")
    eng = _direct_engine(m, "fp8")
    located = []
    real = writer_module.locate
    monkeypatch.setattr(writer_module, "locate", lambda lay, n: located.append(n) or real(lay, n))
    counts = []
    for v in (1, 2, 3):
        if v == 3:  # re-created, as a re-processed module would be
            o = m.model.layers[0].self_attn.o_proj
            o.weight_scale = nn.Parameter(o.weight_scale.detach().clone(), requires_grad=False)
        located.clear()
        eng.update_weights(writer_stream(spec, hf_weights(v), stack_experts=True), version=v)
        counts.append(len(located))
    assert counts[0] > 0 and counts[1] == 0 and counts[2] == counts[0], counts
    assert eng.last_sync["handles_taken"] == 2 and eng.held_checksums() == eng.sent_checksums()
    want = dict(packed("fp8", 3))["model.layers.0.self_attn.o_proj.weight_scale"]
    assert torch.equal(m.model.layers[0].self_attn.o_proj.weight_scale, want)
