"""The in-process SGLang engine's weight transports (side ``sglang`` of
:mod:`megatron_qrl.sync.transport`), one file each, named by ``SGLangOptions.sync``:
:mod:`.tensor`, :mod:`.inplace`, :mod:`.distributed`, :mod:`.disk`, :mod:`.direct`. Each takes the sync's
:class:`~megatron_qrl.rollout_sglang.sync.session.SGLangSession`. Trainer side only."""

from . import direct, disk, distributed, inplace, tensor  # noqa: F401  (registration)
