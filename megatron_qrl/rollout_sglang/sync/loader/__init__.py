"""Everything of the weight sync that runs inside SGLang's scheduler process.

:func:`load_packed` is the ``custom_weight_loader`` / ``load_format`` SGLang imports by name
(:data:`~megatron_qrl.rollout_sglang.sync.protocol.LOADER`); :mod:`.packed` applies one
bucket, :mod:`.module_state` swaps a module between its live and checkpoint layouts,
:mod:`.experts` and :mod:`.expert_batch` load expert tensors, :mod:`.receipt` fingerprints
what arrived.
"""

from .packed import load_packed

__all__ = ["load_packed"]
