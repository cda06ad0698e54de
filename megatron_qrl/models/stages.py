"""Pipeline stages of a megatron-core GPTModel: which layers a stage holds and their HF names.

Under pipeline parallelism (``--pipeline-model-parallel-size`` P) megatron-core builds on
pipeline rank ``r`` the decoder layers ``[r * L / P, (r + 1) * L / P)`` under LOCAL names
``decoder.layers.{0 .. L/P - 1}`` (each layer's ``layer_number`` is global); the first stage
holds the embedding, the last the final norm and the output layer. With tied embeddings
(``tie_word_embeddings``) the last stage holds a copy of the word embeddings as
``output_layer.weight``, kept equal to the first stage's by megatron-core (initial
all-reduce, gradients summed over the embedding group in ``finalize_model_grads``).

:class:`PipelineStage` says where this rank's stage sits; :func:`global_name` turns a local
parameter name into the name the whole model would give it, which the one HF name map
(``models.mapping``) reads; :func:`whole_model_state` joins the stages' state dicts into the
one-stage model's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PipelineStage", "global_name", "is_tied_output_copy", "whole_model_state"]

_LAYER = re.compile(r"^((?:module\.)*decoder\.layers\.)(\d+)(\..+)$")


@dataclass(frozen=True)
class PipelineStage:
    """This rank's pipeline stage (the defaults: the whole model, no pipeline)."""

    rank: int = 0
    """Pipeline rank (0 holds the embedding)."""
    size: int = 1
    """Pipeline-parallel size."""
    layer_offset: int = 0
    """Global index of this stage's first decoder layer."""
    group: Any = None
    """The pipeline-parallel process group (None: one stage)."""

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @classmethod
    def of(cls, rank: int, size: int, num_layers: int, group: Any = None) -> PipelineStage:
        """Stage ``rank`` of ``size`` even stages of a ``num_layers``-layer model."""
        if num_layers % size:
            raise ValueError(f"--pipeline-model-parallel-size {size} must divide the model's "
                             f"{num_layers} layers")
        return cls(rank, size, rank * (num_layers // size), group)


def global_name(name: str, stage: PipelineStage | None) -> str:
    """``name`` with its local decoder-layer index made global (unchanged without a pipeline)."""
    if stage is None or stage.layer_offset == 0:
        return name
    m = _LAYER.match(name)
    return name if m is None else f"{m.group(1)}{int(m.group(2)) + stage.layer_offset}{m.group(3)}"


def is_tied_output_copy(name: str, tied: bool, stage: PipelineStage | None) -> bool:
    """True for the last stage's copy of tied word embeddings (not a weight of its own)."""
    return tied and stage is not None and not stage.first and \
        re.sub(r"^(?:module\.)+", "", name) == "output_layer.weight"


def whole_model_state(stage_states: Sequence[Mapping[str, torch.Tensor]], num_layers: int,
                      tied: bool) -> dict[str, torch.Tensor]:
    """The one-stage model's state dict from each stage's (``stage_states[s]``: pipeline
    rank ``s``'s ``state_dict()``, local layer indices): decoder-layer indices made global,
    the last stage's copy of tied word embeddings left out. Raises ValueError where two
    stages disagree on a tensor both hold (the tied copy, or one outside the layers)."""
    size, out = len(stage_states), {}
    for rank, state in enumerate(stage_states):
        stage = PipelineStage.of(rank, size, num_layers)
        for key, value in state.items():
            name = "embedding.word_embeddings.weight" if is_tied_output_copy(
                key, tied, stage) else global_name(key, stage)
            if name in out and not torch.equal(out[name], value):
                raise ValueError(f"pipeline stage {rank}'s {key} differs from an earlier stage's "
                                 f"{name}: the checkpoint's stages do not hold one model")
            out.setdefault(name, value)
    return out
