"""Everything of the weight sync that runs inside SGLang's scheduler process.

:func:`load_packed` is the ``custom_weight_loader`` / ``load_format`` SGLang imports by name
(:data:`~megatron_qrl.rollout_sglang.sync.protocol.LOADER`); :mod:`.packed` applies one
bucket, :mod:`.module_state` swaps a module between its live and checkpoint layouts,
:mod:`.experts` and :mod:`.expert_batch` load expert tensors, :mod:`.receipt` fingerprints
what arrived. :mod:`.storage` is the direct sync's storage service (``load_format`` =
:data:`~megatron_qrl.sync.protocol.engine_layout.STORAGE`): the live parameters described
in the engine's layout (:mod:`.live_storage`), handed out as CUDA IPC handles or written here
from the trainer's (:mod:`.storage_write`), read back as a digest.
"""

from .packed import load_packed

__all__ = ["load_packed"]
