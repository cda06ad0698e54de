"""Driver checkpoints: atomic, checksummed, verified on load, tied to the run's identity.

A checkpoint is ``<output-dir>/checkpoints/step_<NNNNNN>.pt``: ``next_step`` (global step to
run next), the model and optimizer state, the torch RNG state, the effective ``--qrl-*``
values (``flags``) and the model's HF config (``model_config``, the shape the Megatron flags
made). Every step draws its randomness from ``(seed, step)`` (see ``steps.step_seed``), so
restoring this state reproduces the next step exactly on CPU.

Integrity: next to each ``.pt`` a ``.pt.sha256`` holds its SHA-256 in ``sha256sum`` format
(``sha256sum -c step_000010.pt.sha256`` checks it by hand). A save writes the ``.pt`` under a
temporary name, hashes it, writes the checksum, renames the ``.pt`` into place and hashes it
again from disk; only then are older checkpoints pruned (the newest ``keep`` stay). A resume
takes the newest checkpoint whose bytes match its checksum; each newer damaged one (bit flips,
truncation, no checksum) is reported in one line, and the next save renames it
``*.damaged`` so it is never taken for the latest again.

Identity: a resume compares the stored flags (less :func:`resume_keys_ignored`) and model
config with this run's; any difference is ONE error naming every differing flag (model-config
fields by the Megatron flag that sets them, e.g. ``--moe-router-topk``).

Output directory (:func:`prepare_output_dir`, at start): stale temporary files of
interrupted writes are removed; a directory holding a run (metrics or checkpoints) is refused
unless ``--qrl-resume``, and so is a non-empty directory holding nothing of a run (no metrics,
checkpoints or qrl-train marker: a directory a user cares about); a run marks its directory
(``utils.outdir.MARKER_NAME``, tool ``qrl-train``); ``--qrl-resume`` on a run that stopped
before its first checkpoint starts it again from step 0.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_qrl import __version__
from megatron_qrl.config import QrlArgumentError
from megatron_qrl.utils.disk import disk_full_as_one_line
from megatron_qrl.utils.io import atomic_write_json, atomic_write_text
from megatron_qrl.utils.outdir import MARKER_NAME, read_marker
from megatron_qrl.utils.run_lock import LOCK_NAME

__all__ = ["CKPT_DIR", "DriverCheckpointError", "checkpoint_problem", "latest_checkpoint",
           "load_driver_checkpoint", "model_state_of", "prepare_output_dir",
           "save_driver_checkpoint"]

CKPT_DIR = "checkpoints"
TOOL = "qrl-train"
"""The ``tool`` of the output-directory marker a run writes."""
SUM_SUFFIX = ".sha256"
_NAME = re.compile(r"^step_(\d{6,})\.pt$")
_STALE = re.compile(r"^\..+\.(tmp|old)-")
"""Leftovers of an interrupted atomic write (``utils.io``: ``.<name>.tmp-*`` / ``.old-*``)."""
_RUN_FILES = ("metrics.jsonl",)


def resume_keys_ignored() -> frozenset[str]:
    """The flags that may differ between a run and its resumption: those whose config field
    says so (``{"on_resume": "may change"}``: run length, saving, resume itself, how the same
    weights reach the engine, the waits, where pi_prox's log-probs are computed — the first
    update's forward or a recompute pass give the same values — and the MoE expert path,
    whose grouped and sequential experts hold the same weights under the same names)."""
    from megatron_qrl.config.args import default_config_classes
    from megatron_qrl.config.generator import flag_specs

    return frozenset(s.dest for g in default_config_classes() for s in flag_specs(g)
                     if s.may_change_on_resume)


_CHUNK = 1 << 24


class DriverCheckpointError(ValueError):
    """No usable checkpoint (all damaged, or one that does not load); names the files."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sum_path(path: Path) -> Path:
    return path.with_name(path.name + SUM_SUFFIX)


def checkpoint_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be trusted (missing / malformed checksum, bytes that differ from
    it: bit flips, truncation), or None when it is intact."""
    path = Path(path)
    sum_file = _sum_path(path)
    if not sum_file.is_file():
        return (f"no checksum file {sum_file.name} (an interrupted save, or written before "
                f"checksums: `sha256sum {path.name} > {sum_file.name}` vouches for it)")
    want = sum_file.read_text(errors="replace").split()
    if not want or not re.fullmatch(r"[0-9a-f]{64}", want[0]):
        return f"malformed checksum file {sum_file.name}"
    if _sha256(path) != want[0]:
        return f"damaged: its bytes do not match {sum_file.name} (bit flips or truncation)"
    return None


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)))


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested dicts / lists / tuples (the checkpoint's bulk)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def save_driver_checkpoint(output_dir: str | Path, next_step: int, trainer_state: dict,
                           flags: dict[str, Any], keep: int = 2,
                           rank_states: list[dict] | None = None,
                           model_config: dict | None = None) -> Path:
    """Write and verify the checkpoint for ``next_step``, then keep the newest ``keep``.

    ``rank_states``: every rank's trainer state of a multi-rank job (rank order), stored
    in the same file so that a checkpoint is complete or absent, never partial.
    ``model_config``: the model's HF config (part of the run's identity).
    """
    root = Path(output_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"step_{next_step:06d}.pt"
    state = {"next_step": next_step, "trainer": trainer_state, "rng": torch.get_rng_state(),
             "flags": flags}
    if model_config is not None:
        state["model_config"] = model_config
    if rank_states is not None:
        state["rank_states"] = rank_states
    tmp = root / f".{path.name}.tmp-{os.getpid()}"
    need = sum(t.numel() * t.element_size() for t in _tensors(state))
    with disk_full_as_one_line(output_dir, "--qrl-output-dir", need):
        try:
            with open(tmp, "wb") as fh:
                torch.save(state, fh)
                fh.flush()
                os.fsync(fh.fileno())
            digest = _sha256(tmp)
            atomic_write_text(_sum_path(path), f"{digest}  {path.name}\n")
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
    if _sha256(path) != digest:
        raise OSError(f"{path}: the bytes read back differ from the bytes written; the disk "
                      "or filesystem is failing (older checkpoints were kept)")
    for step, old in _checkpoints(root):
        if step > next_step and checkpoint_problem(old):  # skipped by a resume: never
            # the latest again
            os.replace(old, old.with_name(old.name + ".damaged"))
            if _sum_path(old).exists():
                os.replace(_sum_path(old), old.with_name(old.name + ".damaged" + SUM_SUFFIX))
    for _, old in [c for c in _checkpoints(root) if c[0] <= next_step][:-keep]:
        old.unlink()
        _sum_path(old).unlink(missing_ok=True)
    return path


def model_state_of(state: dict, path: str | Path, arch: Any) -> dict[str, torch.Tensor]:
    """The whole model's trainer state dict in a driver checkpoint ``state`` (read from
    ``path``; ``arch``: the run's ``ModelArch``): rank 0's of a one-process run; a
    pipeline-parallel run's stages joined (``models.stages.whole_model_state``; one rank a
    stage, data-parallel replicas hold the same weights). A tensor / expert-parallel run's
    shards are refused in one line naming its layout."""
    from megatron.core.parallel_state import RankGenerator

    from megatron_qrl.models.stages import whole_model_state

    ranks = state.get("rank_states")
    if not ranks:
        return state["trainer"]["model"]
    layout = state["flags"].get("megatron_layout", "")
    sizes = dict(p.split("=", 1) for p in layout.split(",") if "=" in p)
    sharded = [f"{k}={v}" for k, v in sizes.items() if k in ("tp", "ep", "etp") and v != "1"]
    if sharded:
        raise ValueError(f"{path}: written by a run with {', '.join(sharded)} ({layout}); its "
                         "tensor / expert-parallel shards are not joined into one model here "
                         "(pipeline stages and data-parallel replicas are): use a checkpoint "
                         "of a run with --tensor-model-parallel-size 1 "
                         "--expert-model-parallel-size 1")
    pp = int(sizes.get("pp", 1))
    first = RankGenerator(tp=1, ep=1, dp=len(ranks) // pp, pp=pp, cp=1,
                          order="tp-cp-ep-dp-pp").get_ranks("pp")[0]  # megatron's rank order
    return whole_model_state([ranks[r]["model"] for r in first], arch.num_layers,
                             arch.tie_word_embeddings)


def latest_checkpoint(output_dir: str | Path,
                      report: Callable[[str], None] | None = None) -> Path | None:
    """The intact checkpoint with the largest step in ``output_dir`` (None if there is
    none); ``report`` gets one line per newer checkpoint that was skipped as damaged."""
    for _, path in reversed(_checkpoints(Path(output_dir) / CKPT_DIR)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if report is not None:
            report(f"[qrl-train] checkpoint {path} skipped: {problem}")
    return None


def _identity_diffs(state: dict, flags: dict[str, Any], model_config: dict | None) -> list[str]:
    from megatron_qrl.config.megatron_flags import flag_for_hf_key

    saved = state.get("flags", {})
    ignored = resume_keys_ignored()
    diffs = [f"--{k.replace('_', '-')} {saved[k]!r} -> {flags[k]!r}" for k in flags
             if k not in ignored and k in saved and saved[k] != flags[k]]
    old = state.get("model_config")
    if old is not None and model_config is not None:
        for key in sorted(set(old) | set(model_config)):
            if old.get(key) != model_config.get(key):
                name = flag_for_hf_key(key) or f"model config {key}"
                diffs.append(f"{name} {old.get(key)!r} -> {model_config.get(key)!r}")
    return diffs


def load_driver_checkpoint(output_dir: str | Path, flags: dict[str, Any],
                           model_config: dict | None = None,
                           report: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The newest intact checkpoint's content (see the module docstring).

    Raises ``FileNotFoundError`` when there is no checkpoint, :class:`DriverCheckpointError`
    when none is intact or the intact one does not load, :class:`QrlArgumentError` naming
    every flag that differs from the checkpoint's run.
    """
    root = Path(output_dir) / CKPT_DIR
    found = _checkpoints(root)
    if not found:
        raise FileNotFoundError(f"--qrl-resume: no checkpoint in {root}; run without "
                                "--qrl-resume first (or check --qrl-output-dir)")
    path = latest_checkpoint(output_dir, report)
    if path is None:
        raise DriverCheckpointError(
            f"--qrl-resume: no intact checkpoint in {root} ({len(found)} damaged: "
            f"{', '.join(p.name for _, p in found)}); restore one from a copy, or start the "
            "run again in a new --qrl-output-dir")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure: the file is unusable
        raise DriverCheckpointError(f"--qrl-resume: {path} matches its checksum but does not "
                                    f"load ({type(exc).__name__}: {exc})") from None
    diffs = _identity_diffs(state, flags, model_config)
    if diffs:
        raise QrlArgumentError(f"--qrl-resume: {path} was written by a run with other flags "
                               f"({', '.join(diffs)}); resume with the same flags or use "
                               "another --qrl-output-dir")
    return state


def _remove_stale(d: Path) -> None:
    """Delete leftovers of interrupted writes in ``d``: temporary files / directories and
    checksums whose checkpoint was never renamed into place."""
    for p in d.iterdir() if d.is_dir() else ():
        orphan_sum = p.name.endswith(SUM_SUFFIX) and _NAME.match(p.with_suffix("").name) \
            and not p.with_suffix("").exists()
        if p.is_dir() and not p.is_symlink() and _STALE.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
        elif _STALE.match(p.name) or orphan_sum:
            p.unlink(missing_ok=True)


def _foreign(out: Path) -> bool:
    """``out`` is a non-empty directory with nothing of a qrl-train run in it (no marker,
    no ``metrics.jsonl``, no ``checkpoints/``)."""
    return out.is_dir() and read_marker(out) is None and not any(
        (out / f).exists() for f in (*_RUN_FILES, CKPT_DIR)) and any(
        p.name != LOCK_NAME for p in out.iterdir())


def prepare_output_dir(output_dir: str | Path, resume: bool) -> bool:
    """Clean stale temporary files and decide how the run starts: True = resume from a
    checkpoint, False = start at step 0 (see the module docstring). Marks the directory as a
    qrl-train output (:data:`~megatron_qrl.utils.outdir.MARKER_NAME`)."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--qrl-output-dir {out} is a file, not a directory; choose "
                              "another --qrl-output-dir")
    if not resume and _foreign(out):  # before any clean-up: nothing of it is ours
        raise FileExistsError(f"--qrl-output-dir {out} is not empty and holds no qrl-train "
                              f"run (no metrics.jsonl, {CKPT_DIR}/ or {MARKER_NAME}); choose a "
                              "new or empty --qrl-output-dir")
    _remove_stale(out)
    _remove_stale(out / CKPT_DIR)
    has_ckpt = bool(_checkpoints(out / CKPT_DIR))
    used = has_ckpt or any((out / f).is_file() and (out / f).stat().st_size for f in _RUN_FILES)
    if resume and not out.is_dir():
        raise FileNotFoundError(f"--qrl-resume: {out} does not exist; check --qrl-output-dir "
                                "(or drop --qrl-resume to start a new run)")
    if not resume and used:
        raise FileExistsError(f"--qrl-output-dir {out} holds a run (metrics.jsonl or "
                              f"{CKPT_DIR}/): continue it with --qrl-resume, or choose "
                              "another --qrl-output-dir")
    if read_marker(out) is None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / MARKER_NAME, {"tool": TOOL, "version": __version__})
    return resume and has_ckpt
