"""One quantization contract for rollout and trainer: the QuantSpec registry.

>>> from megatron_qrl.quant import get_spec, list_specs
>>> list_specs()
['bf16', 'int8', 'fp8', 'fp8_block', 'w4a16', 'nvfp4']
"""

from . import formats  # noqa: F401  (registers the formats)
from .spec import QuantizedWeight, QuantSpec, get_spec, list_specs, register_spec

__all__ = ["QuantSpec", "QuantizedWeight", "get_spec", "list_specs", "register_spec"]
