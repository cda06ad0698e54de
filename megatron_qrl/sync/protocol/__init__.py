"""The weight sync's protocol (torch only): :mod:`.wire` (byte views, flat buckets, the one
bucketing rule), :mod:`.checksums` (fingerprints and the sender's manifest), :mod:`.inplace`
(the in-place SGLang sync's reserved names, control message and expert-stack names)."""
