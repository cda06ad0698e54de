"""Keep a rollout step alive across engine crashes: restart, re-sync, retry.

If an engine process dies (OOM, a NCCL fault, a killed worker) in any call — a weight
update, the verification read-back, ``generate`` — the supervisor shuts down what is left of
it, starts a new one from the factory and re-syncs through the ``resync`` callback (the
driver re-packs the trainer's CURRENT weights, so the new engine holds exactly the version
the step expects). Then:

* ``update_weights(stream, v)``: the stream was consumed by the dead engine, so the call is
  not repeated; the re-sync of ``v`` (a complete driver sync: pack, send, verify) has
  already loaded ``v`` on the new engine, and the call returns.
* ``held_checksums`` / ``weight_version`` / ``generate`` / ``resume_memory``: retried on the
  new engine.

Nothing from a failed attempt is kept: the new engine is a new process that only ever saw
the re-sync. A re-sync that itself dies is one more failure of the same call (it is never
re-entered recursively); after ``max_restarts`` restarts in one call the supervisor gives
up with :class:`EngineDiedError` listing every failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .base import GenerationOutput, RolloutEngine, SamplingParams, WeightSyncError
from .capacity import EngineCapacity

log = logging.getLogger(__name__)


class EngineDiedError(RuntimeError):
    """The engine's process is gone; restarting it is the remedy."""


# what counts as a dead engine (in-process engines raise EngineDiedError; remote ones lose
# their connection)
RESTARTABLE = (EngineDiedError, ConnectionError, EOFError, BrokenPipeError)


class EngineSupervisor(RolloutEngine):
    """A :class:`RolloutEngine` that restarts its inner engine when it dies.

    ``resync(engine, version)`` must bring ``engine`` (the new one, also reachable through
    ``self.engine``) to ``version``; it may call back into this supervisor (the Ray driver's
    sync goes through it): calls made during a re-sync are not supervised, a death there
    propagates to the restart that is running it.
    """

    def __init__(self, factory: Callable[[], RolloutEngine],
                 resync: Callable[[RolloutEngine, int], None], max_restarts: int = 2):
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.factory, self.resync, self.max_restarts = factory, resync, max_restarts
        self.engine = factory()
        self.restarts = 0
        self._version = -1
        self._resyncing = False

    def _supervised(self, what: str, call: Callable[[], Any], retry: bool = True) -> Any:
        """``call()`` on the current engine; on death restart + re-sync, then retry it
        (``retry``) or return None (the re-sync did the call's work)."""
        if self._resyncing:  # inside a re-sync: the restart running it counts the failure
            return call()
        failures: list[str] = []
        while True:
            try:
                return call()
            except RESTARTABLE as exc:
                failures.append(f"attempt {len(failures) + 1} ({what}): "
                                f"{type(exc).__name__}: {exc}")
            # the engine is dead: restart until one re-sync completes (or give up)
            while True:
                if len(failures) > self.max_restarts:
                    raise EngineDiedError(
                        f"rollout engine died {len(failures)} times in one {what} call, giving "
                        f"up (max_restarts={self.max_restarts}): {'; '.join(failures)}")
                log.warning("rollout engine died in %s (%s); restarting and re-syncing "
                            "version %d", what, failures[-1], self._version)
                try:
                    self._restart()
                    break
                except RESTARTABLE as exc:
                    failures.append(f"attempt {len(failures) + 1} (re-sync of version "
                                    f"{self._version}): {type(exc).__name__}: {exc}")
            if not retry:
                return None

    def _restart(self) -> None:
        try:
            self.engine.shutdown()
        except Exception as exc:  # the dead engine may not shut down cleanly
            log.debug("shutdown of the dead engine failed: %s", exc)
        self.engine = self.factory()
        self.restarts += 1
        self._resyncing = True
        try:
            self.resync(self.engine, self._version)
            held = self.engine.weight_version()
        finally:
            self._resyncing = False
        if held != self._version:
            raise WeightSyncError(f"re-sync after restart left version {held}, "
                                  f"expected {self._version}")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self._version = version  # a re-sync after a death here re-sends this version
        self._supervised("update_weights",
                         lambda: self.engine.update_weights(named_tensors, version), retry=False)

    @property
    def verifies_own_update(self) -> bool:  # the inner engine's (see RolloutEngine)
        return self.engine.verifies_own_update

    @property
    def stacked_experts(self) -> bool:  # the inner engine's (see RolloutEngine)
        return self.engine.stacked_experts

    @property
    def quantizes_into(self) -> bool:  # the inner engine's (see RolloutEngine)
        return self.engine.quantizes_into

    @property
    def reshares_stream(self) -> bool:  # the inner engine's (see RolloutEngine)
        return self.engine.reshares_stream

    @property
    def holds_stream_tensors(self) -> bool:  # the inner engine's (see RolloutEngine)
        return self.engine.holds_stream_tensors

    @property
    def last_sync(self) -> dict | None:  # the inner engine's account (see RolloutEngine)
        return getattr(self.engine, "last_sync", None)

    def held_checksums(self) -> dict[str, str]:
        return self._supervised("held_checksums", lambda: self.engine.held_checksums())

    def weight_version(self) -> int:
        return self._supervised("weight_version", lambda: self.engine.weight_version())

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        out = self._supervised("generate", lambda: self.engine.generate(prompts, sampling))
        if out.weight_version != self._version:
            raise WeightSyncError(f"engine generated with weight version {out.weight_version}, "
                                  f"expected {self._version}")
        return out

    def capacity(self) -> EngineCapacity | None:
        return self.engine.capacity()

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        # a new engine starts resumed: after a restart there is nothing left to resume
        self._supervised("resume_memory", lambda: self.engine.resume_memory(), retry=False)

    def shutdown(self) -> None:
        self.engine.shutdown()
