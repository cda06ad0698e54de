"""Single mode: the trainer's cached free GPU blocks go back before the engine resumes."""

from __future__ import annotations

import torch

from megatron_qrl.config import QrlConfigs
from megatron_qrl.rl.steps import StepContext


class _Engine:
    def __init__(self, log: list) -> None:
        self.log = log

    def release_memory(self) -> None:
        self.log.append("release")

    def resume_memory(self) -> None:
        self.log.append("resume")


def _ctx(log: list, release: bool) -> StepContext:
    return StepContext(configs=QrlConfigs(), tokenizer=None, records=[], trainer=None,
                       engine=_Engine(log), plan=None, loss_fn=None, sync=None,
                       release_engine_memory=release)


def test_empty_cache_runs_before_the_resume_only(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty_cache"))
    ctx = _ctx(log, True)
    ctx.engine_memory(release=True)
    ctx.engine_memory(release=False)
    assert log == ["release", "empty_cache", "resume"]
    log.clear()
    _ctx(log, False).engine_memory(release=False)  # the engine keeps its memory: nothing
    assert log == []
