"""megatron_qrl's verifiable reward as slime's custom reward function.

``--custom-rm-path megatron_qrl.integrations.slime.reward.qrl_math_reward`` (slime 0.3.1,
``slime/rollout/rm_hub/__init__.py``): slime awaits ``rm(args, sample)`` for one sample, or
``rm(args, samples)`` for a whole group with ``--group-rm``; either works here. The score is
:func:`megatron_qrl.rewards.score_math` of the sample's ``response`` against its ``label``
(slime's ``--label-key`` column; the prompts ``tools/make_random_checkpoint.py`` writes carry
the sum there): ``1.0`` for a correct final answer plus ``--qrl-task-format-bonus`` (default
0.1) for a readable one, so the values are ``{0, 0.1, 1.1}`` as in ``qrl-train`` (rlquant
study, seed 003; docs/ALGORITHMS.md section 4). A sample without a label is an error naming
``--label-key``.
"""

from __future__ import annotations

from typing import Any

from megatron_qrl.config import QrlArgumentError, TaskConfig


def _format_bonus(args: Any) -> float:
    """``--qrl-task-format-bonus`` from slime's args (the launcher's flag or a YAML key),
    checked by :class:`~megatron_qrl.config.TaskConfig`."""
    value = getattr(args, "qrl_task_format_bonus", None)
    if value is None:
        return TaskConfig().format_bonus
    try:
        return TaskConfig(format_bonus=float(value)).format_bonus
    except (TypeError, ValueError) as exc:
        raise QrlArgumentError(f"qrl reward in slime: {exc}") from None


def score_sample(sample: Any, format_bonus: float) -> float:
    """The reward of one slime ``Sample`` (its ``response`` text against its ``label``)."""
    from megatron_qrl.rewards import score_math

    if sample.label is None:
        raise QrlArgumentError("qrl reward in slime: a sample has no label; pass slime's "
                               "--label-key naming the answer column of --prompt-data "
                               "(`label` in the prompts tools/make_random_checkpoint.py writes)")
    return score_math(sample.response or "", str(sample.label), format_bonus).reward


async def qrl_math_reward(args: Any, sample: Any, **kwargs: Any) -> float | list[float]:
    """slime ``--custom-rm-path`` function: one ``Sample`` -> its reward; a list (``--group-rm``)
    -> the list of rewards."""
    bonus = _format_bonus(args)
    if isinstance(sample, list):
        return [score_sample(s, bonus) for s in sample]
    return score_sample(sample, bonus)
