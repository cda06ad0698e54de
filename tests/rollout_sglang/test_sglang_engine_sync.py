"""SGLangEngine.update_weights end to end on CPU: the real bucketing, prefetch thread, control
tensors, request flow, in-place loader and receipt, against a stand-in for the running engine
(the tokenizer manager's request lands in ``load_packed`` on the fake SGLang model of
test_sglang_inplace, as SGLang's scheduler would run it). A tensor dropped or corrupted
between the sender and the loader, or loaded differently from what arrived, fails the sync
naming it (the loader's receipt against the sender's fingerprints)."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import types
from dataclasses import dataclass

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.rollout.base import WeightSyncError, tensor_checksum
from megatron_qrl.rollout.wire import unflatten
from megatron_qrl.rollout_sglang import SGLangEngine, SGLangOptions
from megatron_qrl.rollout_sglang.sync.loader import load_packed
from megatron_qrl.rollout_sglang.sync.protocol import FLAT, RECV, decode_control, encode_control
from tests.rollout_sglang.test_sglang_inplace import FakeModel, live_tensors, weights


@dataclass
class _Req:  # sglang.srt.managers.io_struct.UpdateWeightsFromTensorReqInput's fields we set
    serialized_named_tensors: list
    load_format: str | None = None
    flush_cache: bool = False
    weight_version: str | None = None


class _TokenizerManager:
    def __init__(self, model, fail_at=None, transport=None):
        self.model, self.version, self.requests, self.fail_at = model, None, 0, fail_at
        self.transport = transport or (lambda items: items)  # what the IPC hop does to a bucket

    async def update_weights_from_tensor(self, req, _request):
        self.requests += 1
        if self.requests == self.fail_at:
            return False, "out of memory (stand-in)", 0
        load_packed(self.model, self.transport(list(req.serialized_named_tensors)))
        if req.weight_version is not None:
            self.version = req.weight_version
        return True, "ok", 0


class _Engine:  # the parts of sglang.Engine that SGLangEngine's tensor sync calls
    def __init__(self, model, fail_at=None, transport=None):
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = _TokenizerManager(model, fail_at, transport)

    def _serialize_tensors_per_rank(self, items, _):
        return list(items)  # in-process stand-in for the CUDA-IPC handles

    def get_server_info(self):
        return {"weight_version": self.tokenizer_manager.version}


@pytest.fixture(autouse=True)
def fake_io_struct(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the engine's receipt directory
    mod = types.ModuleType("sglang.srt.managers.io_struct")
    mod.UpdateWeightsFromTensorReqInput = _Req
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name, types.ModuleType(name)))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", mod)


def _engine(model, bucket_bytes, flatten, prefetch, fail_at=None, direct=False, stacked=False,
            transport=None, receipt=True):
    eng = object.__new__(SGLangEngine)  # no sglang.Engine: the stand-in above
    eng.options = SGLangOptions(sync="inplace", flat_buckets=flatten, prefetch_buckets=prefetch,
                                direct_expert_loads=direct, stack_experts=stacked,
                                receipt=receipt).resolve("int8")
    eng.spec, eng.trainer_device = get_spec("int8"), torch.device("cpu")
    eng.bucket_bytes, eng.processes, eng.model_path = bucket_bytes, 1, None
    eng.engine = _Engine(model, fail_at, transport)
    eng._reset_sync_state()
    return eng


@pytest.mark.parametrize("flatten,prefetch,direct", [
    (False, 0, False), (True, 0, False), (False, 1, False), (True, 1, False), (True, 3, False),
    (False, 0, True), (True, 1, True)])
def test_update_weights_in_place_equals_a_fresh_load(flatten, prefetch, direct, monkeypatch):
    from megatron_qrl.rollout_sglang.sync.loader import experts as expert_loads

    # the fake model's load_weights maps experts as SGLang's Qwen3-MoE does
    monkeypatch.setattr(expert_loads, "MODELS", expert_loads.MODELS | {"FakeModel"})
    model = FakeModel()
    seen = []
    real = model.load_weights
    model.load_weights = lambda ws: seen.extend(n for n, _ in ws) or real(ws)
    before = {k: t.data_ptr() for k, t in live_tensors(model).items()}
    eng = _engine(model, bucket_bytes=300, flatten=flatten, prefetch=prefetch, direct=direct)
    stream = list(weights(1))
    eng.update_weights(iter(stream), version=7)
    assert eng.weight_version() == 7 and eng.last_sync["buckets"] > 3
    lap = eng.last_sync  # where the sync's time went (bench/weight_sync.py prints it)
    parts = ("request_s", "produce_s", "wait_s", "serialize_s", "finish_s")
    assert all(0.0 <= lap[k] <= lap["seconds"] for k in parts), lap
    if not prefetch:  # inline: the wait for a bucket IS its preparation
        assert lap["wait_s"] >= lap["produce_s"]
    # produce_s's parts: waiting on the packed stream, fingerprints, flat buckets
    assert lap["stream_s"] + lap["fingerprint_s"] + lap.get("flatten_s", 0.0) <= lap["produce_s"]
    assert lap["fingerprint_s"] > 0 and ("flatten_s" in lap) == flatten
    want = live_tensors(FakeModel(seed=1))
    for k, t in live_tensors(model).items():
        assert t.data_ptr() == before[k], f"{k} lost its storage"
        torch.testing.assert_close(t, want[k], rtol=0, atol=0, msg=k)
    # what the loader received, fingerprinted in the "scheduler", equals what was sent
    assert eng.last_sync["verified"] == "receipt"
    assert eng.held_checksums() == eng.sent_checksums() == {
        n: tensor_checksum(t) for n, t in stream}
    # direct: no expert tensor went through model.load_weights (its mapping scan)
    assert any(".experts." in n for n in seen) != direct and seen


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_rejected_bucket_fails_the_sync_and_stops_the_producer(prefetch):
    from megatron_qrl.rollout.base import WeightSyncError

    model = FakeModel()
    produced = []

    def stream():
        for n, t in weights(1):
            produced.append(n)
            yield n, t

    eng = _engine(model, bucket_bytes=300, flatten=False, prefetch=prefetch, fail_at=2)
    with pytest.raises(WeightSyncError, match="rejected a weight bucket.*out of memory"):
        eng.update_weights(stream(), version=1)
    assert len(produced) < len(list(weights(1)))  # nothing ran on to the end of the stream


def test_direct_expert_loads_fall_back_for_a_model_whose_mapping_was_not_read():
    model = FakeModel()  # not in expert_loads.MODELS: every tensor through load_weights
    seen = []
    real = model.load_weights
    model.load_weights = lambda ws: seen.extend(n for n, _ in ws) or real(ws)
    _engine(model, bucket_bytes=300, flatten=False, prefetch=0, direct=True).update_weights(
        iter(weights(1)), version=1)
    assert sum(".experts." in n for n in seen) == sum(".experts." in n for n, _ in weights(1))
    want = live_tensors(FakeModel(seed=1))
    for k, t in live_tensors(model).items():
        torch.testing.assert_close(t, want[k], rtol=0, atol=0, msg=k)


NORM = "model.layers.0.input_layernorm.weight"  # loads verbatim: no shard count covers it
QKV = "model.layers.0.self_attn.k_proj.weight_scale"


def _drop(name):
    def transport(items):
        if any(n == FLAT for n, _ in items):  # a flat bucket: cut the tensor from buffer + meta
            recv = next(t for n, t in items if n == RECV)
            flat = next(t for n, t in items if n == FLAT)
            kept = [(n, t) for n, t in unflatten(flat, decode_control(recv)["meta"]) if n != name]
            meta = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in kept]
            buf = (torch.cat([t.reshape(-1).view(torch.uint8) for _, t in kept]) if kept
                   else flat[:0])
            return [(RECV, encode_control({"meta": meta})), (FLAT, buf)] + [
                (n, t) for n, t in items if n not in (RECV, FLAT)]
        return [(n, t) for n, t in items if n != name]
    return transport


def _corrupt(name):
    def transport(items):
        out = []
        for n, t in items:
            if n == FLAT:  # flip the first byte of ``name`` in the flat buffer
                pos = 0
                for m, dtype, shape in decode_control(dict(items)[RECV])["meta"]:
                    if m == name:
                        t = t.clone()
                        t[pos] ^= 0x40
                        break
                    pos += getattr(torch, dtype).itemsize * int(torch.Size(shape).numel())
            elif n == name:
                t = t.clone()
                t.view(torch.uint8).reshape(-1)[0] ^= 0x40
            out.append((n, t))
        return out
    return transport


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("fault,name,match", [
    (_drop, NORM, "did not receive tensor '" + NORM),
    (_corrupt, NORM, "holds a different '" + NORM),
    (_corrupt, QKV, "holds a different '" + QKV),
])
def test_a_tensor_dropped_or_corrupted_in_transport_fails_the_sync(flatten, fault, name, match):
    """The loader's receipt of what arrived is compared with what was sent: a norm dropped on
    the way (no shard count covers it) or any byte flipped is an error naming the tensor."""
    eng = _engine(FakeModel(), bucket_bytes=300, flatten=flatten, prefetch=0,
                  transport=fault(name))
    with pytest.raises(WeightSyncError, match=match):
        eng.update_weights(iter(weights(1)), version=2)
    clean = _engine(FakeModel(), bucket_bytes=300, flatten=flatten, prefetch=0)
    clean.update_weights(iter(weights(1)), version=2)  # the same sync without the fault passes
    # --no-qrl-rollout-sglang-receipt: only the version is checked, the fault goes unseen
    blind = _engine(FakeModel(), bucket_bytes=300, flatten=flatten, prefetch=0,
                    transport=fault(name), receipt=False)
    blind.update_weights(iter(weights(1)), version=2)
    assert blind.last_sync["verified"] == "version" and blind._receipts is None


def test_a_parameter_loaded_differently_from_what_arrived_fails_the_sync():
    """Where SGLang keeps the received layout (a norm), the receipt also fingerprints what the
    engine HOLDS after loading: a load that changes the bits is caught."""
    model = FakeModel()
    real = model.load_weights

    def load_plus_one(ws):
        real(ws)
        with torch.no_grad():
            model.model.layers[0].input_layernorm.weight.add_(1.0)

    model.load_weights = load_plus_one
    with pytest.raises(WeightSyncError, match="holds a different '" + NORM + "' after loading"):
        _engine(model, bucket_bytes=300, flatten=True, prefetch=0).update_weights(
            iter(weights(1)), version=1)


def test_a_scheduler_without_a_receipt_fails_the_sync():
    eng = _engine(FakeModel(), bucket_bytes=300, flatten=True, prefetch=0)
    eng.processes = 2  # TP 2: two scheduler processes must each report
    with pytest.raises(WeightSyncError, match="1 of the engine's 2 scheduler"):
        eng.update_weights(iter(weights(1)), version=1)


def test_the_receipt_reads_views_at_any_byte_offset_of_a_flat_bucket():
    """A flat bucket's tensors are views at any byte offset; the fingerprints read 32-bit
    words, so a view that is not 4-byte aligned is fingerprinted from a copy, equal to the
    sender's (per expert for a stack)."""
    from megatron_qrl.rollout_sglang.sync.loader.receipt import RECEIPT_ATTR, note_received

    flat = torch.arange(64, dtype=torch.uint8)
    stack = flat[2:18].view(torch.bfloat16).view(2, 4)  # offset 2: rows of 8 bytes
    norm = flat[19:26]
    model = torch.nn.Module()
    name = "model.layers.0.mlp.experts.*.up_proj.weight"
    note_received(model, {"receipt": "x", "begin": True}, [(name, stack), (NORM, norm)])
    got = vars(model)[RECEIPT_ATTR].result()
    assert got == {"model.layers.0.mlp.experts.0.up_proj.weight": tensor_checksum(stack[0].clone()),
                   "model.layers.0.mlp.experts.1.up_proj.weight": tensor_checksum(stack[1].clone()),
                   NORM: tensor_checksum(norm.clone())}


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_nonfinite_weight_fails_a_packed_sync_before_its_version(prefetch):
    """``pack_state_dict`` checks its weights' finiteness once, at the end of its stream: the
    sync raises NonFiniteError naming the weight before the last bucket (the one carrying the
    weight version) goes out, so the engine keeps its version; the buckets before it were
    loaded (a partial update, as after any failed sync). Fails without the check at the
    stream's end (a check left to the caller, after ``update_weights``: version 8 is set)."""
    from megatron_qrl.utils.finite import NonFiniteError

    spec = get_spec("int8")
    hf = [(n, t) for n, t in weights(1) if not n.endswith(".weight_scale")]
    eng = _engine(FakeModel(), bucket_bytes=300, flatten=False, prefetch=prefetch)
    eng.update_weights(spec.pack_state_dict(iter(hf)), version=7)
    manager = eng.engine.tokenizer_manager
    assert eng.weight_version() == 7 and manager.version == "7"
    bad = "model.layers.0.mlp.experts.1.up_proj.weight"
    broken = [(n, t.clone()) for n, t in hf]
    dict(broken)[bad][0, 0] = float("nan")
    before = manager.requests
    with pytest.raises(NonFiniteError, match=rf"^int8: {bad} holds NaN / Inf"):
        eng.update_weights(spec.pack_state_dict(iter(broken)), version=8)
    assert eng.weight_version() == 7 and manager.version == "7"
    assert manager.requests > before + 1  # the buckets up to the end of the stream went out
