"""What the trainer's sender and the engine's loader agree on:
:mod:`megatron_qrl.sync.protocol.inplace` (re-exported here)."""

from ...sync.protocol.inplace import (
    CONTROL,
    FLAT,
    LOADER,
    RECV,
    InplaceSyncError,
    decode_control,
    encode_control,
    expert_name,
    expert_names,
    expert_views,
    module_key,
    parse_stacked,
)

__all__ = ["CONTROL", "FLAT", "LOADER", "RECV", "InplaceSyncError", "decode_control",
           "encode_control", "expert_name", "expert_names", "expert_views", "module_key",
           "parse_stacked"]
