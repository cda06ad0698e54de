"""Ray modes cut the weight stream once: the driver's transport cuts it into buckets by the
one rule (:func:`megatron_qrl.sync.transport.cut`), the engine actor receives those buckets
(:class:`~megatron_qrl.sync.protocol.wire.CutStream`) and an engine that buckets again (the
SGLang sender, :func:`~megatron_qrl.rollout_sglang.sync.sender.requests`) keeps them.

The driver's frames go through a loopback group (every broadcast recorded, then replayed
into :func:`~megatron_qrl.rollout.broadcast.receive_stream`, as the engine actor reads it);
the engine side is the SGLang sender's real request builder on CPU. Every bucketing pass
anywhere in the package is counted (:func:`megatron_qrl.sync.protocol.wire.buckets` on a
stream that is not already cut)."""

from __future__ import annotations

import sys

import pytest
import torch

import megatron_qrl.rollout.broadcast as bc
import megatron_qrl.rollout.weight_groups as wg
import megatron_qrl.sync.protocol.wire as wire_mod
from megatron_qrl.quant import get_spec
from megatron_qrl.quant.expert_stacks import stack_experts
from megatron_qrl.rollout.base import Checksums, WeightManifest
from megatron_qrl.rollout.ray_actor import EngineSpec
from megatron_qrl.rollout.transports.fleet import FleetFrames
from megatron_qrl.rollout_sglang.factory import takes_expert_stacks
from megatron_qrl.rollout_sglang.options import SGLangOptions
from megatron_qrl.rollout_sglang.sync.protocol import CONTROL, FLAT, RECV, decode_control
from megatron_qrl.rollout_sglang.sync.sender import StreamTracker, packed_suffixes, requests
from megatron_qrl.sync.protocol.inplace import parse_stacked
from megatron_qrl.sync.protocol.wire import CutStream, unflatten
from megatron_qrl.utils import hf_names
from tests.rl.test_rl_ray import _packed

DRIVER_BUCKET = 4096
ENGINE_BUCKET = 512 * 2**20  # the SGLang engine's default: one request for the whole stream


def _count_passes(monkeypatch) -> list[int]:
    """Every call of the one bucketing rule that cuts (not a stream already cut), wherever
    the package imported it: the ``bucket_bytes`` of each."""
    original, passes = wire_mod.buckets, []

    def counted(stream, bucket_bytes):
        if not isinstance(stream, CutStream):
            passes.append(bucket_bytes)
        return original(stream, bucket_bytes)

    for name, mod in list(sys.modules.items()):
        if name.startswith("megatron_qrl") and getattr(mod, "buckets", None) is original:
            monkeypatch.setattr(mod, "buckets", counted)
    return passes


def _over_loopback(monkeypatch, stream, bucket_bytes):
    """The driver's frames of ``stream`` (FleetFrames: the fleet's and RayEngine's framing),
    then the stream as the engine actor receives it; returns ``(buckets sent, received)``."""
    recorded: list[torch.Tensor] = []

    def record(t, group):
        recorded.append(t.detach().clone())

    def replay(t, group):
        t.copy_(recorded.pop(0))

    for mod in (bc, wg):
        monkeypatch.setattr(mod, "broadcast_from_trainer", record)
    sent = FleetFrames(None, "cpu", bucket_bytes).send(iter(stream), version=1)
    frames = [list(unflatten(recorded[i + 2], wire_mod.tensor_json(recorded[i + 1])))
              for i in range(0, len(recorded) - 1, 3)]
    for mod in (bc, wg):
        monkeypatch.setattr(mod, "broadcast_from_trainer", replay)
    return sent, frames, bc.receive_stream(None, "cpu")


def _same_as_packed(packed, sums: Checksums) -> None:
    manifest = WeightManifest()
    for _ in manifest.record(iter(packed)):
        pass
    manifest.compare(sums.result())
    assert set(sums.result()) == set(manifest.checksums)


def _names(items):
    return [n for n, _ in items if n not in (CONTROL, RECV, FLAT)]


def test_the_engine_keeps_the_driver_buckets(monkeypatch):
    _, packed = _packed()
    passes = _count_passes(monkeypatch)
    sent, frames, received = _over_loopback(monkeypatch, packed, DRIVER_BUCKET)
    assert sent == len(frames) > 3
    sent_sums = Checksums()
    out = list(requests(received, sent_sums, None, torch.device("cpu"),
                        bucket_bytes=ENGINE_BUCKET))
    assert passes == [DRIVER_BUCKET]  # one pass: the driver's; the engine's kept its buckets
    # one request per frame, then the version's (the receiver learns the end from the end mark)
    assert [_names(items) for items, _, _ in out] == [[n for n, _ in f] for f in frames] + [[]]
    assert [last for _, _, last in out] == [False] * len(frames) + [True]
    _same_as_packed(packed, sent_sums)  # what the engine fingerprints is what was packed


def test_stacked_experts_cross_the_cut_whole(monkeypatch):
    """An in-place engine that takes expert stacks: the driver stacks before its cut, so
    every bucket the engine keeps holds whole stacks, fingerprinted as the packed experts."""
    _, packed = _packed()
    passes = _count_passes(monkeypatch)
    _, frames, received = _over_loopback(monkeypatch, stack_experts(iter(packed)),
                                         DRIVER_BUCKET)
    spec = get_spec("int8")
    tracker = StreamTracker(packed_suffixes(spec), direct_experts=True)
    sums = Checksums()
    out = list(requests(received, sums, tracker, torch.device("cpu"), bucket_bytes=ENGINE_BUCKET,
                        flat=True, stack=True))
    assert passes == [DRIVER_BUCKET]
    assert len(out) == len(frames) + 1 and decode_control(out[-1][0][-1][1])["final"]
    stacks = [n for f in frames for n, _ in f if parse_stacked(n)]
    assert stacks and not [n for f in frames for n, _ in f
                           if hf_names.parse(n) and hf_names.parse(n).expert is not None
                           and not parse_stacked(n)]  # every expert travels in a stack
    _same_as_packed(packed, sums)  # rows of the stacks == the per-expert tensors


@pytest.mark.parametrize("kind, fmt, options, want", [
    ("sglang", "int8", None, True),                                    # in place, stacks
    ("sglang", "bf16", None, False),                                   # tensor sync
    ("sglang", "int8", SGLangOptions(stack_experts=False), False),
    ("reference", "int8", None, False),
])
def test_the_driver_stacks_where_the_engine_takes_stacks(kind, fmt, options, want):
    assert takes_expert_stacks(EngineSpec(kind, {}, fmt, sglang=options)) is want


def test_a_cut_stream_is_one_pass_either_way():
    """Iterated tensor by tensor (an engine that does not bucket, the actor draining the
    rest) or bucket by bucket, from wherever the other way stopped."""
    def t(i):
        return str(i), torch.tensor([i])

    stream = CutStream(iter([[t(0), t(1)], [], [t(2)], [t(3), t(4)]]))
    assert next(stream)[0] == "0"
    assert [([n for n, _ in b], last) for b, last in wire_mod.buckets(stream, 1)] == [
        (["1"], False), (["2"], False), (["3", "4"], False), ([], True)]
    assert [n for n, _ in CutStream(iter([[t(0), t(1)], [t(2)]]))] == ["0", "1", "2"]
    assert list(wire_mod.buckets(CutStream(iter(())), 1)) == [([], True)]
