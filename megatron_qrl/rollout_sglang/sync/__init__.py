"""The SGLang weight sync, split where the process splits.

In the trainer's process: :mod:`.transports` (one file per sync path: tensor, in place,
distributed, disk; each takes a typed :class:`.session.SGLangSession`), :mod:`.sender`
(fingerprints, expert stacks, buckets, control tensors, the receipt check), :mod:`.prefetch`
(buckets prepared in a thread), :mod:`.distributed` (the weight-update group and its
broadcasts), :mod:`.writer` and :mod:`.storage_client` (the direct sync: the packed stream
copied into the engine's own tensors). Inside SGLang's
scheduler: :mod:`.loader` (the registered in-place loader, module state, expert loads, the
receipt; the storage service of the direct sync). Both import :mod:`megatron_qrl.sync.protocol` (reserved names, the control
message, name mapping; :mod:`.protocol` re-exports its in-place part).
Opt-in records of the loader: :mod:`.debug`.
"""
