"""Keep a rollout step alive across engine crashes: restart, re-sync, retry.

If an engine process dies mid-generation (OOM, a NCCL fault, a killed worker), the
supervisor shuts down what is left of it, starts a new one from the factory, re-syncs the
CURRENT weights through the ``resync`` callback (the driver re-packs them from the trainer,
so the new engine holds exactly the version the step was sampled with) and retries the whole
``generate`` call. Nothing from a failed attempt is returned: a step's batch comes from one
complete call on one engine at the expected weight version.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from .base import GenerationOutput, RolloutEngine, SamplingParams, WeightSyncError

log = logging.getLogger(__name__)


class EngineDiedError(RuntimeError):
    """The engine's process is gone; restarting it is the remedy."""


# what counts as a dead engine (in-process engines raise EngineDiedError; remote ones lose
# their connection)
RESTARTABLE = (EngineDiedError, ConnectionError, EOFError, BrokenPipeError)


class EngineSupervisor(RolloutEngine):
    """A :class:`RolloutEngine` that restarts its inner engine when it dies."""

    def __init__(self, factory: Callable[[], RolloutEngine],
                 resync: Callable[[RolloutEngine, int], None], max_restarts: int = 2):
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.factory, self.resync, self.max_restarts = factory, resync, max_restarts
        self.engine = factory()
        self.restarts = 0
        self._version = -1

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.engine.update_weights(named_tensors, version)
        self._version = version

    def held_checksums(self) -> dict[str, str]:
        return self.engine.held_checksums()

    def weight_version(self) -> int:
        return self.engine.weight_version()

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        failures: list[str] = []
        for attempt in range(self.max_restarts + 1):
            try:
                out = self.engine.generate(prompts, sampling)
            except RESTARTABLE as exc:
                failures.append(f"attempt {attempt + 1}: {type(exc).__name__}: {exc}")
                log.warning("rollout engine died (%s); restarting and re-syncing version %d",
                            exc, self._version)
                if attempt < self.max_restarts:
                    self._restart()
                continue
            if out.weight_version != self._version:
                raise WeightSyncError(f"engine generated with weight version {out.weight_version}, "
                                      f"expected {self._version}")
            return out
        raise EngineDiedError(f"rollout engine died {len(failures)} times in one step, giving "
                              f"up (max_restarts={self.max_restarts}): {'; '.join(failures)}")

    def _restart(self) -> None:
        try:
            self.engine.shutdown()
        except Exception as exc:  # the dead engine may not shut down cleanly
            log.debug("shutdown of the dead engine failed: %s", exc)
        self.engine = self.factory()
        self.restarts += 1
        self.resync(self.engine, self._version)
        if self.engine.weight_version() != self._version:
            raise WeightSyncError(f"re-sync after restart left version "
                                  f"{self.engine.weight_version()}, expected {self._version}")

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def shutdown(self) -> None:
        self.engine.shutdown()
