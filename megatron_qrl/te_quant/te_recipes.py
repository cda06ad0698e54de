"""Transformer Engine recipes for the aligned forward, used only where TE's numerics equal the spec's.

The aligned forward must reproduce the rollout's quantized GEMM (QaRL, docs/ALGORITHMS.md section 5).
A TE recipe qualifies only if its weight and activation quantizers produce the same values as
the spec's reference quantizer; each format declares its candidate recipe, the GPUs that run
it and whether its numerics match (``EngineFacts.te_recipe``, collected in :data:`RECIPES`):

- ``fp8_block`` -> ``Float8BlockScaling`` (Hopper, SM 9.x): 128x128 weight blocks, 1x128
  activation groups, E4M3 with ``scale = 448 / amax``, as SGLang's block FP8. TE constrains the
  scales to powers of two by default; ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` (set by
  :func:`make_te_recipe` before TE is imported) gives fp32 scales. Still NOT equal, measured
  on the H200 with TE 2.20.2 (``tests/gpu/test_te_recipes.py``, 2026-11-29): dequantized
  weights differ from the reference by up to 1.37e-2 and activations by 7.76e-2 (max abs;
  0.05-scale weights, unit activations), and a ``te.Linear`` GEMM under the recipe by 1.47e-2
  of the reference GEMM's max — rounding differences (TE multiplies by ``448/amax``, SGLang
  divides by ``amax/448``). So ``fp8_block`` uses the fake-quant path too.
- ``fp8`` -> ``Float8CurrentScaling`` does NOT match: TE scales each whole tensor once, the
  spec (SGLang ``w8a8_fp8``) uses per-output-channel weight and per-token activation scales.
  The aligned forward uses the straight-through fake-quant path.
- ``nvfp4`` -> ``NVFP4BlockScaling`` (Blackwell, SM 10.x) does NOT match: it also quantizes
  activations (W4A4) and uses 16x16 weight blocks for the backward; the spec is W4A16.
- ``int8``, ``w4a16``: no TE recipe; fake-quant path.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_qrl.quant import get_spec, list_specs
from megatron_qrl.quant.engine_facts import TERecipe
from megatron_qrl.utils.optional import available

RECIPES: dict[str, TERecipe] = {name: get_spec(name).engine.te_recipe for name in list_specs()
                               if get_spec(name).engine.te_recipe is not None}
"""Rollout format -> TE recipe candidate, as each format declares it
(:attr:`megatron_qrl.quant.engine_facts.EngineFacts.te_recipe`; formats not listed have none)."""


def _gpu() -> tuple[str, int]:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU", 0
    return torch.cuda.get_device_name(), torch.cuda.get_device_capability()[0]


def te_recipe_for(fmt: str, gpu: tuple[str, int] | None = None,
                  approximate: bool = False) -> TERecipe:
    """The TE recipe serving ``fmt`` on this GPU; one clear ValueError otherwise.

    ``gpu``: ``(name, capability major)``, default: the current CUDA device. ``approximate``
    also accepts a recipe that differs from the spec only by rounding (``within_rounding``;
    bench/aligned_step.py measures its speed) — the aligned forward then no longer equals
    the rollout's numerics exactly.
    """
    name, major = gpu or _gpu()
    recipe = get_spec(fmt).engine.te_recipe if fmt in list_specs() else None
    fallback = "use the default straight-through fake-quant aligned forward (no TE recipe)"
    if recipe is None:
        raise ValueError(f"no Transformer Engine recipe computes {fmt!r}; {fallback}")
    if not (recipe.matches_spec or (approximate and recipe.within_rounding)):
        raise ValueError(f"TE {recipe.recipe} does not reproduce the {fmt!r} rollout "
                         f"({recipe.why}); {fallback}")
    if major not in recipe.capabilities:
        runnable = sorted(f for f in list_specs() if (r := get_spec(f).engine.te_recipe)
                          is not None and r.matches_spec and major in r.capabilities)
        raise ValueError(
            f"TE {recipe.recipe} (for {fmt!r}) needs compute capability "
            f"{'/'.join(f'{c}.x' for c in recipe.capabilities)}; this GPU is {name} "
            f"(SM {major}.x). Alternatives: {fallback}"
            + (f", or a format with a TE recipe on this GPU: {runnable}" if runnable else ""))
    return recipe


def make_te_recipe(recipe: TERecipe) -> Any:
    """Instantiate the TE recipe object (sets ``recipe.env`` first; TE must be importable)."""
    ok, reason = available("transformer_engine.pytorch")
    if not ok:
        raise ImportError(f"Transformer Engine is not importable: {reason}")
    for key, value in recipe.env.items():
        if os.environ.get(key, value) != value:
            raise ValueError(f"{key}={os.environ[key]} is set; {recipe.recipe} for "
                             f"{recipe.format} needs {key}={value}")
        os.environ[key] = value
    from transformer_engine.common import recipe as te_recipe

    return getattr(te_recipe, recipe.recipe)()


def te_config_overrides(fmt: str, gpu: tuple[str, int] | None = None,
                        approximate: bool = False) -> dict[str, str]:
    """``TransformerConfig`` overrides for the TE path of ``fmt`` (megatron wraps TE autocast;
    ``approximate``: see :func:`te_recipe_for`)."""
    recipe = te_recipe_for(fmt, gpu, approximate)
    for key, value in recipe.env.items():
        os.environ.setdefault(key, value)
    return dict(recipe.megatron)
