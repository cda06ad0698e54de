"""CPU tests of the direct sync for ``w4a16``: the writer quantizes (or copies the packed
stream / the Q(W) cache's codes) into an engine-like model whose live tensors are in SGLang
0.5.17's Marlin layout (``CompressedTensorsWNA16`` / ``CompressedTensorsWNA16MoE`` after
``process_weights_after_loading``: codes repacked, scales transposed and permuted, shapes /
g_idx kept by the engine). The stand-in post-load uses megatron_qrl.sync.protocol.marlin (its
equality with SGLang's kernels is tests/gpu/test_marlin_layout.py's; the real engine's is
tests/gpu/test_sglang_direct.py's). The reference is a fresh engine loaded from the packed
checkpoint of the same weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.pack_stream import writer_stream
from megatron_qrl.rl.sync import sync_weights
from megatron_qrl.rollout_sglang.options import SGLangOptions
from megatron_qrl.rollout_sglang.sync.loader.live_storage import describe
from megatron_qrl.rollout_sglang.sync.loader.storage import handle
from megatron_qrl.rollout_sglang.sync.writer import _direct_formats, check_digest, writer_for
from megatron_qrl.sync.protocol.checksums import WeightSyncError
from megatron_qrl.sync.protocol.engine_layout import (
    EngineLayoutError,
    ParamLayout,
    Target,
    view,
)
from megatron_qrl.sync.protocol.marlin import marlin_repack, marlin_scales
from megatron_qrl.utils.hf_names import parse
from tests.rollout_sglang.test_sglang_direct import (
    FFN,
    KV,
    LAYERS,
    MOE,
    SHARD,
    E,
    H,
    Q,
    _direct_engine,
    add_layer,
    engine_skeleton,
    hf_weights,
    packed,
    state,
)

FMT, GROUP = "w4a16", 128
SPEC = get_spec(FMT)


def _p(t):
    return nn.Parameter(t, requires_grad=False)


class CompressedTensorsWNA16:
    """compressed_tensors_wNa16.py (CUDA, Marlin): checkpoint words [N, K/8], bf16 scales
    [N, K/128], int64 shape [2]; post-load repacks codes, permutes scales, empties g_idx."""

    def __init__(self, group=GROUP, act_order=False):
        self.pack_factor, self.symmetric, self.group_size = 8, True, group
        self.has_g_idx = act_order

    def create_weights(self, layer, out_sizes, k):
        n = sum(out_sizes)
        layer.weight_packed = _p(torch.zeros(n, k // 8, dtype=torch.int32))
        layer.weight_scale = _p(torch.zeros(n, k // self.group_size, dtype=torch.bfloat16))
        layer.weight_shape = _p(torch.zeros(2, dtype=torch.int64))

    def process_weights_after_loading(self, layer):
        self.workspace = torch.zeros(1)
        k = layer.weight_packed.shape[1] * 8
        layer.weight_packed = _p(marlin_repack(layer.weight_packed.data))
        layer.weight_scale = _p(marlin_scales(layer.weight_scale.data, self.group_size < k))
        layer.weight_g_idx = _p(torch.empty(0, dtype=torch.int32))
        layer.weight_zero_point = _p(torch.empty(0, dtype=torch.int32))


class CompressedTensorsLinearMethod:
    def __init__(self, scheme):
        self.scheme = scheme

    def process_weights_after_loading(self, layer):
        layer.scheme.process_weights_after_loading(layer)


class Linear(nn.Module):
    """Fused / plain linear at TP 1 with a WNA16 scheme: members' rows by the shard loader."""

    def __init__(self, k, out_sizes, shards=None, **scheme):
        super().__init__()
        self.output_partition_sizes, self.shards = list(out_sizes), shards
        self.scheme = CompressedTensorsWNA16(**scheme)
        self.quant_method = CompressedTensorsLinearMethod(self.scheme)
        self.scheme.create_weights(self, out_sizes, k)

    def load(self, leaf, x, shard):
        param = getattr(self, leaf)
        if leaf == "weight_shape" or shard is None:  # (the shape: the last member's)
            param.data.copy_(x)
            return
        i = self.shards.index(shard)
        start = sum(self.output_partition_sizes[:i])
        param.data.narrow(0, start, x.shape[0]).copy_(x)


class CompressedTensorsWNA16MoE:
    """compressed_tensors_wNa16_moe.py: transposed checkpoint tensors per expert
    (``w13_weight_packed [E, H/8, 2I]``), repacked in their own storage (``resize_``);
    ``w13`` scales permuted with ``size_k`` = the repacked width, as SGLang passes it."""

    def __init__(self, group=GROUP):
        self.num_bits, self.group_size, self.actorder = 4, group, None

    def process_weights_after_loading(self, layer):
        if getattr(layer, "is_marlin_converted", False):
            return
        for w in ("w13_", "w2_"):
            packed_ = getattr(layer, f"{w}weight_packed")
            new = marlin_repack(packed_.data.transpose(1, 2))
            with torch.no_grad():  # replace_tensor: the same storage, resized
                packed_.resize_(new.shape).copy_(new)
        for w in ("w13_", "w2_"):
            s = getattr(layer, f"{w}weight_scale")
            size_k = (layer.w13_weight_packed.shape[2] if w == "w13_"
                      else s.shape[1] * self.group_size)
            new = marlin_scales(s.data.transpose(1, 2), self.group_size < size_k)
            with torch.no_grad():
                s.resize_(new.shape).copy_(new)
        layer.is_marlin_converted = True


class FusedMoE(nn.Module):
    def __init__(self, **scheme):
        super().__init__()
        self.quant_method = self.scheme = CompressedTensorsWNA16MoE(**scheme)
        g = self.scheme.group_size
        for w, n, k in (("w13_", 2 * FFN, H), ("w2_", H, FFN)):
            setattr(self, f"{w}weight_packed", _p(torch.zeros(E, k // 8, n, dtype=torch.int32)))
            setattr(self, f"{w}weight_scale", _p(torch.ones(E, k // g, n, dtype=torch.bfloat16)))
            setattr(self, f"{w}weight_shape", _p(torch.zeros(E, 2)))
            setattr(self, f"{w}weight_g_idx", _p(torch.zeros(E, 0, dtype=torch.int32)))
            setattr(self, f"{w}g_idx_sort_indices", _p(torch.zeros(E, 0, dtype=torch.int32)))

    def load(self, leaf, x, shard, e):
        prefix, which = MOE[shard]
        param = getattr(self, f"{prefix}{leaf}")
        if leaf == "weight_shape":
            return param.data[e].copy_(x)
        rows = x.shape[0]
        start = rows if which == "w3" else 0
        param.data[e].narrow(1, start, rows).copy_(x.t())


class W4EngineModel(nn.Module):
    """Qwen3-MoE-shaped layers as SGLang builds them for compressed-tensors WNA16."""

    def __init__(self, **scheme):
        super().__init__()
        engine_skeleton(self)
        for _ in range(LAYERS):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.qkv_proj = Linear(H, [Q, KV, KV], ["q", "k", "v"], **scheme)
            layer.self_attn.o_proj = Linear(Q, [H], **scheme)
            add_layer(self, layer, FusedMoE(group=scheme.get("group", GROUP)))

    def initial_load(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            p = parse(name)
            if p is not None and p.expert is not None:
                self.get_submodule(p.experts_module).load(p.leaf, w, p.proj, p.expert)
            elif p is not None:
                self.get_submodule(p.engine_module).load(p.leaf, w, SHARD.get(p.proj))
            else:
                params[name].weight_loader(params[name], w)
        for m in self.modules():
            if hasattr(m, "quant_method") and m.quant_method is not None:
                m.quant_method.process_weights_after_loading(m)


def engine(seed=0, **scheme):
    m = W4EngineModel(**scheme)
    m.initial_load(packed(FMT, seed))
    return m


def _write(model, stream):
    layout, tensors = describe(model)
    writer = writer_for(SPEC, layout, tensors)
    writer.write_all(stream)
    sent = writer.sent.result()
    check_digest(sent, handle(model, {"what": "digest", "names": writer.shapes})["digest"])
    return writer, sent


def _garbage(model):
    """Every live tensor of the layout (but the padded embedding) filled with 0x5A bytes."""
    _, tensors = describe(model)
    for n, t in tensors.items():
        if "embed" not in n:
            t.view(torch.uint8).fill_(0x5A)
    return model


def _marlin_params(model):
    layout, _ = describe(model)
    return {n: p.marlin for n, p in layout.params.items() if p.marlin}


@pytest.mark.parametrize("stream", ["bf16", "bf16_stacked", "packed", "packed_stacked"])
def test_every_marlin_region_is_written_as_a_fresh_engine_loads_it(stream):
    """From a model whose every synced tensor is garbage, one direct sync of weights B —
    quantized by the writer (BF16 stream) or copied from the packed stream, per expert or
    expert-stacked — leaves every parameter bit-equal to an engine loaded from B's packed
    checkpoint (codes repacked, scales permuted: single-group runs of 8 for K = 128, runs of
    64 otherwise and for w13), and the read-back digest (layout undone) agrees. Catches: a
    region left unwritten, a member written into the wrong columns, scales not permuted or
    permuted with the wrong run, codes copied without the repack."""
    want = engine(seed=1)
    got = _garbage(engine(seed=0))
    stack = stream.endswith("stacked")
    src = (writer_stream(SPEC, hf_weights(1), stack_experts=stack) if stream.startswith("bf16")
           else packed(FMT, 1, stack=stack))
    writer, sent = _write(got, src)
    a, b = state(want), state(got)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    assert (writer.quantized > 0) == stream.startswith("bf16")
    # weight_shape tensors per expert kind (a BF16 stack is quantized and packed as a stack)
    stacks = 1 if stream.endswith("stacked") else E
    assert writer.kept == (4 + 3 * stacks) * LAYERS  # not written: the engine keeps its own
    assert set(_marlin_params(got).values()) == {"codes", "scales", "scales_single"}
    _, want_sent = _write(engine(seed=0), packed(FMT, 1, stack=stack))
    assert sent == want_sent


def test_sync_weights_hands_a_w4a16_direct_engine_its_weights():
    """The driver's sync into a direct w4a16 engine, twice: the weights go unquantized, the
    writer quantizes them into the Marlin layout, the digest is verified, the handles are
    taken once. Catches: the driver packing for this engine, a digest not requested."""
    m = _garbage(engine(seed=0))
    eng = _direct_engine(m, FMT)
    for v in (1, 2):
        sync_weights(iter(hf_weights(v)), eng, SPEC, version=v)
    assert eng.last_sync["verified"] == "digest" and eng.weight_version() == 2
    assert eng.requests.count("export") == 1
    a, b = state(engine(seed=2)), state(m)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []


def test_cached_codes_reach_the_marlin_layout_unchanged():
    """The Q(W) cache's codes and scales (of a master that has moved since) are what the
    engine holds, repacked; nothing is quantized again. Catches: a writer re-quantizing."""
    old = dict(hf_weights(6))
    master = {n: (t + 0.01).to(t.dtype) if SPEC.is_quantized(n) else t for n, t in old.items()}
    cache = {n: SPEC.quantize_weight(t, name=n) for n, t in old.items() if SPEC.is_quantized(n)}
    got = _garbage(engine(seed=0))
    writer, _ = _write(got, writer_stream(SPEC, master.items(), quantized=cache.get))
    assert writer.quantized == 0 and writer.copied > 0
    a, b = state(engine(seed=6)), state(got)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []


def test_digest_names_the_layer_of_a_flipped_nibble_in_the_marlin_codes():
    """Catches: a read-back that fingerprints the live words without undoing the repack
    (it would fail every sync) or not at all (it would miss this)."""
    m = engine(seed=0)
    layout, tensors = describe(m)
    writer = writer_for(SPEC, layout, tensors)
    writer.write_all(writer_stream(SPEC, hf_weights(3)))
    sent = writer.sent.result()
    check_digest(sent, handle(m, {"what": "digest", "names": writer.shapes})["digest"])
    m.model.layers[1].mlp.experts.w2_weight_packed.data[1, 0, 5] ^= 0x10
    held = handle(m, {"what": "digest", "names": writer.shapes})["digest"]
    with pytest.raises(WeightSyncError, match=r"experts\.1\.down_proj\.weight_packed' \(layer 1\)"):
        check_digest(sent, held)


def test_direct_write_lists_w4a16_now_that_the_writer_serves_it():
    """``EngineFacts.direct_write`` is set for exactly the formats the writer serves (the
    three checkpoint-layout formats and w4a16 through the Marlin layout); nvfp4 is refused
    naming the flag."""
    assert sorted(_direct_formats()) == ["fp8", "fp8_block", "int8", "w4a16"]
    assert SGLangOptions(sync="direct", release_memory=False).resolve(FMT)
    layout, tensors = describe(engine())
    with pytest.raises(ValueError, match=r"sync direct: format 'nvfp4'.*sync inplace"):
        writer_for(get_spec("nvfp4"), layout, tensors)


@pytest.mark.parametrize("setting,match", [
    ({"act_order": True}, r"'act order': True"),
    ({"group": 64}, r"'group': 64"),
])
def test_uncovered_wna16_settings_are_refused_naming_them(setting, match):
    """Act order (g_idx) and a group size other than the format's: one clear error each."""
    m = W4EngineModel(**setting)
    with pytest.raises(EngineLayoutError, match=match + r".*sync inplace"):
        describe(m)


def test_an_unprocessed_or_rocm_moe_is_refused():
    m = engine()
    m.model.layers[0].mlp.experts.is_marlin_converted = False
    with pytest.raises(EngineLayoutError, match=r"'processed': False"):
        describe(m)

    class CompressedTensorsWNA16TritonMoE(CompressedTensorsWNA16MoE):
        pass

    m = engine()
    m.model.layers[0].mlp.experts.quant_method = CompressedTensorsWNA16TritonMoE()
    m.model.layers[0].mlp.experts.scheme = m.model.layers[0].mlp.experts.quant_method
    with pytest.raises(EngineLayoutError, match=r"TritonMoE, whose live layout is not Marlin"):
        describe(m)


def test_a_member_off_the_64_column_tiles_is_refused():
    pl = ParamLayout((192, 16), "int32", shards={"q_proj": (0, 96), "k_proj": (96, 192)},
                     marlin="codes")
    live = torch.zeros(8, 384, dtype=torch.int32)
    with pytest.raises(EngineLayoutError, match=r"not 64-aligned"):
        view(live, pl, Target("p", None, (0, 96)), (96, 16))
    whole = view(live, ParamLayout((192, 16), "int32", marlin="codes"), Target("p", None, None),
                 (192, 16))
    assert whole.data_ptr() == live.data_ptr() and whole.shape == (8, 384)


def test_a_non_finite_weight_fails_the_write_naming_it():
    """The reference quantizer's finiteness check names the expert the writer quantized.
    Catches: a Marlin path that skips the check (the engine would hold codes of an Inf)."""
    weights = dict(hf_weights(8))
    bad = "model.layers.1.mlp.experts.1.down_proj.weight"
    weights[bad] = weights[bad].clone()
    weights[bad][3, 4] = float("inf")
    layout, tensors = describe(engine())
    with pytest.raises(ValueError, match=r"experts\.1\.down_proj\.weight.*(NaN|Inf|finite)"):
        writer_for(SPEC, layout, tensors).write_all(writer_stream(SPEC, weights.items()))


def test_the_engine_side_group_is_the_formats():
    """marlin_params (inside SGLang, no trainer imports) keeps its own copy of the group size."""
    from megatron_qrl.quant.formats import w4a16
    from megatron_qrl.rollout_sglang.sync.loader import marlin_params

    assert marlin_params.GROUP == w4a16.GROUP


def test_a_bf16_expert_stack_is_quantized_as_a_stack(monkeypatch):
    """A layer's BF16 expert stack costs one quantizer call per run of experts (here the whole
    stack), not one per expert, and leaves the per-expert bits. Catches: the writer
    quantizing, packing and changing the layout of each expert of a stack on its own (~18k
    calls per 30B-A3B sync)."""
    want, got = engine(seed=1), _garbage(engine(seed=0))
    calls = []
    real = type(SPEC).quantize_weight
    monkeypatch.setattr(type(SPEC), "quantize_weight", lambda self, w, **kw: calls.append(
        (kw.get("name", ""), w.shape[0])) or real(self, w, **kw))
    _write(got, writer_stream(SPEC, hf_weights(1), stack_experts=True))
    a, b = state(want), state(got)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    experts = [(n, rows) for n, rows in calls if ".experts." in n]
    assert len(experts) == 3 * LAYERS, experts
    assert all(".experts.*." in n and rows in (E * FFN, E * H) for n, rows in experts), experts
