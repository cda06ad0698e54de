"""Weight sync: AQN only on the engine copy, verification names a corrupted tensor."""

import pytest
import torch

from megatron_qrl.data import CharTokenizer, tiny_moe_config
from megatron_qrl.quant import get_spec
from megatron_qrl.quant.aqn import AQNConfig
from megatron_qrl.quant.hf_reference import hf_tensors
from megatron_qrl.rl.sync import sync_weights
from megatron_qrl.rollout.base import WeightSyncError, tensor_checksum
from tests.helpers.rl_engine_double import TinyEngine


def _source():
    cfg = tiny_moe_config(CharTokenizer().vocab_size)
    src = TinyEngine(cfg, "bf16", seed=3)  # its transformers model is the "trainer" here
    return cfg, {n: t.clone() for n, t in hf_tensors(src.model)}


def test_sync_sends_packed_weights_and_aqn_only_on_engine_copy():
    cfg, weights = _source()
    before = {n: t.clone() for n, t in weights.items()}
    engine = TinyEngine(cfg, "int8", seed=0)
    spec = get_spec("int8")
    aqn = AQNConfig(enabled=True, sigma_start=1e-2, sigma_end=1e-3, num_stages=2)
    res = sync_weights(iter(weights.items()), engine, spec, version=5, aqn=aqn, seed=1,
                       aqn_step=1, total_steps=2)
    assert engine.weight_version() == 5 and res.aqn_sigma > 0
    assert res.num_tensors == len(engine.held_checksums())
    for n in weights:
        assert torch.equal(weights[n], before[n]), n  # the trainer's weights are untouched
    norm = "model.layers.0.input_layernorm.weight"
    assert engine.held_checksums()[norm] != tensor_checksum(dict(spec.pack(norm, weights[norm]))[norm])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert spec.packed_names(q) != (q,)  # int8: packed (weight + scale), not the fp32 tensor
    assert all(n in engine.held_checksums() for n in spec.packed_names(q))


def test_sync_verification_names_the_bad_tensor():
    cfg, weights = _source()

    class Corrupting(TinyEngine):
        def held_checksums(self):
            held = super().held_checksums()
            held["model.norm.weight"] = "float32[1]:deadbeef"
            return held

    with pytest.raises(WeightSyncError, match="model.norm.weight"):
        sync_weights(iter(weights.items()), Corrupting(cfg, "bf16"), get_spec("bf16"), 1)


def test_batched_checksums_equal_per_tensor_fingerprints():
    """Checksums (one host transfer for a whole sync) == tensor_checksum per tensor, for odd
    byte counts, 1-byte floats, empty tensors and non-contiguous views; the manifest is
    filled when its stream is exhausted and still refuses a duplicate name."""
    from megatron_qrl.rollout.base import Checksums, WeightManifest

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
               "c": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
               "d": torch.zeros(0, 4), "e": torch.arange(12, dtype=torch.int8).reshape(3, 4).t()}
    sums = Checksums()
    for n, t in tensors.items():
        sums.add(n, t)
    assert sums.result() == {n: tensor_checksum(t) for n, t in tensors.items()}
    passed = Checksums()
    assert [n for n, _ in passed.passing(iter(tensors.items()))] == list(tensors)
    assert passed.result() == sums.result()
    assert len(set(sums.result().values())) == len(tensors)
    m = WeightManifest()
    it = m.record(iter(tensors.items()))
    next(it)
    assert m.checksums == {}  # fetched once, at the end
    list(it)
    assert m.checksums == sums.result()
    with pytest.raises(WeightSyncError, match="sent twice"):
        list(WeightManifest().record(iter([("a", tensors["a"]), ("a", tensors["a"])])))


@pytest.mark.parametrize("chunk_words", [1 << 24, 7, 1])
def test_checksum_parts_many_equals_one_at_a_time(chunk_words):
    """Batched sums == per-tensor sums for every dtype width, odd byte counts and empty
    tensors, with chunks that cut tensors (and single words) apart; Checksums batches by
    bytes and still equals the per-tensor fingerprints."""
    from megatron_qrl.rollout.base import Checksums, checksum_parts, checksum_parts_many

    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).bfloat16(),
          torch.zeros(0, 4), torch.randn(9, generator=g).to(torch.float8_e4m3fn),
          torch.randint(-2**62, 2**62, (5,), generator=g),
          torch.arange(12, dtype=torch.int8).reshape(3, 4).t(), torch.ones(1, dtype=torch.bool),
          torch.full((33,), -1, dtype=torch.int32), torch.zeros(0)]
    want = torch.stack([checksum_parts(t) for t in ts])
    assert torch.equal(checksum_parts_many(ts, chunk_words=chunk_words), want)
    assert torch.equal(checksum_parts_many(ts[2:3]), torch.zeros(1, 2, dtype=torch.int64))
    want = {f"t{i}": tensor_checksum(t) for i, t in enumerate(ts)}
    for batch_bytes in (16, 1 << 20):  # several batches (some of one tensor), or one
        batched = Checksums(batch_bytes=batch_bytes, batch_host=True)
        for i, t in enumerate(ts):
            batched.add(f"t{i}", t)
        assert batched._rows or batched._queued
        assert batched.result() == want


@pytest.mark.parametrize("chunk_words", [1 << 24, 5, 1])
def test_checksum_rows_equal_each_row_alone(chunk_words):
    """The rows of a stacked tensor fingerprint as the same tensors one by one: whole-word
    rows (column blocks and row blocks of every size), ragged rows (the fallback), 1-byte
    floats, wrapping int64 words, a non-contiguous stack, and no rows at all."""
    from megatron_qrl.rollout.base import checksum_parts, checksum_rows

    g = torch.Generator().manual_seed(2)
    stacks = [torch.randn(4, 3, 8, generator=g),                        # 24 words a row
              torch.randn(5, 6, generator=g).bfloat16(),                # 3 words a row
              torch.randn(3, 7, generator=g).to(torch.float8_e4m3fn),   # 7 bytes: ragged
              torch.randint(-2**62, 2**62, (3, 4), generator=g),        # wraps when summed
              torch.randn(6, 4, generator=g).t(),                       # non-contiguous
              torch.zeros(0, 4), torch.zeros(3, 0)]
    for s in stacks:
        want = (torch.stack([checksum_parts(r) for r in s.unbind(0)]) if s.shape[0]
                else torch.zeros(0, 2, dtype=torch.int64))
        assert torch.equal(checksum_rows(s, chunk_words=chunk_words), want), s.shape
    with pytest.raises(ValueError, match="scalar"):
        checksum_rows(torch.tensor(1.0))


def test_add_rows_keeps_the_order_of_names_with_queued_tensors():
    """Rows added between queued tensors land under their names, in order, as if each row
    had been added alone; a name count that does not match dim 0 is refused."""
    from megatron_qrl.rollout.base import Checksums

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(5, generator=g), torch.randn(2, 3, generator=g)
    stack = torch.randn(3, 4, 2, generator=g)
    rows = [f"experts.{e}.w" for e in range(3)]
    for batch_host in (False, True):
        got = Checksums(batch_host=batch_host)
        got.add("a", a)
        got.add_rows(rows, stack)
        got.add("b", b)
        want = {"a": tensor_checksum(a)} | {n: tensor_checksum(stack[e])
                                            for e, n in enumerate(rows)} | {"b": tensor_checksum(b)}
        assert got.result() == want
        assert list(got.result()) == list(want)
    with pytest.raises(ValueError, match="2 names for a tensor of shape"):
        Checksums().add_rows(rows[:2], stack)


class _SelfVerifyingEngine(TinyEngine):
    """As the in-process SGLang engine: update_weights checks the sync itself (here it keeps
    the fingerprints of the stream it was handed, the count the driver reports)."""

    verifies_own_update = True

    def update_weights(self, named_tensors, version):
        from megatron_qrl.rollout.base import Checksums

        sums = Checksums()
        super().update_weights(sums.passing(named_tensors), version)
        self.sent = sums.result()

    def held_checksums(self):
        return dict(self.sent)


def test_an_engine_verifying_its_own_updates_gets_no_second_manifest(monkeypatch):
    """No manifest pass for an engine whose update_weights checks the sync itself (a second
    per-tensor pass over the same stream); the count and the version check stay, and a name
    sent twice is still refused. A supervisor answers for its engine."""
    from megatron_qrl.rollout import base
    from megatron_qrl.rollout.supervisor import EngineSupervisor

    cfg, weights = _source()

    def no_manifest(self, stream):
        raise AssertionError("the manifest fingerprinted the stream a second time")

    monkeypatch.setattr(base.WeightManifest, "record", no_manifest)
    engine = _SelfVerifyingEngine(cfg, "int8", seed=0)
    res = sync_weights(iter(weights.items()), engine, get_spec("int8"), version=3)
    assert res.num_tensors == len(engine.held_checksums()) > len(weights)  # weight + scale
    assert engine.weight_version() == 3
    supervised = EngineSupervisor(lambda: _SelfVerifyingEngine(cfg, "int8", seed=0),
                                  lambda e, v: None)
    assert supervised.verifies_own_update and not EngineSupervisor(
        lambda: TinyEngine(cfg, "int8", seed=0), lambda e, v: None).verifies_own_update
    assert sync_weights(iter(weights.items()), supervised, get_spec("int8"), 4).num_tensors == \
        res.num_tensors
    twice = list(weights.items())
    twice.append(twice[0])
    with pytest.raises(WeightSyncError, match="sent twice"):
        sync_weights(iter(twice), engine, get_spec("bf16"), 5)
    with pytest.raises(AssertionError, match="second time"):  # every other engine: manifest
        sync_weights(iter(weights.items()), TinyEngine(cfg, "int8", seed=0), get_spec("int8"), 6)


def test_only_the_in_process_sglang_engine_skips_the_manifest():
    from megatron_qrl.rollout.base import RolloutEngine
    from megatron_qrl.rollout.ray_actor import RayEngine
    from megatron_qrl.rollout.reference import ReferenceEngine
    from megatron_qrl.rollout_sglang.engine import SGLangEngine

    assert SGLangEngine.verifies_own_update
    assert not any(c.verifies_own_update for c in (RolloutEngine, ReferenceEngine, RayEngine))
