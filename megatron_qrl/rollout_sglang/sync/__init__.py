"""The SGLang weight sync, split where the process splits.

In the trainer's process: :mod:`.sender` (fingerprints, expert stacks, buckets, the tensor /
in-place / disk requests, the receipt check), :mod:`.prefetch` (buckets prepared in a
thread), :mod:`.distributed` (the weight-update group and its broadcasts). Inside SGLang's
scheduler: :mod:`.loader` (the registered in-place loader, module state, expert loads, the
receipt). Both import :mod:`megatron_qrl.sync.protocol` (reserved names, the control
message, name mapping; :mod:`.protocol` re-exports its in-place part).
Opt-in records of the loader: :mod:`.debug`.
"""
