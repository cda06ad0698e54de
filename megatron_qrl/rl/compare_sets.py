"""``--qrl-compare NAME``: the variant sets (the keys are ``rl.cli.COMPARE_SETS``).

* ``papers`` (the flag's default): :data:`megatron_qrl.rl.compare.VARIANTS`;
* ``rlquant``: :data:`megatron_qrl.rl.compare.RLQUANT_VARIANTS`, then every final policy
  evaluated at the precision it deploys at (:mod:`megatron_qrl.rl.compare_rlquant`).
"""

from __future__ import annotations

from megatron_qrl.rl.compare import RLQUANT_VARIANTS, VARIANTS, VariantSet
from megatron_qrl.rl.compare_rlquant import rlquant_after

__all__ = ["VARIANT_SETS"]

VARIANT_SETS: dict[str, VariantSet] = {
    "papers": VariantSet(VARIANTS),
    "rlquant": VariantSet(RLQUANT_VARIANTS, rlquant_after),
}
