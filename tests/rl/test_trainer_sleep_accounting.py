"""What stays on the device while the trainer sleeps (rl.trainer_sleep, rl.trainer_state).

The ground truth is a census independent of the walk that the sleep uses: every tensor
storage alive (``gc``) after the policy was built and took one optimizer step that was not
alive before — what ``torch.cuda.memory_allocated`` counts on a GPU, less the allocator's
rounding and the cuBLAS workspaces. After ``sleep()`` at least 90% of those bytes must be
released and no storage larger than a scalar may still hold bytes (megatron-core's
auxiliary-loss autoscalers keep one class-level scalar, not the trainer's); the sleeper's own
accounting must agree (nothing it reaches on the device awake). Policies: the plain
mixed-precision optimizer, the distributed one, an fp32 model, the aligned forward (its cached
quantized weights are module attributes) and LoRA (the frozen base is module buffers).
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from megatron_qrl.config import QrlConfigs
from megatron_qrl.config.run import RoutingReplayConfig, TrainForwardConfig
from megatron_qrl.data import CharTokenizer, tiny_dense_config
from megatron_qrl.models.hf_config import arch_from_dict
from megatron_qrl.models.lora import freeze_base
from megatron_qrl.models.lora_base import make_base_storage  # its tables exist before a census
from megatron_qrl.models.lora_config import LoraConfig
from megatron_qrl.rl.batch import sft_batch, split_batch
from megatron_qrl.rl.forward import ForwardPlan, _lora_plan
from megatron_qrl.rl.steps import _sft_loss
from megatron_qrl.rl.trainer import PolicyTrainer, TrainerOptions, build_policy
from megatron_qrl.rl.trainer_sleep import TrainerSleep, bytes_awake
from megatron_qrl.te_quant import trainer_forward


def _census() -> dict[int, tuple[int, list]]:
    """``{storage: (bytes, weak refs to the tensors on it)}`` of every live tensor with bytes."""
    gc.collect()
    out: dict[int, tuple[int, list]] = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.untyped_storage().nbytes() > 0:
            st = obj.untyped_storage()
            out.setdefault(st._cdata, (st.nbytes(), []))[1].append(weakref.ref(obj))
    return out


def _still_held(census: dict[int, tuple[int, list]]) -> list[tuple[int, tuple, torch.dtype]]:
    """``(bytes, shape, dtype)`` of each census storage still holding bytes."""
    gc.collect()
    held = []
    for nbytes, refs in census.values():
        alive = [t for t in (r() for r in refs) if t is not None]
        if any(t.untyped_storage().nbytes() > 0 for t in alive):
            held.append((nbytes, tuple(alive[0].shape), alive[0].dtype))
    return held


def _trainer(kind: str):
    tok = CharTokenizer()
    torch.manual_seed(0)
    arch = arch_from_dict(tiny_dense_config(tok.vocab_size), source="tiny")
    options = TrainerOptions(transformer_impl="local", distributed_optimizer=kind == "dist")
    plan = _plan(kind, arch)
    trainer = PolicyTrainer(build_policy(arch, 1e-3, plan, bf16=kind != "fp32", options=options))
    if kind == "lora":  # the base into frozen storage, then the adapters' optimizer
        freeze_base(trainer.module, make_base_storage("bf16"))
        plan.lora.active = True
        trainer.policy.set_optimizer(trainer.policy.new_optimizer(1e-3))
    return tok, trainer


def _plan(kind: str, arch):
    off = RoutingReplayConfig("off")
    if kind == "aligned":
        fwd = trainer_forward(TrainForwardConfig("aligned"), "int8", off, arch)
        return ForwardPlan(fwd.spec_hook, fwd.aligned, fwd.replay, dict(fwd.config_overrides))
    if kind == "lora":
        return _lora_plan(QrlConfigs(lora=LoraConfig(rank=4), train=TrainForwardConfig(),
                                     routing=off, rollout=SimpleNamespace(format="bf16"),
                                     run=SimpleNamespace(sft_steps=0)), arch)
    return None


def _step(tok, trainer) -> None:
    batch = sft_batch([tok.encode("1+2=")] * 4, [[*tok.encode("3"), tok.eos_id]] * 4)
    trainer.train_step(split_batch(batch, 2), _sft_loss, per_token_loss=False)


@pytest.mark.parametrize("kind", ["bf16", "dist", "fp32", "aligned", "lora"])
def test_sleep_releases_what_the_trainer_allocated(kind):
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        before = _census()  # kept alive: no new storage reuses their addresses
        tok, trainer = _trainer(kind)
        _step(tok, trainer)
        census = {k: v for k, v in _census().items() if k not in before}
        total = sum(n for n, _ in census.values())
        sleeper = TrainerSleep.of_policy(trainer.policy)
        sleeper.sleep()
        held = _still_held(census)
        left = sum(n for n, _, _ in held)
        assert total - left >= 0.9 * total, held
        assert all(n <= 8 for n, _, _ in held), held
        records = sleeper.accounting()
        assert bytes_awake(records, "cpu") == 0
        assert sum(r.nbytes for r in records if r.asleep) >= 0.9 * total  # (RoPE's cache: dropped)
        sleeper.wake()
        _step(tok, trainer)  # the woken trainer trains (LoRA base, aligned cache restored)
