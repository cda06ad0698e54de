"""The transport contract for the SGLang side's transports that run on CPU, each given only
its typed :class:`~megatron_qrl.rollout_sglang.sync.session.SGLangSession` (no engine):
``tensor`` (plain buckets to SGLang's loader), ``inplace`` (our loader, whose receipt the
transport verifies) and ``disk`` (safetensors, one load). What the receiver gets equals
the stream, cut by the one rule into requests; only the last request carries the version;
an empty stream still sends it; ``verify`` checks the receipt where the transport has one.
The stand-in for SGLang's tokenizer manager is test_sglang_engine_sync's (the in-place
loader on the fake SGLang model of test_sglang_inplace). ``distributed`` needs an NCCL
group (tests/gpu/test_sglang_inplace.py)."""

from __future__ import annotations

import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch

import megatron_qrl.rollout_sglang.sync.transports  # noqa: F401  (registration)
from megatron_qrl.quant import get_spec
from megatron_qrl.rollout.base import Checksums, WeightSyncError, tensor_checksum
from megatron_qrl.rollout_sglang.options import SGLangOptions
from megatron_qrl.rollout_sglang.sync.loader import load_packed
from megatron_qrl.rollout_sglang.sync.session import SGLangSession
from megatron_qrl.sync.protocol.inplace import LOADER
from megatron_qrl.sync.transport import cut, transport_class
from tests.rollout_sglang.test_sglang_engine_sync import _Req
from tests.rollout_sglang.test_sglang_inplace import FakeModel, weights

BUCKET = 300


@pytest.fixture(autouse=True)
def fake_io_struct(monkeypatch):
    mod = types.ModuleType("sglang.srt.managers.io_struct")
    mod.UpdateWeightsFromTensorReqInput = _Req
    mod.UpdateWeightFromDiskReqInput = lambda **kw: types.SimpleNamespace(**kw)
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name, types.ModuleType(name)))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", mod)


def _session(sync: str, requests: list, receiver, tmp_path: Path,
             receipt: str | None = None) -> SGLangSession:
    loader = {"direct_expert_loads": False, "stack_experts": False} if sync == "inplace" else {}
    options = SGLangOptions(sync=sync, sync_dir=str(tmp_path / "sync"),
                            receipt=receipt is not None, **loader
                            ).resolve("int8" if sync == "inplace" else "bf16")

    def request(method, req, first):
        requests.append(req)
        return receiver(req)

    return SGLangSession(options, get_spec("int8"), torch.device("cpu"), BUCKET, 1,
                         tmp_path, Checksums(), receipt, {"buckets": 0},
                         serialize=list, request=request,
                         call=lambda method, req: request(method, req, ""),
                         weight_group=lambda: None)


def _names(reqs) -> list[list[str]]:
    return [[n for n, _ in r.serialized_named_tensors] for r in reqs]


def test_tensor_contract(tmp_path):
    stream = list(weights(1))
    reqs: list = []
    s = _session("tensor", reqs, lambda req: (True, "ok"), tmp_path)
    transport = transport_class("sglang", "tensor", "--flag")(s)
    assert transport.send(iter(stream), version=3) == len(reqs) == s.lap["buckets"]
    got = [(n, t) for r in reqs for n, t in r.serialized_named_tensors]
    assert [(n, tensor_checksum(t)) for n, t in got] == [(n, tensor_checksum(t)) for n, t in stream]
    assert _names(reqs) == [[n for n, _ in b] for b, _ in cut(stream, BUCKET)]
    assert [r.weight_version for r in reqs] == [None] * (len(reqs) - 1) + ["3"]
    assert [r.flush_cache for r in reqs] == [False] * (len(reqs) - 1) + [True]
    assert all(r.load_format is None for r in reqs)
    assert s.sent.result() == {n: tensor_checksum(t) for n, t in stream}
    assert transport.verify(s.sent.result()) is None  # SGLang's own loader: no receipt
    reqs.clear()
    transport.send(iter(()), version=4)  # no tensors: the version still arrives
    assert [(r.serialized_named_tensors, r.weight_version) for r in reqs] == [([], "4")]
    with pytest.raises(WeightSyncError, match="rejected a weight bucket"):
        transport_class("sglang", "tensor", "")(_session(
            "tensor", [], lambda req: (False, "no"), tmp_path)).send(iter(stream), 5)


def test_inplace_contract_verifies_the_receipt(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = FakeModel()
    stream = list(weights(1))

    def load(req):
        load_packed(model, list(req.serialized_named_tensors))
        return True, "ok"

    reqs: list = []
    s = _session("inplace", reqs, load, tmp_path, receipt=str(tmp_path / "v7"))
    transport = transport_class("sglang", "inplace", "--flag")(s)
    transport.send(iter(stream), version=7)
    assert len(reqs) > 3 and reqs[-1].weight_version == "7"
    assert {r.load_format for r in reqs} == {LOADER}
    sent = s.sent.result()
    assert sent == {n: tensor_checksum(t) for n, t in stream}
    assert transport.verify(sent) == sent  # the loader's receipt, checked
    # a receipt that disagrees with what was sent is the transport's to catch
    transport.send(iter(stream), version=8)
    wrong = dict(sent) | {stream[0][0]: "float32[1]:0"}
    with pytest.raises(WeightSyncError, match=stream[0][0].replace(".", r"\.")):
        transport.verify(wrong)


def test_disk_contract(tmp_path):
    from safetensors.torch import load_file

    stream = list(weights(1))
    loaded: dict = {}

    def load(req):  # SGLang's update_weights_from_disk, reading the directory it is given
        for f in sorted(Path(req.model_path).glob("*.safetensors")):
            loaded.update(load_file(str(f)))
        loaded["version"] = req.weight_version
        return True, "ok"

    s = _session("disk", [], load, tmp_path)
    transport = transport_class("sglang", "disk", "--flag")(s)
    assert transport.send(iter(stream), version=2) == 1
    assert loaded.pop("version") == "2"
    assert {n: tensor_checksum(t) for n, t in loaded.items()} == {
        n: tensor_checksum(t) for n, t in stream} == s.sent.result()
    assert not (tmp_path / "sync" / "v2").exists()  # removed after the load
    assert transport.verify(s.sent.result()) is None
