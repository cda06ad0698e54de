"""SGLangEngine's bucketing (CPU): request payloads, the empty last bucket, prefetching."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_qrl.rollout.base import Checksums, tensor_checksum
from megatron_qrl.rollout_sglang.engine import SGLangEngine, sync_options
from megatron_qrl.rollout_sglang.inplace import CONTROL, FLAT, RECV, StreamTracker, decode_control
from megatron_qrl.rollout_sglang.prefetch import ahead, timed


def _engine(bucket_bytes, flatten=False):
    eng = object.__new__(SGLangEngine)  # the bucketing needs no running SGLang
    eng.bucket_bytes, eng.flatten_buckets, eng.prefetch_buckets = bucket_bytes, flatten, 0
    eng.stack_experts = False
    return eng


def _stream(n=5, numel=16):
    return [(f"model.layers.{i}.mlp.down_proj.weight", torch.full((numel,), float(i)))
            for i in range(n)]


@pytest.mark.parametrize("flatten", [False, True])
def test_buckets_split_by_bytes_and_end_with_a_final_control(flatten):
    eng, sent = _engine(bucket_bytes=2 * 64, flatten=flatten), Checksums()
    stream = _stream()  # 5 tensors of 64 bytes: buckets of 2, 2, 1
    out = list(eng._buckets(iter(stream), sent, StreamTracker(("weight",)), torch.device("cpu")))
    assert [(first, last) for _, first, last in out] == [
        (stream[0][0], False), (stream[2][0], False), (stream[4][0], True)]
    for items, _, last in out:
        names = [n for n, _ in items]
        assert names[-1] == CONTROL and decode_control(items[-1][1])["final"] is last
        assert (names[:2] == [RECV, FLAT]) if flatten else (RECV not in names)
    assert sent.result() == {n: tensor_checksum(t) for n, t in stream}


def test_stream_ending_on_a_full_bucket_sends_an_empty_final_bucket():
    """Found on the H200: the final bucket was empty and naming it raised IndexError."""
    eng = _engine(bucket_bytes=2 * 64)
    out = list(eng._buckets(iter(_stream(4)), Checksums(), StreamTracker(("weight",)),
                            torch.device("cpu")))
    items, first, last = out[-1]
    assert len(out) == 3 and last and first == "end of sync"
    assert [n for n, _ in items] == [CONTROL] and decode_control(items[0][1])["final"]
    # a plain (not in-place) sync: the last request carries no tensors, only the version
    plain = list(eng._buckets(iter(_stream(4)), Checksums(), None, torch.device("cpu")))
    assert plain[-1] == ([], "end of sync", True)


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


def test_sync_options_defaults_per_sync_and_errors():
    # unset: in place, flat buckets + one bucket prefetched + direct loads of stacked experts
    # (each measured on the H200), none of them elsewhere
    assert sync_options("inplace") == (True, 1, True, True)
    for sync in ("tensor", "disk", "distributed"):
        assert sync_options(sync) == (False, 0, False, False)
    assert sync_options("inplace", False, 0, False) == (False, 0, False, False)  # all off
    assert sync_options("tensor", None, 2) == (False, 2, False, False)
    assert sync_options("inplace", None, 3, True) == (True, 3, True, True)
    assert sync_options("inplace", None, 3, True, False) == (True, 3, True, False)
    assert sync_options("inplace", None, None, False) == (True, 1, False, False)  # stack follows
    assert sync_options("inplace", stack_experts=True) == (True, 1, True, True)
    with pytest.raises(ValueError, match="stack_experts=True needs direct_expert_loads=True.*"
                       "--qrl-rollout-sglang-stack-experts needs "
                       "--qrl-rollout-sglang-direct-expert-loads"):
        sync_options("inplace", direct_expert_loads=False, stack_experts=True)
    with pytest.raises(ValueError, match="stack_experts applies to sync='inplace'"):
        sync_options("distributed", stack_experts=True)
    with pytest.raises(ValueError, match="flatten_buckets applies to sync='inplace'"):
        sync_options("tensor", True)
    with pytest.raises(ValueError, match="direct_expert_loads applies to sync='inplace'"):
        sync_options("disk", direct_expert_loads=True)
    with pytest.raises(ValueError, match="prefetch_buckets applies to sync='tensor' and "):
        sync_options("distributed", prefetch_buckets=1)
    with pytest.raises(ValueError, match="prefetch_buckets must be >= 0"):
        sync_options("inplace", prefetch_buckets=-1)


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
    from megatron_qrl.rollout_sglang.inplace import bucket_weights

    eng, sent = _engine(bucket_bytes=1 << 20, flatten=flatten), Checksums()
    w = torch.randn(4, 8).to(torch.float8_e4m3fn)
    stream = [("model.layers.0.mlp.down_proj.weight", w),
              ("model.layers.0.mlp.down_proj.weight_scale", torch.ones(4, 1))]
    (items, _, _), = eng._buckets(iter(stream), sent, StreamTracker(("weight", "weight_scale")),
                                  torch.device("cpu"))
    ctl = decode_control(items[-1][1])
    got = dict(bucket_weights(items, torch.device("cpu")))
    if flatten:  # the meta names the real dtype: no per-tensor re-view on the engine
        assert ctl["views"] == {} and got[stream[0][0]].dtype == torch.float8_e4m3fn
    else:
        assert ctl["views"] == {stream[0][0]: "float8_e4m3fn"}
        assert got[stream[0][0]].dtype == torch.uint8
    assert torch.equal(got[stream[0][0]].view(torch.uint8), w.view(torch.uint8))
