"""Atomic driver checkpoints and ``--qrl-resume``.

A checkpoint is ``<output-dir>/checkpoints/step_<NNNNNN>.pt`` (written to a temporary file
and renamed): ``next_step`` (global step to run next), the model and optimizer state, the
torch RNG state and the effective ``--qrl-*`` values it was made with. Every step draws its
randomness from ``(seed, step)`` (see ``steps.step_seed``), so restoring this state
reproduces the next step exactly on CPU.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from megatron_qrl.config import QrlArgumentError
from megatron_qrl.utils.io import atomic_torch_save

__all__ = ["CKPT_DIR", "latest_checkpoint", "load_driver_checkpoint", "save_driver_checkpoint"]

CKPT_DIR = "checkpoints"
_NAME = re.compile(r"^step_(\d{6,})\.pt$")
_RESUME_KEYS_IGNORED = ("qrl_resume", "qrl_steps", "qrl_save_interval", "qrl_output_dir",
                        "qrl_tensorboard", "qrl_tensorboard_dir", "qrl_rollout_sglang_sync",
                        "qrl_rollout_sglang_sync_dir", "qrl_rollout_sglang_base_gpu",
                        "qrl_rollout_sglang_flat_buckets", "qrl_rollout_sglang_prefetch_buckets",
                        "qrl_rollout_sglang_direct_expert_loads",
                        "qrl_rollout_sglang_stack_experts", "qrl_rollout_sglang_receipt",
                        "qrl_ray_weight_transport", "qrl_ray_weight_timeout_s",
                        "qrl_engine_max_restarts")
"""Flags that may differ between a run and its resumption (run length, saving, resume, and
how the same weights reach the engine)."""


def save_driver_checkpoint(output_dir: str | Path, next_step: int, trainer_state: dict,
                           flags: dict[str, Any], keep: int = 2,
                           rank_states: list[dict] | None = None) -> Path:
    """Write the checkpoint for ``next_step`` atomically; keep the newest ``keep``.

    ``rank_states``: every rank's trainer state of a multi-rank job (rank order), stored
    in the same file so that a checkpoint is complete or absent, never partial.
    """
    root = Path(output_dir) / CKPT_DIR
    path = root / f"step_{next_step:06d}.pt"
    state = {"next_step": next_step, "trainer": trainer_state, "rng": torch.get_rng_state(),
             "flags": flags}
    if rank_states is not None:
        state["rank_states"] = rank_states
    atomic_torch_save(state, path)
    for old in sorted(p for p in root.iterdir() if _NAME.match(p.name))[:-keep]:
        old.unlink()
    return path


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint with the largest step in ``output_dir`` (None if there is none)."""
    root = Path(output_dir) / CKPT_DIR
    if not root.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)))
    return found[-1][1] if found else None


def load_driver_checkpoint(output_dir: str | Path, flags: dict[str, Any]) -> dict[str, Any]:
    """The latest checkpoint's content; errors name the directory / the flag that changed."""
    path = latest_checkpoint(output_dir)
    if path is None:
        raise FileNotFoundError(f"--qrl-resume: no checkpoint in {Path(output_dir) / CKPT_DIR}; "
                                "run without --qrl-resume first (or check --qrl-output-dir)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    saved = state.get("flags", {})
    changed = [k for k in flags if k not in _RESUME_KEYS_IGNORED and k in saved
               and saved[k] != flags[k]]
    if changed:
        diffs = ", ".join(f"--{k.replace('_', '-')} {saved[k]!r} -> {flags[k]!r}" for k in changed)
        raise QrlArgumentError(f"--qrl-resume: {path} was written with other flags ({diffs}); resume "
                         "with the same flags or use another --qrl-output-dir")
    return state
