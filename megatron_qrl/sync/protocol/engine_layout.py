"""The engine's parameter storage in its own layout, as the trainer's direct writer and the
engine's read-back agree on it. Imported on both sides of the process boundary; runs nothing
but name and view arithmetic.

The engine (:mod:`megatron_qrl.rollout_sglang.sync.loader.storage`) describes each live
parameter it holds — fused ``qkv_proj`` / ``gate_up_proj`` weights and scales, stacked
``w13_*`` / ``w2_*`` experts, norms, embeddings — as a :class:`ParamLayout`: its checkpoint
view (the live tensor, or its transpose where the engine keeps ``weight.t()``) and the rows
each fused member owns. :func:`locate` maps a packed HF tensor name (what
``QuantSpec.pack_state_dict`` emits, per expert or expert-stacked) to its engine parameter
and rows; :func:`view` cuts that region out of the parameter. Both sides call the same two
functions, so what the trainer writes and what the engine reads back are the same bytes.

Requests to the engine's storage service travel as the control tensor of an
``update_weights_from_tensor`` call with ``load_format`` = :data:`STORAGE`:
``{"what": "export" | "fingerprint" | "digest", "out": path, "names": {name: shape}}``;
the answer is the file ``out.<pid>``, or ``out.<pid>`` + :data:`ERROR` where the request
failed in the engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from ...utils import hf_names
from ...utils.hf_names import FUSED, STACKED
from . import marlin

__all__ = ["ERROR", "STORAGE", "EngineLayout", "EngineLayoutError", "ParamLayout", "Target", "locate",
           "view"]

STORAGE = "megatron_qrl.rollout_sglang.sync.loader.storage.serve"
"""The ``custom_weight_loader`` / ``load_format`` entry of the engine's storage service."""
ERROR = ".error"
"""Suffix of a failed request's answer file: JSON ``{"error": class name, "message": ...}``
(the engine's scheduler answers the failure instead of raising it, which would end it)."""

_MOE = {"gate_proj": "w13_", "up_proj": "w13_", "down_proj": "w2_"}
"""An expert projection -> the prefix of its ``FusedMoE`` parameter (``make_expert_params_mapping``)."""


class EngineLayoutError(ValueError):
    """A packed tensor has no place in the engine's storage (names the tensor and the fix)."""


class HeldTensorError(RuntimeError):
    """The direct sync written by the engine named a trainer tensor the engine does not hold,
    or holds as something other than the trainer's memory (its fingerprint differs): answered
    before anything of the request was written, so the trainer can send it again with every
    handle."""


@dataclass(frozen=True)
class ParamLayout:
    """One live engine parameter, seen in its checkpoint layout."""

    shape: tuple[int, ...]
    """Shape of the checkpoint view (``[out, in]``; ``[E, rows, cols]`` for experts)."""
    dtype: str
    transposed: bool = False
    """The live tensor is the transpose of the checkpoint view (SGLang's w8a8 linears keep
    ``weight.t()``); writes go through ``live.t()``."""
    experts: bool = False
    """Dim 0 indexes experts; member rows are along dim 1."""
    shards: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Fused member (``q_proj``, ``gate_proj``, ...) -> its rows ``[start, stop)`` of the
    checkpoint view (in blocks for a block-scale tensor); empty: not fused."""
    marlin: str = ""
    """The engine keeps this parameter in SGLang's Marlin layout (:mod:`.marlin`): ``codes``
    (``weight_packed`` repacked), ``scales`` / ``scales_single`` (``weight_scale`` transposed
    and permuted in runs of 64 / 8); ``shape`` is then the checkpoint's, the tensor handed out
    is the live one, and a member's rows ``[s, e)`` are its live columns ``[2s, 2e)`` (codes)
    or ``[s, e)`` (scales). Empty: the tensor is a checkpoint view."""


@dataclass(frozen=True)
class EngineLayout:
    """Every live parameter of one engine process, and where its storage was."""

    params: dict[str, ParamLayout]
    fingerprint: str
    """Storage addresses of the parameters (:func:`~megatron_qrl.rollout_sglang.sync.
    loader.live_storage.storage_fingerprint`): a change means the handles are stale."""

    def to_json(self) -> str:
        return json.dumps({"fingerprint": self.fingerprint,
                           "params": {n: asdict(p) for n, p in self.params.items()}})

    @classmethod
    def from_json(cls, text: str) -> EngineLayout:
        d = json.loads(text)
        params = {n: ParamLayout(tuple(p["shape"]), p["dtype"], p["transposed"], p["experts"],
                                 {k: tuple(v) for k, v in p["shards"].items()},
                                 p.get("marlin", ""))
                  for n, p in d["params"].items()}
        return cls(params, d["fingerprint"])


@dataclass(frozen=True)
class Target:
    """Where one packed tensor goes: engine parameter, expert (int, ``"*"`` or None), rows."""

    param: str
    expert: int | str | None
    rows: tuple[int, int] | None


def locate(layout: EngineLayout, name: str) -> Target:
    """The engine region of packed tensor ``name`` (module docstring); raises
    :class:`EngineLayoutError` naming the tensor where the engine has no such region."""
    p = hf_names.parse(name)
    if p is None:
        param, member, expert = name, None, None
    elif p.expert is not None:
        param, member, expert = f"{p.experts_module}.{_MOE[p.proj]}{p.leaf}", p.proj, p.expert
        if p.proj == "down_proj":
            member = None
    else:
        param, expert = f"{p.engine_module}.{p.leaf}", None
        member = p.proj if p.proj in FUSED else None
    pl = layout.params.get(param)
    if pl is None:
        raise EngineLayoutError(
            f"direct weight sync: tensor {name!r} has no engine parameter {param!r} (the engine "
            "was started from another model or format); use --qrl-rollout-sglang-sync inplace")
    rows = None
    if member is not None:
        rows = pl.shards.get(member)
        if rows is None:
            raise EngineLayoutError(
                f"direct weight sync: engine parameter {param!r} has no rows for {member} "
                f"(its fused members: {sorted(pl.shards)}); tensor {name!r} cannot be placed")
    return Target(param, expert, rows)


def view(checkpoint: torch.Tensor, pl: ParamLayout, target: Target,
         shape: tuple[int, ...]) -> torch.Tensor:
    """The region of ``checkpoint`` (a parameter's checkpoint view) that a tensor of
    ``shape`` at ``target`` occupies; a plain parameter longer than the tensor (a padded
    vocabulary) gives its leading rows. Raises :class:`EngineLayoutError` on a shape mismatch."""
    if pl.marlin:
        return _marlin_view(checkpoint, pl, target, shape)
    v = checkpoint
    dim = 0
    if pl.experts:
        if target.expert == STACKED:
            dim = 1
        elif target.expert is not None:
            v = v[int(target.expert)]
    if target.rows is not None:
        v = v.narrow(dim, target.rows[0], target.rows[1] - target.rows[0])
    elif not pl.experts and v.dim() and len(shape) == v.dim() and shape[0] < v.shape[0]:
        v = v.narrow(0, 0, shape[0])
    if tuple(v.shape) != tuple(shape):
        raise EngineLayoutError(
            f"direct weight sync: {target.param} region {target.rows or 'whole'} is "
            f"{tuple(v.shape)} in the engine, the trainer sends {tuple(shape)}; the engine was "
            "started from another model shape")
    return v


def _marlin_view(live: torch.Tensor, pl: ParamLayout, target: Target,
                 shape: tuple[int, ...]) -> torch.Tensor:
    """:func:`view` of a Marlin parameter: the live region (see :attr:`ParamLayout.marlin`),
    whose checkpoint shape must be ``shape``."""
    v = live
    if pl.experts and target.expert not in (None, STACKED):
        v = v[int(target.expert)]
    if target.rows is not None:
        per = 2 if pl.marlin == "codes" else 1
        if any(r % marlin.TILE_N for r in target.rows):
            raise EngineLayoutError(
                f"direct weight sync: {target.param} rows {target.rows} are not 64-aligned; a "
                "member of a Marlin parameter must own whole 64-column tiles; use "
                "--qrl-rollout-sglang-sync inplace")
        v = v.narrow(-1, per * target.rows[0], per * (target.rows[1] - target.rows[0]))
    got = marlin.checkpoint_shape(pl.marlin, tuple(v.shape))
    if got != tuple(shape):
        raise EngineLayoutError(
            f"direct weight sync: {target.param} region {target.rows or 'whole'} is {got} in "
            f"the engine (Marlin {pl.marlin}), the trainer sends {tuple(shape)}; the engine was "
            "started from another model shape")
    return v
