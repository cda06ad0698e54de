"""CPU tests of the direct sync written inside the engine (an engine started with its memory
saver, whose parameters CUDA IPC cannot hand out): the trainer's stream sent in ``write``
requests of the storage service (sync.transports.direct_pull), written by the direct writer in
the scheduler (sync.loader.storage_write). The reference is the trainer-side direct write
(tests/rollout_sglang/test_sglang_direct.py's engine stand-in and helpers), which itself
equals the in-place loader bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.rollout_sglang.options import SGLangOptions
from megatron_qrl.rollout_sglang.sync.loader import storage_write
from megatron_qrl.rollout_sglang.sync.loader.storage import handle
from megatron_qrl.rollout_sglang.sync.transports.direct_pull import requests_of
from megatron_qrl.sync.protocol.checksums import WeightSyncError
from megatron_qrl.sync.protocol.engine_layout import EngineLayoutError
from tests.rollout_sglang.test_sglang_direct import (
    _direct_engine,
    direct_sync,
    engine,
    hf_weights,
    packed,
    state,
)
from tests.rollout_sglang.test_sglang_engine_sync import fake_io_struct  # noqa: F401  (io_struct stub)


def pulled_engine(model, fmt="fp8", bucket_bytes=1 << 20):
    """The stand-in SGLangEngine of test_sglang_direct started with its memory saver (the
    default options)."""
    eng = _direct_engine(model, fmt, release_memory=True, bucket_bytes=bucket_bytes)
    assert eng.options.release_memory
    return eng


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block", "int8"])
def test_engine_side_write_leaves_the_bits_of_the_trainer_side_write(fmt):
    """Catches: a write request's tensors dropped or written twice, the regions of one
    request's writer lost for the next (a fused member half-written), the weight version not
    set by the last request."""
    ref, m = engine(fmt, seed=0), engine(fmt, seed=0)
    sent = direct_sync(ref, fmt, packed(fmt, 1))
    eng = pulled_engine(m, fmt, bucket_bytes=64 << 10)
    stream = list(get_spec(fmt).pack_state_dict(hf_weights(1), stack_experts=True))
    eng.update_weights(iter(stream), version=7)
    assert eng.weight_version() == 7 and eng.last_sync["verified"] == "digest"
    a, b = state(ref), state(m)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert eng.sent_checksums() == eng.held_checksums() == sent
    writes = eng.writes
    assert eng.requests == ["write"] * len(writes)  # the version rides the last write
    assert len(writes) == eng.last_sync["buckets"] > 2
    assert [w[:2] for w in writes] == [(True, False)] + [(False, False)] * (len(writes) - 2) + [
        (False, True)]
    assert sum(w[2] for w in writes) == len(stream)
    assert eng.last_sync["engine_writes"] is True
    assert eng.last_sync["copied"] == len(stream) and eng.last_sync["quantized"] == 0
    # the engine's own time, summed over the requests, inside the sync's write
    assert 0 < eng.last_sync["loader_s"] <= eng.last_sync["write_s"]


def test_the_engines_time_is_summed_over_the_requests(monkeypatch):
    """``loader_s``: every request's time in the engine's writer, from entry to answer, and
    its split by phase (``loader_<phase>_s``, storage_write.PHASES), summed over the requests
    (a clock that ticks once per reading: a request's phases tick once each — ``describe``
    on the first request only, ``finish`` / ``sent`` / ``digest`` on the last). Catches: the
    last request's time alone, a sync's time carried into the next, a phase left out of the
    split."""
    import types

    ticks = iter(range(10**6))
    monkeypatch.setattr(storage_write, "time",
                        types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    eng = pulled_engine(engine("fp8"), "fp8", bucket_bytes=64 << 10)
    for version in (1, 2):
        eng.update_weights(iter(packed("fp8", version)), version=version)
        n = eng.last_sync["buckets"]
        assert n > 2
        parts = {p: eng.last_sync[f"loader_{p}_s"] for p in storage_write.PHASES}
        assert parts == {"describe": 1, "held": n, "writes": n, "finish": 1, "sent": 1,
                         "digest": 1}
        assert eng.last_sync["loader_s"] == sum(parts.values()) == 2 * n + 4


def test_quantized_weights_reach_the_engine_in_high_precision_and_regions_are_kept():
    """The stream a writer takes (weights the format quantizes still in BF16) is quantized
    in the engine, and the second sync reuses the regions the first looked up (the storage
    fingerprint unchanged). Catches: the engine-side storage described anew each sync."""
    m = engine("fp8")
    eng = pulled_engine(m, "fp8", bucket_bytes=1 << 30)
    stream = [(n, t) for n, t in hf_weights(2)]
    eng.update_weights(iter(stream), version=1)
    opened = storage_write._OPEN[id(m)]
    regions = dict(opened.places.regions)
    assert regions and eng.last_sync["quantized"] > 0 and eng.last_sync["buckets"] == 1
    eng.update_weights(iter([(n, t) for n, t in hf_weights(3)]), version=2)
    assert storage_write._OPEN[id(m)] is opened
    assert all(opened.places.regions[k] is r for k, r in regions.items())
    ref = engine("fp8")
    direct_sync(ref, "fp8", hf_weights(3))
    a, b = state(ref), state(m)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_digest_that_differs_fails_the_sync_naming_the_layer(monkeypatch):
    real = storage_write.read_digest

    def lost_write(layout, tensors, names):
        out = real(layout, tensors, names)
        name = "model.layers.1.self_attn.k_proj.weight"
        out[name] = out[name][:-1] + ("0" if out[name][-1] != "0" else "1")
        return out

    monkeypatch.setattr(storage_write, "read_digest", lost_write)
    eng = pulled_engine(engine("fp8"), "fp8")
    with pytest.raises(WeightSyncError, match=r"k_proj\.weight' \(layer 1\)"):
        eng.update_weights(iter(packed("fp8", 4)), version=1)


def test_a_failed_write_ends_the_sync_and_the_next_starts_over():
    """A stream missing a tensor fails at its last request (the parameter named) and leaves
    the engine's weight version at its last complete sync; a request that does not start a
    sync after it is refused; a full sync then succeeds. Catches: the failed last write's
    version left in SGLang's record (SGLang applies a request's version though the loader
    answered a failure: the last complete sync's is sent back), a writer kept after a failure
    (its regions marked written: the next sync would raise "sent twice" or pass with stale
    rows)."""
    m = engine("fp8")
    eng = pulled_engine(m, "fp8")
    eng.update_weights(iter(packed("fp8", 4)), version=1)
    stream = [(n, t) for n, t in packed("fp8", 5) if "layers.0.self_attn.q_proj" not in n]
    with pytest.raises(WeightSyncError, match=r"layers\.0\.self_attn\.qkv_proj\.weight got"):
        eng.update_weights(iter(stream), version=2)
    # the engine keeps the version of its last complete sync (SGLang takes a request's
    # version even where the loader answered a failure: the last one's is put back)
    assert eng.engine.get_server_info()["weight_version"] == "1"
    with pytest.raises(WeightSyncError, match="does not start a sync"):
        handle(m, {"what": "write", "format": "fp8", "first": False, "last": True}, [])
    # a failure in a request before the last ends the sync too
    bad = [("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 3, dtype=torch.uint8))]
    with pytest.raises(EngineLayoutError):
        handle(m, {"what": "write", "format": "fp8", "first": True, "last": False}, bad)
    with pytest.raises(WeightSyncError, match="does not start a sync"):
        handle(m, {"what": "write", "format": "fp8", "first": False, "last": True}, [])
    eng.update_weights(iter(packed("fp8", 5)), version=3)
    assert eng.weight_version() == 3


def test_requests_hold_at_most_bucket_bytes_of_what_the_trainer_made():
    """Views into a larger storage (parameters in Megatron's buffer) count nothing; tensors
    that fill their own storage cut the requests; an empty stream is one empty last
    request."""
    param = torch.zeros(4, 256)  # 4 KiB
    views = [(f"v{i}", param[i]) for i in range(4)]
    fresh = [(f"f{i}", torch.zeros(256)) for i in range(4)]  # 1 KiB each
    got = [([n for n, _ in items], last) for items, last in
           requests_of(views + fresh, 2048, torch.device("cpu"))]
    assert got == [(["v0", "v1", "v2", "v3", "f0", "f1"], False), (["f2", "f3"], True)]
    assert list(requests_of([], 1, torch.device("cpu"))) == [([], True)]


def test_requests_cut_by_the_memory_made_for_the_sync():
    """With the allocator's count (CUDA), the trainer's parameters cost no request however
    they are allocated (the local spec's are one allocation each) and the temporaries made
    for the sync cut the requests once dropped by the caller; here the count is the live
    temporaries' bytes. Catches: the storage rule used where the count is given (the four
    parameters would cut two requests of their own), the count restarted at each request
    (the tensor the stream already made for the next request would go uncounted)."""
    import weakref

    live = [0]

    def made(n: int) -> torch.Tensor:  # a temporary of the sync: counted while alive
        t = torch.zeros(256)  # 1 KiB
        live[0] += 1024
        weakref.finalize(t.untyped_storage(), lambda: live.__setitem__(0, live[0] - 1024))
        return t

    params = [(f"p{i}", torch.zeros(256)) for i in range(4)]  # one allocation each

    def stream():
        yield from params
        for i in range(5):
            yield f"f{i}", made(i)

    got = []
    for items, last in requests_of(stream(), 2048, torch.device("cpu"), lambda: live[0]):
        got.append(([n for n, _ in items], last))
        del items
    assert got == [(["p0", "p1", "p2", "p3", "f0", "f1"], False), (["f2", "f3"], False),
                   (["f4"], True)]
    assert live[0] == 0


def test_the_run_log_says_which_end_writes():
    """The run's log line for the sync path (rl.run_control.describe_run)."""
    saver = SGLangOptions(sync="direct").resolve("fp8").describe_sync()
    resident = SGLangOptions(sync="direct", release_memory=False).resolve("fp8").describe_sync()
    assert saver.startswith("SGLang weight sync: direct (quantized straight into the engine's "
                            "tensors by the engine, from the trainer's CUDA IPC handles")
    assert saver.endswith("memory saver on)") and resident.endswith("engine resident)")
    assert "the trainer's tensors held across syncs" in saver
    assert "by the trainer, through their CUDA IPC handles" in resident
    assert SGLangOptions().resolve("fp8").describe_sync().startswith(
        "SGLang weight sync: inplace (packed buckets re-processed")


def test_w4a16_marlin_regions_written_by_the_engine_over_garbage():
    """After a resume the saver's pages hold anything: from an engine whose every synced
    tensor is garbage, one engine-side sync of weights B in BF16 (the writer's stream, experts
    stacked) leaves every parameter bit-equal to an engine loaded from B's packed checkpoint,
    through SGLang's Marlin layout (tests/rollout_sglang/test_sglang_direct_w4a16.py's stand-
    in). Catches: a region one request's writer reaches and the engine-side write misses."""
    from megatron_qrl.quant.pack_stream import writer_stream
    from tests.rollout_sglang import test_sglang_direct_w4a16 as w4

    want, got = w4.engine(seed=1), w4._garbage(w4.engine(seed=0))
    eng = pulled_engine(got, "w4a16", bucket_bytes=32 << 10)
    eng.update_weights(writer_stream(w4.SPEC, hf_weights(1), stack_experts=True), version=1)
    a, b = state(want), state(got)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    assert eng.last_sync["quantized"] > 0 and eng.last_sync["buckets"] > 1


def test_write_requests_travel_with_their_tensors_through_serve(tmp_path):
    """The scheduler side (``serve``: the control tensor, then the trainer's tensors; the
    answer file) and the trainer side (``storage_request`` with ``tensors``) of a sync in two
    write requests; a failed write is answered as an error, which the trainer raises.
    Catches: ``serve`` dropping the tensors that follow the control message, or taking the
    control tensor for a weight."""
    from megatron_qrl.rollout_sglang.sync.loader.storage import serve
    from megatron_qrl.rollout_sglang.sync.storage_client import storage_request

    m, ref = engine("fp8"), engine("fp8")
    direct_sync(ref, "fp8", packed("fp8", 6))

    def request(method, req, first):
        serve(m, req.serialized_named_tensors)
        return True, "ok"

    out, stream = str(tmp_path / "storage"), packed("fp8", 6)
    half = len(stream) // 2
    for i, items in enumerate((stream[:half], stream[half:])):
        got = storage_request(request, list, torch.device("cpu"), out,
                              {"what": "write", "format": "fp8", "first": i == 0,
                               "last": i == 1}, tensors=items)
    assert got["sent"] == got["digest"] and len(got["sent"]) == len(stream)
    a, b = state(ref), state(m)
    assert all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(WeightSyncError, match=r"failed 'write' \(WeightSyncError: .*got 0 of"):
        storage_request(request, list, torch.device("cpu"), out,
                        {"what": "write", "format": "fp8", "first": True, "last": True},
                        tensors=stream[:1])


@pytest.mark.parametrize("reshares", [False, True])
def test_a_ray_actor_hands_a_resharing_engine_copies_of_what_it_received(monkeypatch,
                                                                        reshares):
    """A Ray actor that received the stream over the ipc transport (tensors opened from the
    trainer's CUDA IPC handles, which PyTorch will not share on) hands an engine that shares
    the stream on (the engine-side direct write) copies of its own, the same values; other
    engines get the received tensors themselves. Catches: the actor passing received tensors
    to the engine-side write (on the GPU: "Attempted to send CUDA tensor received from
    another process")."""
    from megatron_qrl.rollout import ray_actor
    from megatron_qrl.rollout.ray_actor import EngineActor

    received = [("a.weight", torch.arange(6.0).view(2, 3)), ("b.weight", torch.ones(4))]
    monkeypatch.setattr(ray_actor, "receive_ipc_stream", lambda group: iter(received))
    got = []

    class Engine:
        reshares_stream = reshares

        def update_weights(self, stream, version):
            got.extend(stream)

    actor = EngineActor(None, lambda spec: Engine())
    actor.weight_group = object()
    actor.update_weights_ipc(version=1)
    assert [n for n, _ in got] == ["a.weight", "b.weight"]
    for (_, want), (_, t) in zip(received, got):
        assert torch.equal(t, want)
        same = t.untyped_storage().data_ptr() == want.untyped_storage().data_ptr()
        assert same is not reshares
    # the SGLang engine says so exactly where it writes on the engine's side
    m = engine("fp8")
    assert pulled_engine(m).reshares_stream and not _direct_engine(m).reshares_stream


# ---- the trainer's parameters held by the engine across syncs -----------------------------
def _updated(params, step):
    """The trainer's optimizer step: every parameter changed in place (its storage kept)."""
    g = torch.Generator().manual_seed(100 + step)
    for _, t in params:
        t.add_((0.01 * torch.randn(t.shape, generator=g)).to(t.dtype))


def _as_trainer_side(m, stream):
    """Engine model ``m`` holds the bits the trainer-side write of ``stream`` leaves."""
    ref = engine("fp8")
    direct_sync(ref, "fp8", [(n, t.clone()) for n, t in stream])
    a, b = state(ref), state(m)
    return all(torch.equal(a[n], b[n]) for n in a)


def _holding(bucket_bytes=1 << 30):
    """An engine model, its engine-side-writing engine and the trainer's parameters, after
    the two syncs that make the engine hold them."""
    m = engine("fp8")
    eng = pulled_engine(m, "fp8", bucket_bytes=bucket_bytes)
    params = hf_weights(2)
    for version in (1, 2):
        eng.update_weights(iter(params), version=version)
    return m, eng, params


def test_parameters_are_held_by_the_engine_and_sent_by_name():
    """The trainer's parameters (the same storages every sync, changed in place between
    them): the first sync sends every handle, the second asks the engine to hold them, from
    the third on only their names go; every sync leaves the bits of a trainer-side write of
    the current weights. Catches: a held tensor read stale (the engine copying instead of
    holding the trainer's own), a name sent for a tensor the engine does not hold, a
    temporary (a new storage each sync) ever held."""
    m = engine("fp8")
    eng = pulled_engine(m, "fp8", bucket_bytes=1 << 30)
    params = hf_weights(2)
    temp = params[-1][0]  # this one is made anew for every sync (a stacked or split copy)
    sent = []
    for version in range(1, 5):
        stream = params[:-1] + [(temp, params[-1][1].clone())]
        eng.writes.clear()
        eng.update_weights(iter(stream), version=version)
        assert _as_trainer_side(m, stream), version
        sent.append((sum(w[2] for w in eng.writes), eng.last_sync["held_refs"]))
        _updated(params[:-1], version)
    n = len(params)
    assert sent == [(n, 0), (n, 0), (1, n - 1), (1, n - 1)]
    held = storage_write._HELD[id(m)].tensors
    assert temp not in held and len(held) == n - 1
    assert all(held[k].data_ptr() == t.data_ptr() for k, t in params[:-1])  # not copies


def test_a_replaced_parameter_is_sent_again_and_the_old_one_let_go():
    """A parameter given a new storage (a reload, ``param.data = ...``) is sent with its
    handle; the engine drops what it held under that name and holds the new one from the
    sync after. Catches: the storage compared by name or shape only (the engine would keep
    writing the old tensor)."""
    m, eng, params = _holding()
    name, old = params[0]
    params[0] = (name, old.clone().add_(0.5))  # same name and shape, a new storage
    eng.writes.clear()
    eng.update_weights(iter(params), version=3)
    assert sum(w[2] for w in eng.writes) == 1 and eng.last_sync["held_refs"] == len(params) - 1
    assert name not in storage_write._HELD[id(m)].tensors and _as_trainer_side(m, params)
    eng.update_weights(iter(params), version=4)
    assert storage_write._HELD[id(m)].tensors[name].data_ptr() == params[0][1].data_ptr()


def test_an_engine_that_lost_what_it_held_gets_the_request_again_with_every_handle(caplog):
    """An engine that no longer holds a tensor the trainer names answers so before writing
    anything of the request (HeldTensorError across the storage service); the trainer sends
    the same request again with every handle, the sync succeeds with the current weights,
    and the engine gets every handle from then on, said once in the log. Catches: the
    request's writes started before the check (the writer would be reset: the sync fails),
    holding resumed after a failure (the same answer every third sync)."""
    m, eng, params = _holding(bucket_bytes=64 << 10)  # several requests
    del storage_write._HELD[id(m)].tensors[params[-1][0]]  # named in the last one
    _updated(params, 0)
    with caplog.at_level("WARNING"):
        eng.update_weights(iter(params), version=3)
    assert len(eng.writes) > 2
    assert eng.weight_version() == 3 and _as_trainer_side(m, params)
    assert eng.last_sync["held_refs"] > 0  # the requests before it went by name
    assert sum("the engine holds no tensor for" in r.getMessage() for r in caplog.records) == 1
    for version in (4, 5, 6):
        eng.writes.clear()
        eng.update_weights(iter(params), version=version)
        assert sum(w[2] for w in eng.writes) == len(params) and eng.last_sync["held_refs"] == 0


def test_holding_can_be_turned_off():
    m = engine("fp8")
    eng = pulled_engine(m, "fp8", bucket_bytes=1 << 30)
    eng.options = dataclasses.replace(eng.options, hold_trainer_tensors=False)
    params = hf_weights(2)
    for version in (1, 2, 3):
        eng.writes.clear()
        eng.update_weights(iter(params), version=version)
        assert sum(w[2] for w in eng.writes) == len(params)
        assert eng.last_sync["held_refs"] == 0


def test_a_held_copy_that_no_longer_reads_the_trainers_memory_is_not_written():
    """What the engine holds must be the trainer's memory itself: a copy (as an engine that
    copied what it received would hold) reads old values after the trainer's update, and the
    engine-side digest, which compares the engine's writes with its own read-back, would not
    see it; the trainer's fingerprints of the named tensors do, before anything is written,
    and the request goes again with every handle. Catches: the named tensors written without
    that check (the engine would serve stale weights)."""
    m, eng, params = _holding()
    held = storage_write._HELD[id(m)].tensors
    name = params[0][0]
    held[name] = held[name].clone()  # a copy of the value the engine received
    _updated(params, 0)
    eng.update_weights(iter(params), version=3)
    assert eng.weight_version() == 3 and _as_trainer_side(m, params)
    assert eng.last_sync["held_refs"] == 0 and not storage_write._HELD[id(m)].tensors


def test_the_allocator_is_read_per_share_of_a_request_not_per_tensor():
    """``in_use`` (the CUDA allocator's statistics, ~0.1 ms a reading) is read once per
    ``held_bytes / CHECKS_PER_REQUEST`` bytes of streamed tensors: 64 parameters of 1 KiB
    with 64 KiB per request -> 1 + 16 readings, not 65. Mutation caught: a reading per
    tensor."""
    from megatron_qrl.rollout_sglang.sync.transports import direct_pull

    reads = [0]

    def in_use():
        reads[0] += 1
        return 0

    params = [(f"p{i}", torch.zeros(256)) for i in range(64)]
    got = list(requests_of(params, 64 << 10, torch.device("cpu"), in_use))
    assert len(got) == 1 and len(got[0][0]) == 64
    assert reads[0] == 1 + 64 * 1024 // ((64 << 10) // direct_pull.CHECKS_PER_REQUEST)


def test_the_engine_says_whether_it_holds_the_streams_tensors():
    """``holds_stream_tensors`` (the driver then streams the query / key / value from persistent
    buffers): the engine-side write with holding on only. Mutation caught: true for the
    trainer-side write or with holding off."""
    eng = pulled_engine(engine("fp8"), "fp8")
    assert eng.holds_stream_tensors
    eng.options = SGLangOptions(sync="direct", hold_trainer_tensors=False).resolve("fp8")
    assert not eng.holds_stream_tensors
    from tests.rollout_sglang.test_sglang_direct import _direct_engine

    assert not _direct_engine(engine("fp8"), "fp8", release_memory=False).holds_stream_tensors
