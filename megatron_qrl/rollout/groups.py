"""Prompt groups of a rollout: their seeds and the merge of their outputs.

A batch of ``G`` prompt groups of ``g`` rows each, sampled with seed ``s``, samples group ``k``
from :func:`group_seed` ``(s, k)`` whatever engine, and however many engines, serve it
(``SamplingParams.group_size``; the fleet hands each engine one group at a time with that
seed, a single engine splits the batch itself). So the groups of one call are independent of
each other and of the batch they arrived in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from .base import GenerationOutput, SamplingParams
from .sampling import derive_seed

__all__ = ["generate_by_group", "group_seed", "merge_outputs"]


def group_seed(base: int, k: int) -> int:
    """The sampling seed of the ``k``-th prompt group of a call seeded ``base`` (a hash, so
    neighbouring groups and calls get unrelated streams; < 2**63)."""
    return derive_seed("group", base, k)


def _pad_cat(parts: Sequence[torch.Tensor], width: int, fill: float) -> torch.Tensor:
    rows = [torch.nn.functional.pad(p, (0, width - p.shape[1]) + (0, 0) * (p.dim() - 2)
                                    if p.dim() == 2 else
                                    (0, 0) * (p.dim() - 2) + (0, width - p.shape[1]), value=fill)
            for p in parts]
    return torch.cat(rows)


def merge_outputs(outs: Sequence[GenerationOutput]) -> GenerationOutput:
    """The outputs of consecutive prompt groups as one output (right-padded to the longest)."""
    t = max(o.output_ids.shape[1] for o in outs)
    routed = None
    if outs[0].routed_experts is not None:
        width = max(o.routed_experts.shape[1] for o in outs)
        routed = _pad_cat([o.routed_experts for o in outs], width, -1)
    return GenerationOutput(
        [p for o in outs for p in o.prompt_ids], _pad_cat([o.output_ids for o in outs], t, 0),
        _pad_cat([o.logprobs for o in outs], t, 0.0), _pad_cat([o.mask for o in outs], t, False),
        [r for o in outs for r in o.finish_reasons], outs[0].weight_version, routed)


def generate_by_group(generate: Callable[[list[list[int]], SamplingParams], GenerationOutput],
                      prompts: list[list[int]], sampling: SamplingParams
                      ) -> GenerationOutput | None:
    """``generate`` once per prompt group, group ``k`` seeded :func:`group_seed` ``(seed,
    k)``, the outputs merged; None when ``sampling`` names no groups (``group_size`` 0) or no
    seed (then the caller samples the batch as one)."""
    g = sampling.group_size
    if not g or sampling.seed is None:
        return None
    if len(prompts) % g:
        raise ValueError(f"generate: {len(prompts)} prompts are not whole prompt groups of "
                         f"{g} (SamplingParams.group_size)")
    return merge_outputs([generate(prompts[i:i + g], replace(
        sampling, seed=group_seed(sampling.seed, i // g), group_size=0))
        for i in range(0, len(prompts), g)])
