"""The trainer asleep while the rollout engine decodes: its GPU state moved off the device.

A trainer that shares its GPU with the rollout engine (``--qrl-mode single`` or
``colocated``) holds its BF16 weights, fp32 main parameters, gradient buffers and Adam
state (~70 GB for Qwen3-4B) through the rollout unless it sleeps. :class:`TrainerSleep`
moves that state off the device and brings it back bit for bit:

* every storage is copied byte for byte (``uint8``) into host memory (pinned on CUDA, from a
  pool kept between steps) and the device storage is resized to 0 bytes; waking resizes it
  back and copies the bytes in. Storages, not tensors, are moved: every Parameter, every view
  into megatron-core's ``_ParamAndGradBuffer`` (``param_data`` / ``grad_data``,
  ``main_grad``), every fp32 main parameter and Adam moment keeps its Python identity, so
  DDP hooks, the optimizer's references and the buckets stay valid;
* gradients (the DDP ``grad_data`` buffers and any ``.grad``) are released without a copy
  and come back as zeros: ``PolicyTrainer.train_step`` zeroes the grad buffer and the
  optimizer's grads before every forward / backward, so no step reads them across a sleep.

Roles: ``params`` (the model's weights, which the weight sync reads) and ``state`` (gradients,
fp32 main parameters, optimizer state). ``sleep(keep_params=True)`` puts the state to sleep
and leaves the weights for the sync; a later ``sleep()`` puts the rest to sleep.

The offload target is host memory; on a CPU-only job the device is the CPU too, and the same
code path runs (a real copy into another host buffer and a real release of the storage), so
the CPU tests exercise it end to end. Tensors on another device than the trainer's (the CPU
part of ``--optimizer-cpu-offload``'s HybridDeviceOptimizer on a GPU job) stay where they are.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SleepStats", "TrainerSleep", "optimizer_members", "sleep_line", "trainer_sleep_on",
           "trainer_tensors"]

ROLES = ("params", "grads", "state")


@dataclass
class _Slot:
    storage: torch.UntypedStorage
    nbytes: int
    role: str
    host: torch.Tensor | None
    """The bytes while asleep (None: a gradient, released without a copy)."""


@dataclass
class SleepStats:
    """What one :meth:`TrainerSleep.sleep` or :meth:`TrainerSleep.wake` did."""

    seconds: float = 0.0
    bytes_copied: int = 0
    bytes_released: int = 0
    """Device bytes released (copied ones and dropped gradients)."""


def optimizer_members(optimizer: Any) -> list[Any]:
    """The megatron-core optimizers inside ``optimizer`` (a ChainedOptimizer's members)."""
    members = getattr(optimizer, "chained_optimizers", None)
    return list(members) if members else [optimizer]


def _param_tensors(ddp: Any) -> Iterator[torch.Tensor]:
    for buf in [*getattr(ddp, "buffers", []), *getattr(ddp, "expert_parallel_buffers", [])]:
        if getattr(buf, "param_data", None) is not None:
            yield buf.param_data
    yield from ddp.module.parameters()


def _grad_tensors(ddp: Any, optimizer: Any) -> Iterator[torch.Tensor]:
    for buf in [*getattr(ddp, "buffers", []), *getattr(ddp, "expert_parallel_buffers", [])]:
        if getattr(buf, "grad_data", None) is not None:
            yield buf.grad_data
    for p in ddp.module.parameters():
        for g in (getattr(p, "main_grad", None), p.grad):
            if g is not None:
                yield g
    for member in optimizer_members(optimizer):
        for group in getattr(member, "param_groups", []):
            yield from (p.grad for p in group["params"] if p.grad is not None)


def _state_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    for member in optimizer_members(optimizer):
        inner = getattr(member, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:  # fp32 main params (or the model's own in fp32)
            yield from group["params"]
        for state in inner.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v))


def trainer_tensors(ddp: Any, optimizer: Any) -> dict[str, list[torch.Tensor]]:
    """The trainer's tensors by role (``params``, ``grads``, ``state``); a storage shared
    by several roles counts in the first (an fp32 model's optimizer params are its weights)."""
    return {"params": list(_param_tensors(ddp)), "grads": list(_grad_tensors(ddp, optimizer)),
            "state": list(_state_tensors(optimizer))}


class TrainerSleep:
    """Sleep / wake of one trainer's state (module docstring).

    ``tensors``: a callable giving :func:`trainer_tensors`-style ``{role: tensors}`` (called
    at each sleep: a new optimizer or its lazily made Adam moments are found). ``device``: the
    trainer's device; only its storages move."""

    def __init__(self, tensors: Any, device: torch.device | str) -> None:
        self._tensors = tensors
        self.device = torch.device(device)
        self._slots: dict[int, _Slot] = {}
        self._pool: dict[int, list[torch.Tensor]] = {}
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None

    @classmethod
    def of_policy(cls, policy: Any, device: torch.device | str | None = None) -> TrainerSleep:
        """For a ``rl.trainer.PolicyModel`` (its current optimizer at every sleep)."""
        if device is None:
            device = next(policy.ddp.module.parameters()).device
        return cls(lambda: trainer_tensors(policy.ddp, policy.optimizer), device)

    @property
    def asleep(self) -> bool:
        """Whether any storage is asleep."""
        return bool(self._slots)

    def asleep_roles(self) -> set[str]:
        return {s.role for s in self._slots.values()}

    def _collect(self, roles: Iterable[str]) -> list[_Slot]:
        by_role = self._tensors()
        seen: set[int] = set(self._slots)
        out = []
        for role in ROLES:
            for t in by_role.get(role, []):
                st = t.untyped_storage()
                key = st._cdata
                if key in seen or t.device != self.device:
                    continue
                seen.add(key)
                if role in roles and st.nbytes() > 0:
                    out.append(_Slot(st, st.nbytes(), role, None))
        return out

    def _host(self, nbytes: int) -> torch.Tensor:
        pool = self._pool.get(nbytes)
        if pool:
            return pool.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda)

    def _bytes(self, slot: _Slot) -> torch.Tensor:
        """The slot's device storage as a flat ``uint8`` tensor."""
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(
            slot.storage, 0, (slot.nbytes,), (1,))

    def _on_side_stream(self):
        if self._stream is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._stream)

    def _join(self) -> None:
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            self._stream.synchronize()

    def sleep(self, keep_params: bool = False) -> SleepStats:
        """Move the state (and the weights unless ``keep_params``) off the device; storages
        already asleep are left as they are."""
        t0 = time.perf_counter()
        roles = ("grads", "state") if keep_params else ROLES
        slots = self._collect(roles)
        stats = SleepStats()
        with self._on_side_stream():
            for slot in slots:
                if slot.role != "grads":
                    slot.host = self._host(slot.nbytes)
                    slot.host.copy_(self._bytes(slot), non_blocking=True)
                    stats.bytes_copied += slot.nbytes
        self._join()
        for slot in slots:
            slot.storage.resize_(0)
            self._slots[slot.storage._cdata] = slot
            stats.bytes_released += slot.nbytes
        if self._cuda:
            torch.cuda.empty_cache()
        stats.seconds = time.perf_counter() - t0
        return stats

    def wake(self) -> SleepStats:
        """Restore every storage asleep, bit for bit (gradients as zeros)."""
        t0 = time.perf_counter()
        stats = SleepStats()
        slots = list(self._slots.values())
        for slot in slots:
            slot.storage.resize_(slot.nbytes)
        with self._on_side_stream():
            for slot in slots:
                dev = self._bytes(slot)
                if slot.host is None:
                    dev.zero_()
                else:
                    dev.copy_(slot.host, non_blocking=True)
                    stats.bytes_copied += slot.nbytes
        self._join()
        for slot in slots:
            if slot.host is not None:
                self._pool.setdefault(slot.nbytes, []).append(slot.host)
                slot.host = None
        self._slots.clear()
        stats.seconds = time.perf_counter() - t0
        return stats



def trainer_sleep_on(configs: Any) -> bool:
    """Whether the trainer sleeps while the engine decodes (``--qrl-trainer-sleep``; auto: an
    SGLang engine on a GPU sharing the trainer's, in-process with its memory release or in
    a colocated Ray actor). The refused combinations are ``config.job.JobConfig``'s."""
    choice = configs.run.trainer_sleep
    if choice != "auto":
        return choice == "on"
    job, ro = configs.get("job"), configs.rollout
    mode = job.mode if job is not None else "single"
    return (ro.engine == "sglang" and torch.cuda.is_available() and mode != "disaggregated"
            and (mode == "colocated" or ro.sglang.release_memory))


def sleep_line(on: bool, configs: Any) -> str:
    """The run log's line on the trainer's sleep and the engine's memory fraction."""
    ro = configs.rollout
    frac = (f"; SGLang engine mem fraction {ro.sglang.mem_fraction}"
            if ro.engine == "sglang" else "")
    how = ("on: its state leaves the device while the engine decodes" if on else "off")
    return f"[qrl-train] trainer sleep {how} (--qrl-trainer-sleep {configs.run.trainer_sleep}){frac}"
