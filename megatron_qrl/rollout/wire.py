"""How packed tensors travel: :mod:`megatron_qrl.sync.protocol.wire` (re-exported here)."""

from ..sync.protocol.wire import (
    BucketMeta,
    as_bytes,
    bucket_nbytes,
    buckets,
    dtype_name,
    flatten,
    from_bytes,
    iter_buckets,
    json_tensor,
    nbytes,
    tensor_json,
    unflatten,
)

__all__ = ["BucketMeta", "as_bytes", "bucket_nbytes", "buckets", "dtype_name", "flatten",
           "from_bytes", "iter_buckets", "json_tensor", "nbytes", "tensor_json", "unflatten"]
