"""The one parser of HF tensor names: :mod:`megatron_qrl.utils.hf_names` (re-exported here)."""

from ..utils.hf_names import (
    FUSED,
    FUSION_MEMBERS,
    STACKED,
    HFName,
    expert_name,
    expert_names,
    fusion_group,
    is_projection_weight,
    layer_prefix,
    parse,
    stacked_name,
)

__all__ = ["FUSED", "FUSION_MEMBERS", "STACKED", "HFName", "expert_name", "expert_names",
           "fusion_group", "is_projection_weight", "layer_prefix", "parse", "stacked_name"]
