"""A rollout fleet: N engines behind ONE :class:`RolloutEngine`, the driver's only view.

Generation: the prompts are cut into prompt groups of ``group_size`` (a GRPO group's
samples stay on one engine); every group is sampled with its own seed,
:func:`~megatron_qrl.rollout.groups.group_seed` ``(sampling.seed, k)`` for the ``k``-th
group. The promise, end to end through ``qrl-train``: for the same ``--qrl-seed`` (and the
same weights), a group's samples are the same whichever engine serves it and however many
engines there are — 1, 2 or 3 in a fleet, and the single engine of ``--qrl-mode single`` or
a one-engine Ray mode, because the driver asks every engine for the same per-group seeds
(``SamplingParams.group_size``, :mod:`megatron_qrl.rollout.groups`). It holds on engines that
honour seeds batch-invariantly: the reference engine (it samples each group in its own
call), and SGLang engines with ``SGLangOptions.deterministic`` (without it SGLang ignores
seeds and the engine warns once). It does not cover a change of ``--qrl-rollout-n-samples-
per-prompt`` or ``--qrl-prompts-per-step`` (other groups), nor engines of other numerics
(another format, engine TP). Dispatch is done
here in the driver: one thread per engine takes the next unserved group from a shared
queue (a fast engine serves more groups), and the groups' outputs are merged in prompt
order. SGLang's router (``sglang-router``) is not used: it balances HTTP requests over
SGLang servers, while these engines are in-process SGLang engines inside Ray actors (no
HTTP server), and the weight sync needs the actors anyway (see ``docs/LAUNCH.md``).

Weight sync: to all engines at once. Engines that are broadcast-transport Ray actors get ONE
group spanning the driver and every engine (:class:`~megatron_qrl.rollout.transports.fleet.
FleetBroadcast`: each bucket broadcast once); others get the materialised stream one after
the other. :meth:`verify` checks the manifest against EVERY engine (naming the engine) and
:meth:`weight_version` that every engine holds the same version.

Failure: an engine that dies (a Ray actor error, :data:`~megatron_qrl.rollout.supervisor.
RESTARTABLE`) is restarted from its own factory (its own placement-group bundle) and re-synced
ALONE through the driver's bound ``resync(version)`` while the other engines keep serving and
keep their results; in a rollout its failed group goes back to the engine's slot (nothing of
the failed call is kept: it raised). A death in a fleet sync restarts the dead engines and
re-syncs the whole fleet (the others' stream was cut too). ``max_restarts`` bounds each
engine's restarts within one call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch

from .base import GenerationOutput, RolloutEngine, SamplingParams, WeightManifest, WeightSyncError
from .groups import group_seed, merge_outputs
from .supervisor import RESTARTABLE, EngineDiedError
from .transports.fleet import FleetBroadcast, FleetSyncError

__all__ = ["EngineFleet", "group_seed", "merge_outputs"]

log = logging.getLogger(__name__)


class _Member:
    """One engine of the fleet, its factory and its counters."""

    def __init__(self, index: int, factory: Callable[[], RolloutEngine]):
        self.index, self.factory = index, factory
        self.engine = factory()
        self.restarts = 0
        self.tokens = 0
        self.groups = 0
        self.busy_s = 0.0
        self.queue_s = 0.0
        self.sync_s = 0.0


class EngineFleet(RolloutEngine):
    """``factories[i]()`` builds engine ``i`` (module docstring)."""

    def __init__(self, factories: Sequence[Callable[[], RolloutEngine]], group_size: int,
                 max_restarts: int = 2, broadcast: FleetBroadcast | None = None,
                 colocated: bool = False):
        if not factories:
            raise ValueError("EngineFleet needs at least one engine factory")
        if group_size < 1 or max_restarts < 0:
            raise ValueError(f"EngineFleet: group_size {group_size} >= 1 and max_restarts "
                             f"{max_restarts} >= 0 (--qrl-engine-max-restarts)")
        self.members = [_Member(i, f) for i, f in enumerate(factories)]
        self.group_size, self.max_restarts = group_size, max_restarts
        self.broadcast = broadcast
        self.colocated, self.released = colocated, False
        """Colocated: every engine's memory is released after a rollout and resumed before
        the next sync or rollout (the trainer's recompute + update run in between)."""
        self._resync: Callable[[int], Any] | None = None
        self._targets: list[_Member] | None = None  # set while re-syncing some engines
        self._version = -1
        self._lock = threading.Lock()  # one re-sync at a time (they share the driver's sync)
        self._calls = 0

    # ---- the driver's hooks ------------------------------------------------------------
    def bind_resync(self, sync: Callable[[int], Any]) -> None:
        """``sync(version)``: the driver's re-pack + send + verify of the current weights."""
        self._resync = sync

    @property
    def restarts(self) -> int:
        return sum(m.restarts for m in self.members)

    def _run_resync(self, targets: list[_Member], version: int) -> None:
        if self._resync is None:
            raise RuntimeError("a fleet engine died and no re-sync is bound (the driver calls "
                               "EngineFleet.bind_resync(sync))")
        self._targets = targets
        try:
            self._resync(version)
        finally:
            self._targets = None

    def _restart(self, m: _Member, why: str, failures: list[str]) -> None:
        """Restart engine ``m`` and re-sync it alone, until one re-sync completes."""
        while True:
            failures.append(why)
            if len(failures) > self.max_restarts:
                raise EngineDiedError(
                    f"fleet engine {m.index} died {len(failures)} times in one call, giving up "
                    f"(--qrl-engine-max-restarts {self.max_restarts}): {'; '.join(failures)}")
            log.warning("fleet engine %d died (%s); restarting it", m.index, why)
            try:
                m.engine.shutdown()
            except Exception as exc:  # noqa: BLE001 - the dead engine may not shut down
                log.debug("shutdown of dead engine %d failed: %s", m.index, exc)
            m.engine = m.factory()
            m.restarts += 1
            if self._version < 0:
                return
            try:
                with self._lock:
                    self._run_resync([m], self._version)
                return
            except RESTARTABLE as exc:
                why = f"re-sync of version {self._version}: {type(exc).__name__}: {exc}"

    def _supervised(self, m: _Member, call: Callable[[RolloutEngine], Any]) -> Any:
        failures: list[str] = []
        while True:
            try:
                return call(m.engine)
            except RESTARTABLE as exc:
                self._restart(m, f"{type(exc).__name__}: {str(exc)[:300]}", failures)

    # ---- weights -----------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if self._targets is not None:  # a re-sync: errors go to the restart running it
            self._send(self._targets, named_tensors, version)
            return
        self._version = version
        if self.released:
            self.resume_memory()
        try:
            self._send(self.members, named_tensors, version)
        except FleetSyncError as exc:
            self._recover_sync(exc, version)

    def _recover_sync(self, exc: FleetSyncError, version: int) -> None:
        """Restart the engines that died in a fleet sync, then re-sync the whole fleet."""
        failures: list[str] = []
        while True:
            failures.append(str(exc))
            if len(failures) > self.max_restarts:
                raise EngineDiedError(f"fleet weight sync failed {len(failures)} times, giving "
                                      f"up (--qrl-engine-max-restarts {self.max_restarts}): "
                                      f"{'; '.join(failures)}") from exc
            for i in exc.dead:
                m = self.members[i]
                try:
                    m.engine.shutdown()
                except Exception:  # noqa: BLE001 - it is dead
                    pass
                m.engine, m.restarts = m.factory(), m.restarts + 1
            try:
                with self._lock:
                    self._run_resync(list(self.members), version)
                return
            except FleetSyncError as again:
                exc = again

    def _send(self, members: list[_Member], stream: Iterable[tuple[str, torch.Tensor]],
              version: int) -> None:
        start = time.perf_counter()
        engines = [m.engine for m in members]
        if self.broadcast is not None:
            self.broadcast.send(engines, stream, version)
            for m, s in zip(members, self.broadcast.sync_s):
                m.sync_s = s
            return
        items = stream if len(members) == 1 else list(stream)  # one pass per engine
        for m in members:
            try:
                m.engine.update_weights(iter(items), version)
            except RESTARTABLE as exc:
                raise FleetSyncError(f"fleet engine {m.index} died in the weight sync of version "
                                     f"{version}: {type(exc).__name__}: {exc}", [m.index]) from exc
            m.sync_s = time.perf_counter() - start

    def _targeted(self) -> list[_Member]:
        return self._targets if self._targets is not None else self.members

    def _ask(self, m: _Member, call: Callable[[RolloutEngine], Any]) -> Any:
        """``call(m.engine)``, supervised outside a re-sync (inside, a death goes to the
        restart running it)."""
        return call(m.engine) if self._targets is not None else self._supervised(m, call)

    def held_checksums(self) -> dict[str, str]:
        """Engine 0's fingerprints, after checking every engine holds the same ones."""
        held = [self._ask(m, lambda e: e.held_checksums()) for m in self._targeted()]
        for m, h in zip(self._targeted()[1:], held[1:]):
            if h != held[0]:
                diff = next((k for k in held[0] if held[0][k] != h.get(k)), None)
                raise WeightSyncError(f"fleet engine {m.index} holds other weights than engine "
                                      f"{self._targeted()[0].index} (first: {diff!r})")
        return held[0]

    def verify(self, manifest: WeightManifest) -> None:
        """The manifest against every engine; an error names the engine and the tensor."""
        for m in self._targeted():
            try:
                manifest.compare(self._ask(m, lambda e: e.held_checksums()))
            except WeightSyncError as exc:
                raise WeightSyncError(f"fleet engine {m.index}: {exc}") from exc

    def weight_version(self) -> int:
        versions = {m.index: self._ask(m, lambda e: e.weight_version()) for m in self._targeted()}
        if len(set(versions.values())) > 1:
            raise WeightSyncError(f"fleet engines hold different weight versions: {versions}")
        return next(iter(versions.values()))

    # ---- generation --------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        g = self.group_size
        if not prompts or len(prompts) % g:
            raise ValueError(f"EngineFleet.generate: {len(prompts)} prompts are not whole "
                             f"prompt groups of {g} (--qrl-rollout-n-samples-per-prompt)")
        if self.released:
            self.resume_memory()
        self._calls += 1
        for m in self.members:
            m.tokens, m.groups, m.busy_s, m.queue_s = 0, 0, 0.0, 0.0
        base = sampling.seed if sampling.seed is not None else group_seed(-1, self._calls)
        groups = [prompts[k:k + g] for k in range(0, len(prompts), g)]
        results: list[GenerationOutput | None] = [None] * len(groups)
        queue = list(range(len(groups)))[::-1]
        errors: list[BaseException] = []
        start = time.perf_counter()

        def serve(m: _Member) -> None:
            while not errors:
                try:
                    k = queue.pop()
                except IndexError:
                    return
                t0 = time.perf_counter()
                m.queue_s += t0 - start
                try:
                    out = self._supervised(m, lambda e, k=k: e.generate(
                        groups[k], replace(sampling, seed=group_seed(base, k), group_size=0)))
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                    errors.append(exc)
                    return
                if out.weight_version != self._version:
                    errors.append(WeightSyncError(
                        f"fleet engine {m.index} generated with weight version "
                        f"{out.weight_version}, expected {self._version}"))
                    return
                m.busy_s += time.perf_counter() - t0
                m.tokens += int(out.mask.sum())
                m.groups += 1
                results[k] = out

        self._in_parallel(serve)
        if errors:
            raise errors[0]
        if self.colocated:
            self.release_memory()
        return merge_outputs(results)

    def _in_parallel(self, fn: Callable[[_Member], None]) -> None:
        """``fn(m)`` for every engine, one thread each; the first error is raised."""
        if len(self.members) == 1:
            fn(self.members[0])
            return
        errors: list[BaseException] = []

        def run(m: _Member) -> None:
            try:
                fn(m)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(m,), name=f"qrl-fleet-{m.index}",
                                    daemon=True) for m in self.members]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    # ---- metrics and lifecycle ---------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Per engine ``i``: tokens/s while generating, queue time (s from the rollout's start
        to each group's start, summed), last sync time (s), restarts, groups and tokens."""
        out: dict[str, float] = {}
        for m in self.members:
            p = f"fleet/engine{m.index}"
            out.update({f"{p}_tokens_per_s": m.tokens / m.busy_s if m.busy_s else 0.0,
                        f"{p}_queue_s": m.queue_s, f"{p}_sync_s": m.sync_s,
                        f"{p}_restarts": float(m.restarts), f"{p}_groups": float(m.groups),
                        f"{p}_tokens": float(m.tokens)})
        return out

    def release_memory(self) -> None:
        # a dead engine is restarted (and re-synced) here too: its node may have left
        self._in_parallel(lambda m: self._supervised(m, lambda e: e.release_memory()))
        self.released = True

    def resume_memory(self) -> None:
        # a restarted engine starts resumed; resume_memory is a no-op for it
        self._in_parallel(lambda m: self._supervised(m, lambda e: e.resume_memory()))
        self.released = False

    def shutdown(self) -> None:
        for m in self.members:
            try:
                m.engine.shutdown()
            except Exception as exc:  # noqa: BLE001 - shut the others down anyway
                log.debug("shutdown of fleet engine %d failed: %s", m.index, exc)
        if self.broadcast is not None:
            self.broadcast.close()
