"""Transformer Engine recipes for the aligned forward, used only where TE's numerics equal the spec's.

The aligned forward must reproduce the rollout's quantized GEMM (QaRL, docs/ALGORITHMS.md section 5).
A TE recipe qualifies only if its weight and activation quantizers produce the same values as
the spec's reference quantizer; each format declares its candidate recipe, the GPUs that run
it and whether its numerics match (``EngineFacts.te_recipe``, collected in :data:`RECIPES`):

- ``fp8_block`` -> ``Float8BlockScaling`` (Hopper, SM 9.x): 128x128 weight blocks, 1x128
  activation groups, E4M3, ``codes = e4m3(x * (448 / amax))``, ``scale_inv = 1 / scale`` — the
  same rule as the spec (ModelOpt's weights, SGLang's ``per_token_group_quant_fp8``). Measured
  element by element on the H200 (TE 2.20.2, ``bench/te_block_codes.py``,
  bench/results/te_block_codes_ee27c8e.jsonl), TE's ``Float8BlockQuantizer`` with fp32 scales
  against the spec, comparing what each side stores (codes and ``scale_inv``):

  | tensor | codes that differ | by | ``scale_inv`` bit-different | max relative |
  |---|---|---|---|---|
  | weight 2048x768, 128x128 blocks | 0.23% | 1 E4M3 step | 15.6% of blocks | 1.4e-7 |
  | activation 512x2048, 1x128 groups | 0.10% | 1 E4M3 step | 59.5% of groups | 1.5e-7 |

  Every differing code sits on a rounding tie of the spec's ``x * s`` (``x * s = 75.99999``: the
  spec rounds to 72, TE's last-bit larger scale gives 76.00001 -> 80). So the cause is TE's fp32
  scale, one or two ulps away from ``448 / amax`` — not the rounding direction, the block layout,
  the amax or the E4M3 max. The earlier "82% / 92% of elements differ" compared TE's
  ``dequantize()``, which returns BF16 (``code * scale_inv`` rounded again), with fp32 values.
  Second finding: ``Float8BlockScaling`` reads ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` once, as
  a class attribute, when ``transformer_engine.common.recipe`` is first imported (probe: set
  before the import -> fp32 scales, after -> powers of two). megatron-core imports TE before
  our code runs, so setting it later changed nothing: :func:`make_te_recipe` now sets the
  recipe's scale parameters on the object and :func:`te_config_overrides` refuses a process
  whose TE already fixed powers of two. ``fp8_block`` keeps the fake-quant path (exact); TE's
  recipe is ``approximate`` only.
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

    obj = getattr(te_recipe, recipe.recipe)()
    if recipe.env.get(FP32_SCALES) == "1":
        # the class read the variable when TE was first imported: set it on this object
        fp32 = te_recipe.QParams(power_2_scale=False, amax_epsilon=0.0)
        for attr in _BLOCK_QPARAMS:
            setattr(obj, attr, fp32)
    return obj


FP32_SCALES = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
_BLOCK_QPARAMS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


def scales_fixed_too_early(recipe: TERecipe, te_recipe_module: Any = None) -> str | None:
    """Why megatron's own ``recipe.recipe`` object would ignore ``recipe.env``, or None.

    megatron-core builds the recipe from ``TransformerConfig.fp8_recipe``; TE's
    ``Float8BlockScaling`` fixes power-of-two scales from :data:`FP32_SCALES` when its module is
    first imported. ``te_recipe_module``: the imported module to inspect (default: the one in
    ``sys.modules``; None there means TE's recipes are not imported yet, so the variable will
    be read in time)."""
    import sys

    if recipe.env.get(FP32_SCALES) != "1":
        return None
    mod = te_recipe_module or sys.modules.get("transformer_engine.common.recipe")
    cls = getattr(mod, recipe.recipe, None) if mod is not None else None
    if cls is None or not getattr(cls.fp8_quant_fwd_weight, "power_2_scale", False):
        return None
    return (f"Transformer Engine was imported before {FP32_SCALES}=1 was set, so megatron's "
            f"{recipe.recipe} keeps power-of-two scales; export {FP32_SCALES}=1 in the job's "
            "environment before launching")


def te_config_overrides(fmt: str, gpu: tuple[str, int] | None = None,
                        approximate: bool = False) -> dict[str, str]:
    """``TransformerConfig`` overrides for the TE path of ``fmt`` (megatron wraps TE autocast;
    ``approximate``: see :func:`te_recipe_for`). Refuses a process whose TE import already
    fixed the scale constraint the recipe needs (:func:`scales_fixed_too_early`)."""
    recipe = te_recipe_for(fmt, gpu, approximate)
    for key, value in recipe.env.items():
        os.environ.setdefault(key, value)
    late = scales_fixed_too_early(recipe)
    if late:
        raise ValueError(f"the TE recipe for {fmt!r}: {late}")
    return dict(recipe.megatron)
