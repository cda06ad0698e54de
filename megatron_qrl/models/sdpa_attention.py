"""Megatron core attention through ``torch.nn.functional.scaled_dot_product_attention``.

The local (no Transformer Engine) layer spec of megatron-core 0.16.1 uses
``DotProductAttention``, which materialises the ``[b, heads, s, s]`` scores and softmax in
every layer (memory O(s^2) per head: out of memory on an H200 at RL lengths). :class:`SDPACoreAttention` is a
drop-in ``core_attention`` module for that spec (same constructor and forward signature, the
``CoreAttention`` protocol of ``megatron.core.transformer.attention``): softmax(Q K^T * scale) V
(Vaswani et al. 2017, eq. 1) computed by PyTorch's fused kernels (flash / memory-efficient on a
GPU), never materialising the score matrix there.

Semantics follow ``DotProductAttention`` + ``FusedScaleMaskSoftmax``: causal when the layer's
mask type is causal and no mask is given; a given boolean ``attention_mask`` (True = masked
out, broadcastable to ``[b, np, sq, sk]``) is applied as is; grouped-query attention shares each
key/value head among ``num_heads / num_query_groups`` query heads (Ainslie et al. 2023, GQA);
``softmax_scale`` defaults to ``1/sqrt(head_dim)``.

Packed (THD) micro batches (``--qrl-pack-sequences``, :mod:`megatron_qrl.models.packing`): with
``packed_seq_params`` (``qkv_format="thd"``) the query / key / value are ``[t, heads, hn]``, the
samples back to back; each segment ``cu_seqlens[i]:cu_seqlens[i+1]`` gets its own causal
attention (one ``scaled_dot_product_attention`` per segment: nothing attends across a sample
boundary), the output is ``[t, heads * hn]`` as ``TEDotProductAttention``'s. Upstream's local
``DotProductAttention`` refuses packed sequences.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

__all__ = ["SDPACoreAttention"]


class SDPACoreAttention(MegatronModule):
    """``core_attention`` of the local spec computed with ``scaled_dot_product_attention``."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention: context parallelism needs Transformer Engine's "
                             "TEDotProductAttention (--transformer-impl transformer_engine)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla" or config.window_size is not None:
            raise ValueError("SDPACoreAttention supports the vanilla softmax without a sliding "
                             "window (Qwen3); use the Transformer Engine spec for others")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.heads = divide(config.num_attention_heads, tp)
        self.head_dim = config.kv_channels
        self.softmax_scale = (1.0 / math.sqrt(self.head_dim) if softmax_scale is None
                              else softmax_scale)
        # apply_query_key_layer_scaling: upstream divides the scale by the layer number and
        # the softmax multiplies it back, so the product is this scale either way
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None
                ) -> torch.Tensor:
        """``[sq, b, np, hn]`` query, ``[sk, b, ng, hn]`` key / value -> ``[sq, b, np * hn]``."""
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention: attention_bias is not supported")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if packed_seq_params is not None:
            return self._forward_thd(query, key, value, packed_seq_params, mask_type)
        sq, b, heads, _ = query.shape
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        rep = heads // k.shape[1]
        if rep > 1:  # GQA: each key/value head serves `rep` consecutive query heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        mask = None
        causal = False
        if attention_mask is not None:
            mask = ~attention_mask.bool()  # megatron: True = masked out; SDPA: True = attend
        elif mask_type == AttnMaskType.causal and sq > 1:
            if sq != k.shape[2]:
                raise ValueError("SDPACoreAttention: the causal mask is for self attention "
                                 f"(sq={sq}, sk={k.shape[2]})")
            causal = True
        out = self._sdpa(q, k, v, mask, causal)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * self.head_dim)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """``scaled_dot_product_attention`` of ``[b, np, s, hn]`` tensors (dropout in training
        under megatron's model-parallel RNG, as ``DotProductAttention``)."""
        p = self.dropout if self.training else 0.0
        if p > 0.0 and not self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                      is_causal=causal, scale=self.softmax_scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                              is_causal=causal, scale=self.softmax_scale)

    def _forward_thd(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     params: Any, mask_type: AttnMaskType) -> torch.Tensor:
        """Packed ``[t, np, hn]`` query, ``[t, ng, hn]`` key / value -> ``[t, np * hn]``:
        causal attention within each ``cu_seqlens`` segment (module docstring)."""
        from megatron_qrl.models.packing import segment_bounds

        if params.qkv_format != "thd":
            raise ValueError(f"SDPACoreAttention: packed_seq_params.qkv_format must be 'thd', "
                             f"got {params.qkv_format!r}")
        if mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError("SDPACoreAttention: packed sequences need causal self attention")
        cu = params.cu_seqlens_q
        padded = (params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded)
        if any(p is not None and not torch.equal(p, cu) for p in padded) or not torch.equal(
                params.cu_seqlens_kv, cu):
            raise ValueError("SDPACoreAttention: packed self attention needs cu_seqlens_kv == "
                             "cu_seqlens_q and no padded cu_seqlens (use the TE spec for others)")
        t, heads, hn = query.shape
        if int(cu[-1]) != t or key.shape[0] != t:
            raise ValueError(f"SDPACoreAttention: cu_seqlens ends at {int(cu[-1])}, the packed "
                             f"query has {t} tokens and the key {key.shape[0]}")
        q = query.transpose(0, 1).unsqueeze(0)  # [1, np, t, hn]
        k = key.transpose(0, 1).unsqueeze(0)
        v = value.transpose(0, 1).unsqueeze(0)
        rep = heads // k.shape[1]
        if rep > 1:  # GQA
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = torch.cat([self._sdpa(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], None, e - a > 1)
                         for a, e in segment_bounds(cu)], dim=2)
        return out[0].transpose(0, 1).reshape(t, heads * hn)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """No parameters (vanilla softmax)."""
        return {}
