"""The weight sync's shared ground: what the trainer's sender and every engine's receiver
agree on, importable in either process without loading the other side.

:mod:`.protocol` imports only torch and the one HF-name parser
(:mod:`megatron_qrl.utils.hf_names`): how tensors travel (:mod:`.protocol.wire`), how both
sides fingerprint them (:mod:`.protocol.checksums`), the in-place SGLang sync's reserved
names and control message (:mod:`.protocol.inplace`), and the engine's parameter layout the
direct sync writes into (:mod:`.protocol.engine_layout`). :mod:`.transport` is the transports'
one interface (prepare / send bucket / finish / verify), their registry and the one
bucketing rule. The transports, one file each, build on both: the Ray actor's and the
fleet's in :mod:`megatron_qrl.rollout.transports`, the in-process SGLang engine's in
:mod:`megatron_qrl.rollout_sglang.sync.transports` (its loader, inside SGLang's scheduler, in
:mod:`megatron_qrl.rollout_sglang.sync.loader`). The tree::

    sync/protocol/      wire, checksums, inplace,         (torch + the HF-name parser)
                        engine_layout
    sync/transport.py   WeightTransport, registry, cut    (torch + protocol)
    rollout/transports/ objectstore, broadcast, ipc       side "ray": one engine actor
                        fleet, sharded                    side "fleet": every actor at once
    rollout_sglang/sync/transports/
                        tensor, inplace, distributed, disk,  side "sglang"
                        direct (writer, storage_client)
    rollout_sglang/sync/loader/    inside SGLang's scheduler (imports protocol only)
"""
