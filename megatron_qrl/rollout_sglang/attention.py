"""The SGLang engine's attention backend (``--qrl-rollout-sglang-attention-backend``).

``auto`` takes FA3 where it runs — a Hopper GPU (compute capability 9.0) and SGLang's FA3
kernel present (``sgl_kernel/flash_ops*.so``; a trimmed site such as the H200 recipe leaves
it out: ``tools/stage_fa3.sh`` stages it) — with a BF16 KV cache, else Triton. Measured on
the H200 (Qwen3-30B-A3B shape, 512 + 1,536 tokens, batch 256, docs/BENCHMARKS.md "Decode
throughput at RL length"): FA3 decodes 19% faster than Triton in BF16 and 12% faster with
fp8 weights + an fp8 KV cache.

With an FP8 KV cache ``auto`` stays on Triton: SGLang 0.5.17's FA3 backend casts the queries
to the KV cache's dtype too (``flashattention_backend.py``: ``q = q.to(self.kv_cache_dtype)``),
and the trainer's KV-aligned attention (``--qrl-train-forward aligned`` with a rounding KV
cache) rounds K and V only. ``fa3`` asked for explicitly runs there too, and the engine's log
line says that the queries are rounded. ``fa3`` where it cannot run is refused naming what is
missing; ``triton`` and ``flashinfer`` are passed to SGLang as they are.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

BACKENDS = ("auto", "fa3", "triton", "flashinfer")
FLAG = "--qrl-rollout-sglang-attention-backend"
HOPPER = (9, 0)


@dataclass(frozen=True)
class AttentionChoice:
    """The backend SGLang gets and the line the engine logs about it."""

    backend: str
    why: str

    def describe(self) -> str:
        return f"SGLang attention backend: {self.backend} ({self.why})"


def fa3_kernel() -> Path | None:
    """SGLang's FA3 kernel library (``sgl_kernel/flash_ops*.so``) where installed, else
    None; found without importing ``sgl_kernel`` (which loads CUDA libraries)."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        return None
    for where in spec.submodule_search_locations:
        found = sorted(Path(where).glob("flash_ops*.so"))
        if found:
            return found[0]
    return None


def fa3_missing(capability: tuple[int, int] | None, kernel: Path | None) -> str | None:
    """Why FA3 cannot run on a GPU of ``capability`` with ``kernel`` (None: it can)."""
    if capability is None:
        return "no CUDA GPU"
    if tuple(capability) != HOPPER:
        return (f"FA3 runs on Hopper (compute capability 9.0); this GPU is "
                f"{capability[0]}.{capability[1]}")
    if kernel is None:
        return ("SGLang's FA3 kernel (sgl_kernel/flash_ops*.so) is not installed: install the "
                "full sglang-kernel wheel, or on a trimmed site stage it with tools/stage_fa3.sh")
    return None


def choose_attention(asked: str, kv_cache: str, capability: tuple[int, int] | None,
                     kernel: Path | None) -> AttentionChoice:
    """The backend for ``asked`` (one of :data:`BACKENDS`) with KV cache format ``kv_cache``
    on a GPU of ``capability`` (None: none) with FA3's ``kernel`` (:func:`fa3_kernel`)."""
    if asked not in BACKENDS:
        raise ValueError(f"{FLAG} must be one of {', '.join(BACKENDS)}, got {asked!r}")
    missing = fa3_missing(capability, kernel)
    if asked == "fa3":
        if missing is not None:
            raise ValueError(f"{FLAG} fa3: {missing}; or pass {FLAG} triton (or auto)")
        if kv_cache != "bf16":
            return AttentionChoice("fa3", f"asked; with the {kv_cache} KV cache FA3 also "
                                   "rounds the queries, which the KV-aligned trainer does not")
        return AttentionChoice("fa3", "asked")
    if asked != "auto":
        return AttentionChoice(asked, "asked")
    if missing is not None:
        return AttentionChoice("triton", f"auto: {missing}")
    if kv_cache != "bf16":
        return AttentionChoice("triton", f"auto: FA3 would round the queries with the "
                               f"{kv_cache} KV cache; {FLAG} fa3 to take it anyway")
    return AttentionChoice("fa3", "auto: Hopper with SGLang's FA3 kernel")
