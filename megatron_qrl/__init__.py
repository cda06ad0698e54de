"""megatron_qrl: low-precision rollouts for Megatron-core RL, fast and stable.

Subpackages: ``quant`` (the QuantSpec registry: one quantization contract for rollout and
trainer), ``losses``, ``models``, ``te_quant``, ``moe``, ``rollout_sglang``. Heavy and
GPU-only dependencies (Transformer Engine, SGLang, Ray) are imported lazily.
"""

__version__ = "0.1.0"
