"""H200: the trainer's sleep on CUDA (rl.trainer_sleep) frees its memory and restores it exactly.

A small dense policy (BF16 weights, fp32 main parameters, fp32 grad buffer, Adam moments: the
4B example's precision, with and without the distributed optimizer) takes one optimizer step;
then ``TrainerSleep.sleep()`` must bring ``torch.cuda.memory_allocated`` down by at least 90%
of what the trainer holds (its allocations since the model was built), its accounting must
show nothing it reaches still on the GPU, the host copies must be pinned, and ``wake()`` must
give back every weight, main parameter and Adam moment bit for bit in the same tensor objects;
the next step after the wake must equal the second step of a twin policy built the same way
that never slept. The twin is built and stepped first: its first forward / backward creates
the process's cuBLAS workspaces (32 MiB per handle and stream on Hopper; the forward's thread
and autograd's each have a handle), which ``memory_allocated`` counts but which are not the
trainer's — taken after the baseline they were the 64 MiB a sleep "missed". Prints the sleep /
wake seconds and the copy rate (no speed claim: the 4B example's metrics.jsonl carries
time_sleep_s / time_wake_s).

Run: ``pytest tests/gpu/test_trainer_sleep_cuda.py -s`` (< 1 min; bench/h200.sh ``gpu-tests
FILES=tests/gpu/test_trainer_sleep_cuda.py``).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from megatron_qrl.rl.trainer_sleep import TrainerSleep, bytes_awake, trainer_tensors  # noqa: E402


@pytest.fixture(scope="module")
def megatron():
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        yield


def _policy(distributed: bool):
    from megatron.core import tensor_parallel

    from megatron_qrl.data import CharTokenizer, tiny_dense_config
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.rl.trainer import PolicyTrainer, TrainerOptions, build_policy

    tok = CharTokenizer()
    cfg = tiny_dense_config(tok.vocab_size) | {"hidden_size": 512, "intermediate_size": 1536,
                                               "num_hidden_layers": 4}
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    return tok, PolicyTrainer(build_policy(arch_from_dict(cfg, source="test"), 1e-3, bf16=True,
                                           options=TrainerOptions(
                                               transformer_impl="local",
                                               distributed_optimizer=distributed)))


def _step(tok, trainer):
    from megatron_qrl.rl.batch import sft_batch, split_batch
    from megatron_qrl.rl.steps import _sft_loss

    batch = sft_batch([tok.encode("12+34=")] * 8, [[*tok.encode("46"), tok.eos_id]] * 8)
    return trainer.train_step(split_batch(batch, 4), _sft_loss, per_token_loss=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


@pytest.mark.parametrize("distributed", [False, True])
def test_sleep_frees_the_trainer_and_wake_restores_it(megatron, distributed):
    tok, twin = _policy(distributed)  # never slept; its step warms cuBLAS before the baseline
    _step(tok, twin)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    _, trainer = _policy(distributed)
    _step(tok, trainer)
    tensors = trainer_tensors(trainer.policy.ddp, trainer.policy.optimizer)
    kept = {r: [_bits(t) for t in ts] for r, ts in tensors.items() if r != "grads"}
    torch.cuda.synchronize()
    full = torch.cuda.memory_allocated()
    own = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
               for ts in tensors.values() for t in ts}.values())

    sleeper = TrainerSleep.of_policy(trainer.policy)
    slept = sleeper.sleep()
    asleep = torch.cuda.memory_allocated()
    records = sleeper.accounting()
    woke = sleeper.wake()
    gb = slept.bytes_copied / 1e9
    print(f"\n[sleep] distributed={distributed}: trainer {own / 2**20:.0f} MiB, allocated "
          f"{(full - base) / 2**20:.0f} MiB, freed {(full - asleep) / 2**20:.0f} MiB; sleep "
          f"{slept.seconds:.3f} s, wake {woke.seconds:.3f} s "
          f"({gb / max(slept.seconds, 1e-9):.1f} / {gb / max(woke.seconds, 1e-9):.1f} GB/s)")
    assert bytes_awake(records, torch.device("cuda", torch.cuda.current_device())) == 0, \
        [r for r in records if not r.asleep and r.device.startswith("cuda")]
    assert full - asleep >= 0.9 * (full - base)
    assert all(h.is_pinned() for pool in sleeper._pool.values() for h in pool)
    after = trainer_tensors(trainer.policy.ddp, trainer.policy.optimizer)
    assert [id(t) for ts in after.values() for t in ts] == \
        [id(t) for ts in tensors.values() for t in ts]
    for role, bits in kept.items():
        for t, b in zip(after[role], bits):
            assert torch.equal(_bits(t), b), role
    (m1, g1), (m2, g2) = _step(tok, trainer), _step(tok, twin)
    assert m1 == m2 and g1 == g2
    for p, q in zip(trainer.module.parameters(), twin.module.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("distributed", [False, True])
def test_deferred_wake_overlaps_and_the_step_equals_a_twin(megatron, distributed):
    """``wake(defer_state=True)`` with ``state_ready`` as the trainer's hook before the
    optimizer step (as an RL step runs it): the step after the wake equals a never-slept
    twin's, bit for bit, and the wake's host time is below the copies' (they overlap the
    forward / backward). Prints both."""
    tok, twin = _policy(distributed)
    _step(tok, twin)
    _, trainer = _policy(distributed)
    _step(tok, trainer)
    sleeper = TrainerSleep.of_policy(trainer.policy)
    trainer.before_step.append(sleeper.state_ready)
    sleeper.sleep()
    torch.cuda.synchronize()
    full = TrainerSleep.of_policy(trainer.policy)
    woke = sleeper.wake(defer_state=True)
    assert sleeper.state_pending
    (m1, g1), (m2, g2) = _step(tok, trainer), _step(tok, twin)
    assert not sleeper.state_pending
    assert m1 == m2 and g1 == g2
    for p, q in zip(trainer.module.parameters(), twin.module.parameters()):
        assert torch.equal(p, q)
    full.sleep()
    torch.cuda.synchronize()
    whole = full.wake()
    print(f"\n[deferred wake] distributed={distributed}: host {woke.seconds * 1e3:.1f} ms "
          f"of {woke.bytes_copied / 2**20:.0f} MiB vs a joined wake {whole.seconds * 1e3:.1f} ms")
    assert woke.bytes_copied == whole.bytes_copied
