"""The transport contract (megatron_qrl.sync.transport.WeightTransport) for every Ray-side
transport that runs on CPU: the receiver holds exactly the stream that was sent, in buckets
cut by the one rule (no more, no fewer), and an error raised by the stream itself reaches
the caller as that error (a broken send becomes ``EngineDiedError``: tests/rl/test_rl_ray.py).

Side ``ray`` (objectstore, broadcast, ipc) with the reference engine in a real actor of a
local Ray cluster; side ``fleet`` (the fleet's frames and the EP-sharded segments) through a
loopback group: the sender's broadcasts are recorded and replayed into the receiving side
(:func:`~megatron_qrl.rollout.broadcast.receive_stream`, :func:`~megatron_qrl.rollout.
weight_groups.receive_sharded`), as an engine actor would receive them."""

from __future__ import annotations

import pytest
import torch

import megatron_qrl.rollout.broadcast as bc
import megatron_qrl.rollout.weight_groups as wg
from megatron_qrl.rl.ray_modes import RaySession
from megatron_qrl.rollout.base import WeightManifest
from megatron_qrl.rollout.ray_actor import EngineSpec
from megatron_qrl.rollout.transports.fleet import FleetFrames
from megatron_qrl.rollout.transports.sharded import SegmentTransport
from megatron_qrl.sync.protocol.wire import nbytes
from megatron_qrl.sync.transport import cut
from tests.rl.test_rl_ray import _packed
from tests.rollout.test_ipc import ray  # noqa: F401  (the module's local Ray cluster)

BUCKET = 4096


def _expected_buckets(stream, bucket_bytes=BUCKET) -> int:
    return sum(1 for b, _ in cut(stream, bucket_bytes) if b)


def _failing(stream, after: int):
    for i, item in enumerate(stream):
        if i == after:
            raise KeyError("the trainer's stream failed")
        yield item


@pytest.mark.usefixtures("ray")
@pytest.mark.parametrize("transport", ["objectstore", "broadcast", "ipc"])
def test_ray_transport_contract(transport):
    cfg, packed = _packed()
    with RaySession("colocated", weight_transport=transport) as session:
        engine = session.new_actor(EngineSpec("reference", cfg, "int8", seed=0, num_threads=1))
        assert engine.transport == transport and engine.sender.name == transport
        engine.bucket_bytes = BUCKET
        manifest = WeightManifest()
        engine.update_weights(manifest.record(iter(packed)), version=4)
        assert engine.weight_version() == 4
        engine.verify(manifest)  # the actor holds exactly what was sent
        assert engine.held_checksums().keys() == {n for n, _ in packed}
        assert engine.buckets_sent == _expected_buckets(packed)
        with pytest.raises(KeyError, match="trainer's stream failed"):
            engine.update_weights(_failing(iter(packed), 5), version=5)
        engine.shutdown()


def _loopback(monkeypatch, wire: list[torch.Tensor], send: bool) -> None:
    """Sending: every broadcast is recorded in ``wire``; receiving: replayed from it."""
    def record(t, group):
        wire.append(t.detach().clone())

    def replay(t, group):
        t.copy_(wire.pop(0))

    for mod in (bc, wg):
        monkeypatch.setattr(mod, "broadcast_from_trainer", record if send else replay)


def _as_bytes(stream):
    return [(n, str(t.dtype), t.contiguous().reshape(-1).view(torch.uint8).tolist())
            for n, t in stream]


def _frames(wire: list[torch.Tensor]) -> tuple[list[int], list[list[int]]]:
    """Payload bytes of every frame on the wire (header, metadata, payload per frame), and
    the end marks between them."""
    sizes, ends, i = [], [], 0
    while i < len(wire):
        n_meta, n_flat = wire[i].tolist()
        if n_meta:
            sizes.append(n_flat)
            i += 3
        else:
            ends.append([n_meta, n_flat])
            i += 1
    return sizes, ends


@pytest.mark.parametrize("frames", [FleetFrames, SegmentTransport])
def test_fleet_transport_contract(monkeypatch, frames):
    _, packed = _packed()
    if frames is SegmentTransport:  # a sender's stream: non-expert tensors first
        experts = [p for p in packed if wg.segment_key(p[0])]
        packed = [p for p in packed if not wg.segment_key(p[0])] + experts
    wire: list[torch.Tensor] = []
    _loopback(monkeypatch, wire, send=True)
    sent = frames(None, "cpu", BUCKET).send(iter(packed), version=1)
    sizes, ends = _frames(wire)
    assert sent == len(sizes) >= _expected_buckets(packed)
    big = max(nbytes(t) for _, t in packed)
    assert all(s <= max(BUCKET, big) for s in sizes)
    _loopback(monkeypatch, wire, send=False)
    got = (list(wg.receive_sharded([None], "cpu")) if frames is SegmentTransport
           else list(bc.receive_stream(None, "cpu")))
    assert not wire  # everything sent was read, nothing more
    assert _as_bytes(got) == _as_bytes(packed)
    if frames is SegmentTransport:  # cut per segment: no bucket spans two segments
        keys = [wg.segment_key(n) for n, _ in packed]
        segments = list(dict.fromkeys(keys))
        assert sent == sum(_expected_buckets([p for p, k in zip(packed, keys) if k == key])
                           for key in segments)
        assert ends == [[0, 0]] * len(segments) + [[0, 1]]  # each segment ends, then the stream
    else:
        assert sent == _expected_buckets(packed) and ends == [[0, 0]]
    _loopback(monkeypatch, wire, send=True)
    with pytest.raises(KeyError, match="trainer's stream failed"):
        frames(None, "cpu", BUCKET).send(_failing(iter(packed), 3), version=2)
