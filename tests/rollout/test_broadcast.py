"""Weights over a process group (megatron_qrl.rollout.broadcast), 2 gloo processes.

A framed stream of fp32 / bf16 / float8_e4m3fn / uint8 / int8 tensors and one tensor larger
than a bucket crosses the group bit for bit (compared as uint8 bytes) in the closed-form
number of buckets; ``flatten`` lays a bucket out as SGLang's ``FlattenedTensorBucket`` does
(each tensor's bytes in order); bad sizes / ranks / group names are errors naming them. The
Ray engine actor's receiving side (``EngineActor.update_weights_broadcast``, run here without
Ray): an engine that fails half-way through the stream still lets the sender finish (the
actor reads the rest) and the next stream arrives intact — with the sender in a torchrun
rank (``TORCHELASTIC_USE_AGENT_STORE``), where rank 0 must host the group's store itself.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_qrl.rollout.broadcast import find_group, init_group, receive_stream, send_stream
from megatron_qrl.rollout.ray_actor import EngineActor
from megatron_qrl.rollout.wire import flatten, iter_buckets, unflatten
from tests.helpers.mp_utils import run_distributed

GROUP = "qrl-test-weights"
BUCKET = 1024


def _stream() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.fp32", torch.randn(3, 5, generator=g)),                                # 60 B
        ("b.bf16", torch.randn(7, generator=g).bfloat16()),                        # 14 B
        ("c.fp8", (torch.randn(4, 4, generator=g) * 8).to(torch.float8_e4m3fn)),   # 16 B
        ("d.u8", torch.randint(0, 256, (10,), generator=g).to(torch.uint8)),       # 10 B
        ("e.i8", torch.randint(-128, 128, (2, 3), generator=g).to(torch.int8)),    # 6 B
        ("f.big", torch.randn(600, generator=g)),                                  # 2400 B > BUCKET
        ("g.tail", torch.randn(8, generator=g)),                                   # 32 B
    ]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8).clone()


def _rank(rank, world_size, port):
    pg = init_group("127.0.0.1", port, world_size, rank, GROUP, "gloo", timeout_s=30)
    try:
        assert find_group(GROUP) is pg
        with pytest.raises(KeyError, match=GROUP):  # the message lists the known groups
            find_group("no-such-group")
        if rank == 0:
            return {"buckets": send_stream(iter(_stream()), pg, "cpu", BUCKET)}
        return {"got": [(n, str(t.dtype), list(t.shape), _bytes(t))
                        for n, t in receive_stream(pg, "cpu")]}
    finally:
        dist.destroy_process_group(pg)  # works without a default process group
        with pytest.raises(KeyError):
            find_group(GROUP)


def test_stream_round_trip_over_gloo():
    sender, receiver = run_distributed(_rank, 2, timeout_s=60)
    # [a..e] = 106 B; f alone (2400 B > 1024); g does not fit after f
    assert sender["buckets"] == 3
    assert [len(b) for b in iter_buckets(_stream(), BUCKET)] == [5, 1, 1]
    expected = _stream()
    assert [(n, d, s) for n, d, s, _ in receiver["got"]] == [
        (n, str(t.dtype), list(t.shape)) for n, t in expected]
    for (name, _, _, got), (_, t) in zip(receiver["got"], expected):
        assert torch.equal(got, _bytes(t)), name


class _EngineFailingAt:
    """Reads the stream up to tensor ``fail_at`` (then raises), or whole; keeps the bytes."""

    def __init__(self, fail_at: int | None):
        self.fail_at, self.got = fail_at, []

    def update_weights(self, stream, version):
        for i, (name, t) in enumerate(stream):
            if i == self.fail_at:
                raise RuntimeError(f"engine gave up at {name}")
            self.got.append((name, _bytes(t)))


def _actor_rank(rank, world_size, port):
    if rank == 0:
        pg = init_group("127.0.0.1", port, world_size, 0, GROUP, "gloo", timeout_s=10)
        # both sends complete: a receiver that stopped reading would time them out
        return [send_stream(iter(_stream()), pg, "cpu", BUCKET) for _ in range(2)]
    actor = EngineActor.__new__(EngineActor)  # the actor body without building an engine
    actor.calls, actor.engine = [], _EngineFailingAt(1)
    actor.join_weight_group("127.0.0.1", port, world_size, 1, GROUP, "gloo", timeout_s=10)
    with pytest.raises(RuntimeError, match="gave up at b.bf16"):
        actor.update_weights_broadcast(1)
    actor.engine = _EngineFailingAt(None)
    actor.update_weights_broadcast(2)
    return {"got": actor.engine.got, "calls": actor.calls}


def test_actor_reads_the_rest_of_a_stream_its_engine_gave_up_on(monkeypatch):
    # as in a torchrun rank: c10d.rendezvous would make rank 0 a client of the agent's store
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    sent, received = run_distributed(_actor_rank, 2, timeout_s=60)
    assert sent == [3, 3] and received["calls"] == ["update_weights"] * 2
    assert [n for n, _ in received["got"]] == [n for n, _ in _stream()]
    for (name, got), (_, t) in zip(received["got"], _stream()):
        assert torch.equal(got, _bytes(t)), name


def test_flatten_is_sglang_flattened_bucket_layout():
    named = _stream()[:5]
    flat, meta = flatten(named)
    assert flat.dtype == torch.uint8
    assert torch.equal(flat, torch.cat([_bytes(t) for _, t in named]))
    assert meta == [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in named]
    back = unflatten(flat, meta)
    for (n, t), (m, u) in zip(named, back):
        assert n == m and u.dtype == t.dtype and torch.equal(_bytes(u), _bytes(t))
    with pytest.raises(ValueError, match="empty"):
        flatten([])


def test_unflatten_views_the_buffer_at_any_offset():
    named = [("s", torch.tensor(2.5)), ("e", torch.zeros(0, 3)), ("w", torch.arange(6.).view(2, 3)),
             ("q", torch.arange(4, dtype=torch.uint8)), ("h", torch.ones(2, dtype=torch.bfloat16))]
    flat, meta = flatten(named)
    big = torch.cat([torch.zeros(8, dtype=torch.uint8), flat])  # storage offset 8 below
    back = unflatten(big[8:], meta)
    for (n, t), (m, u) in zip(named, back):
        assert n == m and u.dtype == t.dtype and u.shape == t.shape and u.is_contiguous()
        assert torch.equal(u, t)
    back[2][1].fill_(7.0)  # the tensors are the buffer's bytes, not copies
    assert torch.equal(unflatten(big[8:], meta)[2][1], torch.full((2, 3), 7.0))
    # an fp32 tensor at an odd byte offset cannot be viewed in place: torch's error, not junk
    odd, odd_meta = flatten([("b", torch.zeros(3, dtype=torch.uint8)), ("f", torch.ones(1))])
    with pytest.raises(RuntimeError):
        unflatten(odd, odd_meta)


def test_unflatten_wrong_size_names_both_sizes():
    flat, meta = flatten([("x", torch.zeros(4))])
    with pytest.raises(ValueError, match="covers 16 bytes, the buffer holds 17"):
        unflatten(torch.cat([flat, torch.zeros(1, dtype=torch.uint8)]), meta)


def test_init_group_bad_rank_and_bucket_size():
    with pytest.raises(ValueError, match="rank 2 of world_size 2"):
        init_group("127.0.0.1", 1, 2, 2, "bad")
    with pytest.raises(ValueError, match="world_size 1"):
        init_group("127.0.0.1", 1, 1, 0, "bad")
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets([("x", torch.zeros(1))], 0))


def test_weight_backend_never_puts_two_nccl_ranks_on_one_gpu(monkeypatch):
    """NCCL for an SGLang actor on its own GPU; a colocated actor shares the driver's GPU,
    where NCCL cannot hold both ranks, so gloo; the reference engine always gloo."""
    from megatron_qrl.rollout.ray_actor import weight_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert weight_backend("sglang") == "nccl"
    assert weight_backend("sglang", colocated=True) == "gloo"
    assert weight_backend("reference") == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert weight_backend("sglang") == "gloo"
