"""The trainer's core attention with the rollout engine's KV-cache rounding, swapped in by spec.

:func:`kv_spec_hook` maps a decoder-layer ``ModuleSpec`` (local or Transformer Engine) to one
whose ``self_attention.submodules.core_attention`` is :class:`KVAlignedCoreAttention`: the
``CoreAttention`` interface of ``megatron.core.transformer.attention`` (``[sq, b, np, hn]``
query, ``[sk, b, ng, hn]`` key / value after q/k-norm and RoPE -> ``[sq, b, np * hn]``)
computed by :func:`~megatron_qrl.te_quant.kv_attention.rollout_kv_attention`. No Megatron class
is patched.

The layers read one :class:`KVAlignState` at forward time: the KV format, whether the
rounding is on (``enabled_as(False)`` gives the plain forward, for the mismatch attribution),
and the per-sample first position that reads the cache (``for_batch(cache_from)``, set by the
RL loop from the micro-batch's prompt lengths; without it every position reads the cache, as
every decode step does).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_qrl.quant.kv_cache import KVCacheFormat, get_kv_format
from megatron_qrl.te_quant.kv_attention import rollout_kv_attention

__all__ = ["KVAlignState", "KVAlignedCoreAttention", "kv_spec_hook"]


class KVAlignState:
    """What every :class:`KVAlignedCoreAttention` of one model reads at forward time."""

    def __init__(self, fmt: KVCacheFormat | str, k_scale: float = 1.0, v_scale: float = 1.0):
        self.fmt: KVCacheFormat = get_kv_format(fmt) if isinstance(fmt, str) else fmt
        """The rollout's KV-cache format (``--qrl-rollout-kv-cache``)."""
        self.k_scale = float(k_scale)
        """Per-tensor K scale of the engine (1.0: SGLang's default without checkpoint scales)."""
        self.v_scale = float(v_scale)
        self.enabled: bool = True
        """False: plain causal attention (the BF16-KV forward)."""
        self.cache_from: torch.Tensor | None = None
        """``[b]`` first position of each sample that reads the cache (its prompt length);
        None: every position (each one a decode step)."""

    @contextmanager
    def enabled_as(self, flag: bool) -> Iterator[None]:
        """Round K/V (True) or not (False) inside the block."""
        saved, self.enabled = self.enabled, bool(flag)
        try:
            yield
        finally:
            self.enabled = saved

    def set_micro_batch(self, loss_mask: torch.Tensor) -> None:
        """Take ``cache_from`` (the prompt lengths) from the micro batch's ``loss_mask``
        (rl/batch.py layout); the RL loop calls it before each micro batch's forward."""
        from megatron_qrl.te_quant.kv_attention import cache_from_loss_mask

        self.cache_from = cache_from_loss_mask(loss_mask)

    @contextmanager
    def for_batch(self, cache_from: torch.Tensor | None) -> Iterator[None]:
        """Forwards inside the block treat positions ``>= cache_from[b]`` of sample ``b`` as
        decode steps (``te_quant.kv_attention.cache_from_loss_mask`` gives it from a batch)."""
        saved, self.cache_from = self.cache_from, cache_from
        try:
            yield
        finally:
            self.cache_from = saved


class KVAlignedCoreAttention(torch.nn.Module):
    """``core_attention`` whose decode positions read K/V rounded as the engine's cache."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None,
                 qrl_kv: KVAlignState | None = None) -> None:
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if not isinstance(qrl_kv, KVAlignState):
            raise TypeError("KVAlignedCoreAttention needs params={'qrl_kv': KVAlignState}")
        p = config.attention_dropout if attention_dropout is None else attention_dropout
        if p or config.context_parallel_size != 1 or attn_mask_type != AttnMaskType.causal:
            raise ValueError("--qrl-rollout-kv-cache alignment models causal self-attention "
                             "without dropout or context parallelism (set --attention-dropout 0,"
                             " --context-parallel-size 1)")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("--qrl-rollout-kv-cache alignment: sliding-window attention is not "
                             "modelled (Qwen3 has none)")
        self.config = config
        self.layer_number = layer_number
        self.kv = qrl_kv
        self.softmax_scale = (1.0 / math.sqrt(config.kv_channels) if softmax_scale is None
                              else softmax_scale)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        """``[sq, b, np, hn]`` query, ``[sk, b, ng, hn]`` key / value -> ``[sq, b, np * hn]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("--qrl-rollout-kv-cache alignment: packed (THD) sequences and "
                             "attention bias are not modelled; use padded micro batches")
        if attention_mask is not None and bool(attention_mask.any()):
            raise ValueError("--qrl-rollout-kv-cache alignment: an explicit attention mask is not "
                             "modelled (right padding needs none under the causal mask)")
        sq, b, heads, hn = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, hn]
        fmt = self.kv.fmt if self.kv.enabled else get_kv_format("bf16")
        cache_from = self.kv.cache_from
        if cache_from is None:
            cache_from = torch.zeros(b, dtype=torch.long, device=q.device)
        out = rollout_kv_attention(q, k, v, cache_from, fmt, self.softmax_scale,
                                   self.kv.k_scale, self.kv.v_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """No parameters."""
        return {}


def kv_spec_hook(state: KVAlignState):
    """A ``spec_hook(layer_spec, config) -> layer_spec`` swapping the core attention for
    :class:`KVAlignedCoreAttention` reading ``state`` (compose with ``compose_hooks``)."""
    if not isinstance(state, KVAlignState):
        raise TypeError(f"kv_spec_hook needs a KVAlignState, got {type(state).__name__}")

    def hook(layer_spec: Any, config: Any) -> Any:
        from megatron.core.transformer.spec_utils import ModuleSpec

        from megatron_qrl.models.spec_tree import copy_spec

        spec = copy_spec(layer_spec)
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=KVAlignedCoreAttention, params={"qrl_kv": state})
        return spec

    return hook
