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

What moves is what ``rl.trainer_state`` reaches from the model and the optimizer: the
weights, module buffers and module-held tensors (a LoRA run's frozen base, RoPE's
``inv_freq``, the aligned forward's cached quantized weights) in the role ``params``, which
the weight sync reads; gradients in ``grads``; fp32 main parameters, Adam moments and every
tensor of the megatron optimizer and its grad scaler in ``state``. ``sleep(keep_params=True)``
puts grads and state to sleep and leaves the weights for the sync; a later ``sleep()`` puts
the rest to sleep and drops megatron-core's RoPE ``lru_cache`` (recomputed on demand).
:meth:`TrainerSleep.accounting` lists every reached storage with its bytes and whether it is
asleep. Not the trainer's and left alone: the process's cuBLAS workspaces (one per handle and
stream, 32 MiB each on Hopper, counted by ``torch.cuda.memory_allocated``) and class-level
loss scales of megatron-core's auxiliary-loss autoscalers (one scalar each).

``wake(defer_state=True)`` brings the optimizer state back behind the weights: an RL step
needs its weights at once (recompute, forward / backward) and the fp32 main parameters and
Adam moments only at the optimizer step. On CUDA the weights' copies and the gradients' zeroing
come first on the side stream and the compute stream waits for them on the GPU (no host
wait); the state's copies follow from a host thread in chunks of :data:`CHUNK_BYTES`, each
issued once the one before has landed, so that the trainer's own small host-to-device copies
(each micro batch's tensors) queue behind one chunk, not behind the whole state — issued at
once, the state's copies held the recompute's first micro batch until all of them had landed
(measured on the H200: recompute 0.80 -> 1.67 s on the 30B-A3B slice, ~39 GB of state).
:meth:`TrainerSleep.state_ready` (``PolicyTrainer``'s hook before every optimizer step) waits
for the thread and makes the compute stream wait for the last chunk. On the CPU the state stays asleep
until :meth:`TrainerSleep.state_ready` copies it in, so a step that read it earlier would
fail the CPU tests instead of reading stale bytes.

The offload target is host memory; on a CPU-only job the device is the CPU too, and the same
code path runs (a real copy into another host buffer and a real release of the storage), so
the CPU tests exercise it end to end. Tensors on another device than the trainer's (the CPU
part of ``--optimizer-cpu-offload``'s HybridDeviceOptimizer on a GPU job) stay where they are.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qrl.rl.trainer_state import (
    ROLES,
    clear_module_caches,
    labelled_tensors,
    optimizer_members,
    trainer_tensors,
)

__all__ = ["SleepStats", "StorageRecord", "TrainerSleep", "bytes_awake", "optimizer_members",
           "sleep_line", "trainer_sleep_on", "trainer_tensors"]


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


@dataclass(frozen=True)
class StorageRecord:
    """One storage the trainer reaches (:meth:`TrainerSleep.accounting`)."""

    role: str
    label: str
    """Where it was first reached (``rl.trainer_state``'s labels: ``param``, ``module
    tensor``, ``grad_data``, ``optimizer param``, ``optimizer tensor``, ...)."""
    nbytes: int
    """Its bytes when awake."""
    device: str
    asleep: bool


def bytes_awake(records: Iterable[StorageRecord], device: torch.device | str) -> int:
    """Bytes of the ``records`` still held on ``device`` (not asleep)."""
    dev = str(torch.device(device))
    return sum(r.nbytes for r in records if r.device == dev and not r.asleep)


class TrainerSleep:
    """Sleep / wake of one trainer's state (module docstring).

    ``tensors``: a callable giving ``(role, label, tensor)`` triples like
    :func:`rl.trainer_state.labelled_tensors` (called at each sleep: a new optimizer or its
    lazily made Adam moments are found). ``device``: the trainer's device; only its storages
    move. ``drop_caches``: called when the weights fall asleep (caches out of reach of the
    walk, recomputed on demand)."""

    def __init__(self, tensors: Any, device: torch.device | str,
                 drop_caches: Any = None) -> None:
        self._tensors = tensors
        self.device = torch.device(device)
        self._drop_caches = drop_caches
        self._slots: dict[int, _Slot] = {}
        self._pool: dict[int, list[torch.Tensor]] = {}
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._feeder: _ChunkFeeder | None = None
        """CUDA: the thread copying a deferred state in (:meth:`state_ready` waits for it)."""
        self._in_flight: list[tuple[Any, list[torch.Tensor]]] = []
        """CUDA: host buffers still read by copies behind an event (back to the pool once
        it completed: :meth:`_settle`)."""
        self._deferred = False
        """CPU: the state a deferred wake left asleep, for :meth:`state_ready`."""

    @classmethod
    def of_policy(cls, policy: Any, device: torch.device | str | None = None) -> TrainerSleep:
        """For a ``rl.trainer.PolicyModel`` (its current optimizer at every sleep)."""
        if device is None:
            device = next(policy.ddp.module.parameters()).device
        return cls(lambda: labelled_tensors(policy.ddp, policy.optimizer), device,
                   lambda: clear_module_caches(policy.ddp.module))

    @property
    def asleep(self) -> bool:
        """Whether any storage is asleep (the state a deferred wake left is, on the CPU)."""
        return bool(self._slots)

    @property
    def state_pending(self) -> bool:
        """Whether a ``wake(defer_state=True)`` left the optimizer state to
        :meth:`state_ready`."""
        return self._feeder is not None or self._deferred

    def asleep_roles(self) -> set[str]:
        return {s.role for s in self._slots.values()}

    def _storages(self) -> Iterator[tuple[str, str, torch.UntypedStorage]]:
        """``(role, label, storage)`` of every storage the walk reaches, each once (in the
        first role that reaches it)."""
        seen: set[int] = set()
        for role, label, t in self._tensors():
            st = t.untyped_storage()
            if st._cdata not in seen:
                seen.add(st._cdata)
                yield role, label, st

    def _collect(self, roles: Iterable[str]) -> list[_Slot]:
        return [_Slot(st, st.nbytes(), role, None) for role, _, st in self._storages()
                if role in roles and st._cdata not in self._slots
                and st.device == self.device and st.nbytes() > 0]

    def accounting(self) -> list[StorageRecord]:
        """Every storage the trainer reaches, on any device: its role, where it was reached,
        its bytes when awake and whether it is asleep now."""
        out = []
        for role, label, st in self._storages():
            slot = self._slots.get(st._cdata)
            out.append(StorageRecord(role, label, st.nbytes() if slot is None else slot.nbytes,
                                     str(st.device), slot is not None))
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

    def _settle(self) -> None:
        """Wait for every copy still in flight and give its host buffers back to the pool."""
        for event, hosts in self._in_flight:
            event.synchronize()
            for h in hosts:
                self._pool.setdefault(h.numel(), []).append(h)
        self._in_flight.clear()

    def sleep(self, keep_params: bool = False) -> SleepStats:
        """Move the state (and the weights unless ``keep_params``) off the device; storages
        already asleep are left as they are (a deferred state is first made ready)."""
        t0 = time.perf_counter()
        self.state_ready()
        self._settle()
        roles = ("grads", "state") if keep_params else ROLES
        if not keep_params and self._drop_caches is not None:
            self._drop_caches()
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

    def _restore(self, slots: list[_Slot], stats: SleepStats) -> None:
        """Queue the copies of ``slots`` (already resized back; zeros for gradients) on the
        current stream (the side stream inside :meth:`_on_side_stream`)."""
        for slot in slots:
            dev = self._bytes(slot)
            if slot.host is None:
                dev.zero_()
            else:
                dev.copy_(slot.host, non_blocking=True)
                stats.bytes_copied += slot.nbytes

    def _forget(self, slots: list[_Slot], event: Any = None) -> None:
        """``slots`` are awake: their host buffers go back to the pool (behind ``event``
        on CUDA, :meth:`_settle`)."""
        hosts = [s.host for s in slots if s.host is not None]
        for slot in slots:
            slot.host = None
            del self._slots[slot.storage._cdata]
        if event is None:
            for h in hosts:
                self._pool.setdefault(h.numel(), []).append(h)
        else:
            self._in_flight.append((event, hosts))

    def wake(self, defer_state: bool = False) -> SleepStats:
        """Restore every storage asleep, bit for bit (gradients as zeros). ``defer_state``:
        the optimizer state comes back behind the weights (module docstring) and
        :meth:`state_ready` must run before anything reads it; ``seconds`` is then the host
        time of the wake, the copies overlapping what the GPU runs next."""
        t0 = time.perf_counter()
        self.state_ready()  # a deferred state still on its way first
        stats = SleepStats()
        slots = list(self._slots.values())
        later = [s for s in slots if defer_state and s.role == "state"]
        now = [s for s in slots if not (defer_state and s.role == "state")]
        if not self._cuda or not later:  # the CPU leaves a deferred state asleep
            for slot in now:
                slot.storage.resize_(slot.nbytes)
            with self._on_side_stream():
                self._restore(now, stats)
            self._join()
            self._forget(now)
            self._deferred = bool(later)
        else:
            for slot in slots:
                slot.storage.resize_(slot.nbytes)
            with self._on_side_stream():
                self._restore(now, stats)
                weights = torch.cuda.Event()
                weights.record()
            torch.cuda.current_stream(self.device).wait_event(weights)
            self._forget(now, weights)
            stats.bytes_copied += sum(s.nbytes for s in later)
            self._feeder = _ChunkFeeder(self, later)
        stats.seconds = time.perf_counter() - t0
        return stats

    def state_ready(self) -> float:
        """Make the optimizer state a deferred wake left usable (a no-op otherwise): CUDA,
        the current stream waits for its copies; CPU, they run now. Returns the seconds."""
        t0 = time.perf_counter()
        if self._feeder is not None:
            last = self._feeder.finish()
            self._feeder = None
            torch.cuda.current_stream(self.device).wait_event(last)
        elif self._deferred:
            later = [s for s in self._slots.values() if s.role == "state"]
            for slot in later:
                slot.storage.resize_(slot.nbytes)
            self._restore(later, SleepStats())
            self._forget(later)
            self._deferred = False
        return time.perf_counter() - t0


CHUNK_BYTES = 64 * 2**20
"""Bytes per copy of a deferred state wake (~2 ms over PCIe 5: the longest a micro batch's own
host-to-device copy waits behind it)."""


class _ChunkFeeder:
    """A host thread copying ``slots`` in from their host buffers, one :data:`CHUNK_BYTES`
    chunk at a time on the sleeper's side stream (each issued once the previous one landed:
    the copy engine never holds more than one). :meth:`finish` joins it and returns the event
    after the last copy; the host buffers go back to the sleeper's pool behind it."""

    def __init__(self, sleeper: TrainerSleep, slots: list[_Slot]) -> None:
        self._sleeper, self._slots = sleeper, slots
        self._error: BaseException | None = None
        self._last = torch.cuda.Event()
        self._thread = threading.Thread(target=self._run, name="qrl-trainer-wake", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sl = self._sleeper
        try:
            with torch.cuda.device(sl.device), torch.cuda.stream(sl._stream):
                landed = torch.cuda.Event()
                for slot in self._slots:
                    dev = sl._bytes(slot)
                    for a in range(0, slot.nbytes, CHUNK_BYTES):
                        b = min(a + CHUNK_BYTES, slot.nbytes)
                        dev[a:b].copy_(slot.host[a:b], non_blocking=True)
                        landed.record()
                        landed.synchronize()  # releases the GIL while the chunk lands
                self._last.record()
        except BaseException as e:  # noqa: BLE001  (re-raised by finish)
            self._error = e

    def finish(self) -> torch.cuda.Event:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("waking the trainer's optimizer state failed") from self._error
        self._sleeper._forget(self._slots, self._last)
        return self._last


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
