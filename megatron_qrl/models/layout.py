"""Pure tensor layout functions between HF weights and Megatron-core shards.

Megatron's fused QKV for GQA is interleaved per query group: for each of the
``num_kv_heads`` groups, the group's ``num_heads / num_kv_heads`` query heads, then its key
head, then its value head (rows of ``head_dim`` each). Tensor parallelism splits that tensor
into contiguous row chunks, i.e. whole query groups per rank. The fused MLP input
``linear_fc1`` is ``[gate; up]`` PER TP RANK: rank r holds ``[gate_r; up_r]``.
"""

from __future__ import annotations

import torch


def _check_divisible(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what}: size {size} is not divisible by {parts} parallel ranks")
    return size // parts


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
             num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """HF ``q_proj/k_proj/v_proj`` weights -> Megatron ``linear_qkv`` (interleaved per group)."""
    hidden = q.shape[-1]
    per_group = num_heads // num_kv_heads
    qg = q.reshape(num_kv_heads, per_group * head_dim, hidden)
    kg = k.reshape(num_kv_heads, head_dim, hidden)
    vg = v.reshape(num_kv_heads, head_dim, hidden)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, hidden)


def qkv_parts(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the query, key and value rows of a fused ``linear_qkv`` weight, each
    ``[query groups, rows per group, hidden]`` (strided: the groups interleave them)."""
    per_group = num_heads // num_kv_heads
    grouped = qkv.reshape(num_kv_heads, (per_group + 2) * head_dim, qkv.shape[-1])
    q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
    return q, k, v


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`; works on a TP shard when given the shard's head counts."""
    hidden = qkv.shape[-1]
    q, k, v = (p.reshape(-1, hidden).contiguous()
               for p in qkv_parts(qkv, num_heads, num_kv_heads, head_dim))
    return q, k, v


def shard(tensor: torch.Tensor, dim: int, rank: int, size: int, what: str = "tensor") -> torch.Tensor:
    """Contiguous chunk ``rank`` of ``size`` along ``dim`` (column: dim 0, row: dim 1)."""
    part = _check_divisible(tensor.shape[dim], size, what)
    return tensor.narrow(dim, rank * part, part).contiguous()


def shard_gate_up(gate: torch.Tensor, up: torch.Tensor, rank: int, size: int,
                  what: str = "linear_fc1") -> torch.Tensor:
    """HF gate/up -> the ``[gate_r; up_r]`` ``linear_fc1`` shard of TP rank ``rank``."""
    return torch.cat([shard(gate, 0, rank, size, what), shard(up, 0, rank, size, what)], dim=0)


def unshard_gate_up(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`shard_gate_up` over all ranks' shards (in rank order)."""
    halves = [s.chunk(2, dim=0) for s in shards]
    gate = torch.cat([h[0] for h in halves], dim=0)
    up = torch.cat([h[1] for h in halves], dim=0)
    return gate, up


def shard_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
              num_kv_heads: int, head_dim: int, rank: int, size: int) -> torch.Tensor:
    """The ``linear_qkv`` shard of TP rank ``rank`` (whole query groups per rank)."""
    _check_divisible(num_kv_heads, size, "num_key_value_heads (query groups)")
    return shard(fuse_qkv(q, k, v, num_heads, num_kv_heads, head_dim), 0, rank, size, "linear_qkv")


def unshard_qkv(shards: list[torch.Tensor], num_heads: int, num_kv_heads: int,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`shard_qkv` over all ranks' shards (in rank order)."""
    return split_qkv(torch.cat(shards, dim=0), num_heads, num_kv_heads, head_dim)


def global_expert_index(local_index: int, ep_rank: int, num_local_experts: int) -> int:
    """Megatron places experts contiguously: EP rank r holds ``[r*n_local, (r+1)*n_local)``."""
    return ep_rank * num_local_experts + local_index
