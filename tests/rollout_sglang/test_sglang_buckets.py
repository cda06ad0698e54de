"""The SGLang sender's bucketing (CPU): request payloads, the last bucket, prefetching, and the
options' sync-path rules (SGLangOptions.resolve)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from megatron_qrl.rollout.base import Checksums, tensor_checksum
from megatron_qrl.rollout_sglang.options import SGLangOptions
from megatron_qrl.rollout_sglang.sync.prefetch import ahead, timed
from megatron_qrl.rollout_sglang.sync.protocol import CONTROL, FLAT, RECV, decode_control
from megatron_qrl.rollout_sglang.sync.sender import StreamTracker, requests


def _requests(stream, sent, tracker, bucket_bytes, flatten=False):
    return list(requests(iter(stream), sent, tracker, torch.device("cpu"),
                         bucket_bytes=bucket_bytes, flat=flatten))


def _stream(n=5, numel=16):
    return [(f"model.layers.{i}.mlp.down_proj.weight", torch.full((numel,), float(i)))
            for i in range(n)]


@pytest.mark.parametrize("flatten", [False, True])
def test_buckets_split_by_bytes_and_end_with_a_final_control(flatten):
    sent = Checksums()
    stream = _stream()  # 5 tensors of 64 bytes: buckets of 2, 2, 1
    out = _requests(stream, sent, StreamTracker(("weight",)), 2 * 64, flatten)
    assert [(first, last) for _, first, last in out] == [
        (stream[0][0], False), (stream[2][0], False), (stream[4][0], True)]
    for items, _, last in out:
        names = [n for n, _ in items]
        assert names[-1] == CONTROL and decode_control(items[-1][1])["final"] is last
        assert (names[:2] == [RECV, FLAT]) if flatten else (RECV not in names)
    assert sent.result() == {n: tensor_checksum(t) for n, t in stream}


def test_a_stream_ending_on_a_full_bucket_marks_that_bucket_last():
    """One bucketing rule (megatron_qrl.rollout.wire.buckets): cut before the tensor that would
    overflow, the last bucket marked without reading ahead, so a stream that fills its last
    bucket exactly sends no extra request (found on the H200 with the old rule: an empty final
    bucket, and naming it raised IndexError)."""
    out = _requests(_stream(4), Checksums(), StreamTracker(("weight",)), 2 * 64)
    assert [(len(items), last) for items, _, last in out] == [(3, False), (3, True)]
    assert decode_control(out[-1][0][-1][1])["final"]
    # an empty stream still sends one request: it carries the version (in place: the control)
    items, first, last = _requests([], Checksums(), StreamTracker(("weight",)), 2 * 64)[-1]
    assert last and first == "end of sync" and [n for n, _ in items] == [CONTROL]
    assert _requests([], Checksums(), None, 2 * 64) == [([], "end of sync", True)]
    # a tensor larger than a bucket is its own bucket
    big = [("a.weight", torch.zeros(64)), ("b.weight", torch.zeros(4))]
    assert [[n for n, _ in items] for items, _, _ in _requests(big, Checksums(), None, 64)] == [
        ["a.weight"], ["b.weight"]]


def test_ahead_prefetches_in_order_in_another_thread():
    produced, threads = [], set()

    def gen():
        for i in range(6):
            threads.add(threading.current_thread().name)
            produced.append(i)
            yield i

    seen = []
    for x in ahead(gen(), depth=2):
        time.sleep(0.05)  # a slow consumer: the producer runs ahead, bounded by depth
        seen.append((x, len(produced)))
    assert [x for x, _ in seen] == list(range(6))
    # consuming x: the queue holds 2 more and the producer a third, waiting to put it
    assert seen[0][1] >= 2 and all(n - x <= 4 for x, n in seen)
    assert threads == {"qrl-bucket-prefetch"}
    assert list(ahead(iter(range(3)), depth=0)) == [0, 1, 2]


def test_ahead_raises_producer_errors_and_stops_when_the_consumer_does():
    def failing():
        yield 1
        raise ValueError("packing failed at tensor 2")

    got = []
    with pytest.raises(ValueError, match="tensor 2"):
        for x in ahead(failing(), depth=1):
            got.append(x)
    assert got == [1]
    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    it = ahead(endless(), depth=1)
    assert next(it) == 0
    it.close()  # the engine rejected a bucket: the producer must stop, not run on
    n = len(produced)
    time.sleep(0.3)
    assert len(produced) == n <= 4


def _resolved(fmt="int8", **kw):
    o = SGLangOptions(**kw).resolve(fmt)
    return o.flat_buckets, o.prefetch_buckets, o.direct_expert_loads, o.stack_experts


def test_options_resolve_defaults_per_sync_and_errors():
    # unset: in place, flat buckets + one bucket prefetched + direct loads of stacked experts
    # (each measured on the H200), none of them elsewhere
    assert _resolved(sync="inplace") == (True, 1, True, True)
    assert SGLangOptions().resolve("int8").sync == "inplace"  # auto: the format's default
    assert SGLangOptions().resolve("bf16").sync == "tensor"
    for fmt, sync in (("bf16", "tensor"), ("bf16", "disk"), ("int8", "distributed")):
        assert _resolved(fmt, sync=sync) == (False, 0, False, False)
    assert _resolved(sync="inplace", flat_buckets=False, prefetch_buckets=0,
                     direct_expert_loads=False) == (False, 0, False, False)  # all off
    assert _resolved("bf16", sync="tensor", prefetch_buckets=2) == (False, 2, False, False)
    assert _resolved(prefetch_buckets=3, direct_expert_loads=True) == (True, 3, True, True)
    assert _resolved(prefetch_buckets=3, direct_expert_loads=True,
                     stack_experts=False) == (True, 3, True, False)
    assert _resolved(direct_expert_loads=False) == (True, 1, False, False)  # stack follows
    assert _resolved(stack_experts=True) == (True, 1, True, True)
    with pytest.raises(ValueError, match="--qrl-rollout-sglang-stack-experts needs direct "
                       "expert loads.*drop --no-qrl-rollout-sglang-direct-expert-loads"):
        SGLangOptions(direct_expert_loads=False, stack_experts=True).resolve("int8")
    for field, flag in (("stack_experts", "stack-experts"), ("flat_buckets", "flat-buckets"),
                        ("direct_expert_loads", "direct-expert-loads")):
        with pytest.raises(ValueError, match=f"--qrl-rollout-sglang-{flag} apply to the "
                           "in-place sync.*syncs with distributed"):
            SGLangOptions(sync="distributed", **{field: True}).resolve("int8")
    with pytest.raises(ValueError, match=r"flat-buckets apply to the in-place sync.*syncs with "
                       r"auto \(tensor for bf16\)"):
        SGLangOptions(flat_buckets=True).resolve("bf16")
    with pytest.raises(ValueError, match="prefetch-buckets applies to the tensor and in-place "
                       "syncs, not --qrl-rollout-sglang-sync distributed"):
        SGLangOptions(sync="distributed", prefetch_buckets=1).resolve("int8")
    with pytest.raises(ValueError, match="prefetch-buckets must be an integer >= 0"):
        SGLangOptions(prefetch_buckets=-1)
    with pytest.raises(NotImplementedError, match="cannot update 'int8' weights in place"):
        SGLangOptions(sync="tensor").resolve("int8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        SGLangOptions().sync = "disk"  # one frozen object from the flags to the engine


def test_timed_adds_the_time_spent_getting_each_item():
    def slow():
        for i in range(3):
            time.sleep(0.02)
            yield i

    lap = {"wait_s": 1.0}
    assert list(timed(slow(), lap, "wait_s")) == [0, 1, 2]
    assert 1.05 <= lap["wait_s"] < 1.5  # adds to what was there: 3 x 0.02 s
    fresh: dict = {}
    assert list(timed([], fresh, "x")) == [] and fresh["x"] >= 0.0


@pytest.mark.parametrize("flatten", [False, True])
def test_float8_travels_as_uint8_unless_flattened(flatten):
    from megatron_qrl.rollout_sglang.sync.loader.packed import bucket_weights

    sent = Checksums()
    w = torch.randn(4, 8).to(torch.float8_e4m3fn)
    stream = [("model.layers.0.mlp.down_proj.weight", w),
              ("model.layers.0.mlp.down_proj.weight_scale", torch.ones(4, 1))]
    (items, _, _), = _requests(stream, sent, StreamTracker(("weight", "weight_scale")), 1 << 20,
                               flatten)
    ctl = decode_control(items[-1][1])
    got = dict(bucket_weights(items, torch.device("cpu")))
    if flatten:  # the meta names the real dtype: no per-tensor re-view on the engine
        assert ctl["views"] == {} and got[stream[0][0]].dtype == torch.float8_e4m3fn
    else:
        assert ctl["views"] == {stream[0][0]: "float8_e4m3fn"}
        assert got[stream[0][0]].dtype == torch.uint8
    assert torch.equal(got[stream[0][0]].view(torch.uint8), w.view(torch.uint8))
