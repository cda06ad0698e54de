"""The weight sync's shared ground: what the trainer's sender and every engine's receiver
agree on, importable in either process without loading the other side.

:mod:`.protocol` imports only torch and the one HF-name parser
(:mod:`megatron_qrl.utils.hf_names`): how tensors travel (:mod:`.protocol.wire`), how both
sides fingerprint them (:mod:`.protocol.checksums`), and the in-place SGLang sync's reserved
names and control message (:mod:`.protocol.inplace`). The transports build on it: the Ray
actor's object store, broadcast and CUDA IPC in :mod:`megatron_qrl.rollout`; SGLang's sender
(trainer) and loader (inside SGLang's scheduler) in :mod:`megatron_qrl.rollout_sglang.sync`.
"""
