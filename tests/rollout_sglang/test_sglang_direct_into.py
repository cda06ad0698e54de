"""CPU tests of the direct sync quantizing straight into the engine's tensors: the trainer's
BF16 weights (``writer_stream``, what ``rl.sync.sync_weights`` hands an engine that
``quantizes_into``) written by ``QuantSpec.quantize_into`` into the engine-like model of
test_sglang_direct.py, against the in-place loader fed the packed stream; the aligned
forward's cached codes copied as they are; the read-back digest of what was quantized.
"""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.pack_stream import writer_stream
from megatron_qrl.rl.sync import sync_weights
from megatron_qrl.rollout_sglang.sync.loader.live_storage import describe
from megatron_qrl.rollout_sglang.sync.loader.storage import handle
from megatron_qrl.rollout_sglang.sync.writer import check_digest, writer_for
from megatron_qrl.sync.protocol.checksums import WeightSyncError
from megatron_qrl.sync.protocol.engine_layout import locate, view
from tests.quant.test_quant_expert_stacks import FreshTensors
from tests.rollout_sglang.test_sglang_direct import (
    FFN,
    Q,
    _direct_engine,
    engine,
    hf_weights,
    inplace_sync,
    packed,
    state,
)

FORMATS = ["fp8", "fp8_block", "int8"]


def fresh_codes() -> FreshTensors:
    """Counts the tensors of a code dtype (float8 / int8) that aten ops create with storage of
    their own: a packed intermediate of a weight."""
    return FreshTensors(dtypes=(torch.float8_e4m3fn, torch.int8))


def _write(model, fmt, stream, fresh=None):
    layout, tensors = describe(model)
    writer = writer_for(get_spec(fmt), layout, tensors)
    with fresh if fresh is not None else torch.no_grad():
        writer.write_all(stream)
    sent = writer.sent.result()
    check_digest(sent, handle(model, {"what": "digest", "names": writer.shapes})["digest"])
    return writer, sent


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stack", [False, True], ids=["per_expert", "stacked"])
def test_quantized_into_the_engine_is_the_inplace_loaders_bits(fmt, stack):
    """The BF16 stream quantized into the engine leaves every parameter bit-equal to the
    in-place loader fed the packed stream, with no tensor of codes made along the way and
    the same fingerprints as the packed stream's. Catches: a scale not from the format's
    expressions (``1 / s``, int8's zero rows), an E4M3 cast that saturates differently, a
    block amax over the wrong rows, a writer that packs and copies (a codes tensor per
    weight: ``quantize_weight`` then ``copy_``)."""
    ref, got = engine(fmt, seed=0), engine(fmt, seed=0)
    inplace_sync(ref, fmt, packed(fmt, 1, stack=False))
    fresh = fresh_codes()
    writer, sent = _write(got, fmt, writer_stream(get_spec(fmt), hf_weights(1),
                                                  stack_experts=stack), fresh)
    assert writer.quantized > 0 and fresh.count == 0, (writer.quantized, fresh.count)
    a, b = state(ref), state(got)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    _, want = _write(engine(fmt, seed=0), fmt, packed(fmt, 1, stack=stack))
    assert sent == want  # the packed stream's fingerprints, expert by expert


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_stream_still_copies(fmt):
    """A packed stream (what the GPU test and ``+packed`` bench variants hand the engine) is
    copied, not quantized: a codes tensor of its own per weight is the packer's, and the
    writer quantizes nothing."""
    m = engine(fmt)
    writer, _ = _write(m, fmt, packed(fmt, 2, stack=True))
    assert writer.quantized == 0 and writer.copied > 0


def test_digest_of_quantized_regions_names_the_layer():
    """A byte of a quantized expert region changed after the write fails the read-back.
    Catches: fingerprints taken of something other than what was written into the engine."""
    m = engine("fp8")
    layout, tensors = describe(m)
    writer = writer_for(get_spec("fp8"), layout, tensors)
    writer.write_all(writer_stream(get_spec("fp8"), hf_weights(3)))
    sent = writer.sent.result()
    m.model.layers[1].mlp.experts.w13_weight.data.view(torch.uint8)[0, FFN + 2, 3] ^= 1
    held = handle(m, {"what": "digest", "names": writer.shapes})["digest"]
    with pytest.raises(WeightSyncError, match=r"experts\.0\.up_proj\.weight' \(layer 1\)"):
        check_digest(sent, held)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_sync_weights_hands_the_direct_engine_its_weights(fmt):
    """The driver's sync into a direct engine: the weights go unquantized (the engine
    quantizes them into its storage), the digest is verified, the count is the packed
    tensors'. Catches: the driver packing for an engine that quantizes itself."""
    ref, m = engine(fmt), engine(fmt)
    eng = _direct_engine(m, fmt)
    assert eng.quantizes_into
    res = sync_weights(iter(hf_weights(5)), eng, get_spec(fmt), version=1)
    inplace_sync(ref, fmt, packed(fmt, 5))
    a, b = state(ref), state(m)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert eng.last_sync["verified"] == "digest" and eng.weight_version() == 1
    assert eng.last_sync["quantized"] == 2 * 4 + 2 * 3  # per layer: q k v o, 3 expert stacks
    assert res.num_tensors == len(packed(fmt, 5)) == len(eng.sent_checksums())


@pytest.mark.parametrize("fmt", FORMATS)
def test_cached_codes_are_what_the_engine_holds(fmt):
    """Quantize once per step: every weight the aligned forward's Q(W) cache holds reaches the
    engine as the cache's codes and scales, bit for bit, and is not quantized again. The
    master has moved since the cache was made (a perturbed master), so only a copy of the
    cache gives these bits. Catches: a sync that re-quantizes the master instead of reusing
    the cache (every region would differ)."""
    spec = get_spec(fmt)
    old = dict(hf_weights(6))
    master = {n: (t + 0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(7))
                  ).to(t.dtype) if spec.is_quantized(n) else t for n, t in old.items()}
    cache = {n: spec.quantize_weight(t, name=n) for n, t in old.items() if spec.is_quantized(n)}
    looked = []

    def quantized(name):
        looked.append(name)
        return cache.get(name)

    m = engine(fmt)
    eng = _direct_engine(m, fmt)
    sync_weights(iter(master.items()), eng, spec, version=1, quantized=quantized)
    assert sorted(looked) == sorted(cache)
    assert eng.last_sync["quantized"] == 0  # every quantized weight came from the cache
    layout, tensors = describe(m)
    for name, q in cache.items():
        for leaf, want in spec.pack_quantized(name, q):
            t = locate(layout, leaf)
            got = view(tensors[t.param], layout.params[t.param], t, tuple(want.shape))
            assert torch.equal(got.contiguous().view(torch.uint8),
                               want.contiguous().view(torch.uint8)), leaf
    qkv = m.model.layers[0].self_attn.qkv_proj
    assert torch.equal(qkv.weight.t()[:Q].contiguous().view(torch.uint8) if fmt != "fp8_block"
                       else qkv.weight[:Q].view(torch.uint8),
                       cache["model.layers.0.self_attn.q_proj.weight"].codes.view(torch.uint8))


def test_formats_a_writer_cannot_serve_are_refused():
    with pytest.raises(ValueError, match=r"nvfp4: the members of a fused group share"):
        list(writer_stream(get_spec("nvfp4"), hf_weights(0)))
    with pytest.raises(NotImplementedError, match=r"w4a16: quantizing straight into"):
        get_spec("w4a16").quantize_into("model.layers.0.self_attn.o_proj.weight",
                                        torch.zeros(128, 256, dtype=torch.bfloat16),
                                        lambda n, s, d: torch.empty(s, dtype=d))


def test_a_non_finite_weight_fails_the_write_naming_it_with_one_check():
    """The writer checks every quantized weight's finiteness once, after writing (no host
    sync per weight), and names the first bad one; the engine's version does not move.
    Catches: a deferred check that is never made."""
    m = engine("fp8_block")
    eng = _direct_engine(m, "fp8_block")
    weights = dict(hf_weights(8))
    bad = "model.layers.1.mlp.experts.1.down_proj.weight"
    weights[bad] = weights[bad].clone()
    weights[bad][3, 4] = float("inf")
    with pytest.raises(ValueError, match=r"experts\.\*\.down_proj\.weight holds NaN / Inf"):
        sync_weights(iter(weights.items()), eng, get_spec("fp8_block"), version=1)
    assert eng.weight_version() != 1 and "digest" not in eng.requests
