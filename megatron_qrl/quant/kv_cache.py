"""KV-cache formats: how the rollout engine rounds the K/V it stores, as pure torch.

The KV-cache precision is a second axis of the rollout format (any weight QuantSpec can be
served with any KV format), so it has its own small registry (:func:`register_kv_format`,
duplicates rejected) of frozen :class:`KVCacheFormat` objects; ``--qrl-rollout-kv-cache``
names one, and :attr:`KVCacheFormat.sglang_kv_cache_dtype` is the value given to SGLang's
``kv_cache_dtype``.

What SGLang 0.5.17 stores (read from its source; paths under ``sglang/srt/``):

* ``mem_cache/kv_cache_dtype.py`` ``configure_kv_cache_dtype``: ``fp8_e4m3`` ->
  ``torch.float8_e4m3fn``, ``fp8_e5m2`` -> ``torch.float8_e5m2``, ``bf16`` -> bfloat16 (CUDA;
  ``auto`` picks e4m3 only when the checkpoint's quant config says ``kv_cache_quant_algo: FP8``,
  so this package always passes an explicit value). ``mxfp8`` (block scales) and
  ``nvfp4``/``fp4_mx_block16`` (``torch.float4_e2m1fn_x2``, Blackwell) are not registered here.
* ``mem_cache/memory_pool.py`` ``MHATokenToKVPool.set_kv_buffer``: when the cache dtype differs
  from the model's, ``cache_k.div_(k_scale)`` (only if the layer has a scale), then
  ``cache_k.to(cache_dtype)``: one per-tensor scale, a plain torch cast (round to nearest even,
  per element, no per-token scale). ``k_scale``/``v_scale`` exist only when the layer's quant
  method attaches a KV-cache method (``layers/quantization/kv_cache.py``), read from the
  checkpoint or 1.0; without checkpoint scales the stored value is exactly ``k.to(fp8)``.
  K is stored after RoPE and q/k-norm.
* ``layers/attention/triton_backend.py``: reads multiply the fp8 values by ``k_descale`` (the
  same scale; 1.0 without one) inside the kernel.

The division is done as the engine does it: in fp32 then rounded to the activation dtype
(``div_`` on a bf16 tensor), then cast. With scale 1.0 (the default) :func:`fake_quant_kv`
equals the engine's stored value bit for bit; with another scale the read-back multiply is
done here on the dequantized K/V rather than on the logits, a difference of one rounding.

Overflow: values whose magnitude rounds beyond the format's largest finite value are what the
torch cast makes of them, and that depends on the torch build (torch 2.13's
``c10::Float8_e4m3fn`` saturates finite overflow to 448; older builds return NaN; e5m2 gives
inf). The fake quantizer uses the same torch cast on the same device as the engine, so it
reproduces whichever it is; :func:`cast_overflow_behaviour` probes it and
:func:`overflow_report` counts the elements concerned so a run can report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KVCacheFormat", "KVOverflow", "cast_overflow_behaviour", "fake_quant_kv",
           "get_kv_format", "list_kv_formats", "overflow_report", "register_kv_format"]

_KV_REGISTRY: dict[str, KVCacheFormat] = {}


@dataclass(frozen=True)
class KVCacheFormat:
    """One KV-cache storage format of the rollout engine."""

    name: str
    """Registry key and ``--qrl-rollout-kv-cache`` value."""
    sglang_kv_cache_dtype: str
    """The value of ``sglang.Engine(kv_cache_dtype=...)`` that serves this format."""
    storage_dtype: torch.dtype | None
    """The element type of the cache, or None: the model's dtype (nothing is rounded)."""
    description: str = ""

    @property
    def quantizes(self) -> bool:
        """Whether the cache rounds K/V (an aligned forward has something to model)."""
        return self.storage_dtype is not None

    @property
    def max_finite(self) -> float:
        """Largest finite magnitude of the storage type (inf when nothing is rounded)."""
        return float("inf") if self.storage_dtype is None else float(torch.finfo(self.storage_dtype).max)

    @property
    def sglang_engine_kwargs(self) -> dict:
        """The ``sglang.Engine`` arguments that serve this format so that the rollout's
        attention follows the rule of :mod:`megatron_qrl.te_quant.kv_attention` exactly.

        Always an explicit ``kv_cache_dtype`` (``auto`` would switch to e4m3 for a checkpoint
        whose quant config names ``kv_cache_quant_algo: FP8``). For a rounding format also
        ``disable_radix_cache`` and ``chunked_prefill_size=-1``: a radix prefix hit (the GRPO
        samples of one prompt share it) or a prefill split into chunks makes the later part
        of a prefill read the ROUNDED K/V of the earlier part, at positions that depend on the
        scheduler and that the trainer cannot know (``managers/schedule_policy.py``
        ``PrefillAdder`` truncates the last request to the chunk budget). The cost: each
        sample prefills its prompt itself (small next to RL-length decodes).
        """
        kw: dict = {"kv_cache_dtype": self.sglang_kv_cache_dtype}
        if self.quantizes:
            kw |= {"disable_radix_cache": True, "chunked_prefill_size": -1}
        return kw

    def _top_step(self) -> float:
        fi = torch.finfo(self.storage_dtype)
        return 2.0 ** torch.tensor(fi.max).log2().floor().item() * fi.eps  # top binade's spacing

    @property
    def overflow_threshold(self) -> float:
        """``max_finite`` plus half of the top binade's step (e4m3: 448 + 16 = 464, e5m2:
        57344 + 4096 = 61440): magnitudes above it cannot round to ``max_finite``; exactly at
        it, round-half-to-even overflows when ``max_finite``'s last mantissa bit is odd
        (e5m2, :attr:`tie_overflows`) and stays at ``max_finite`` when it is even (e4m3)."""
        if self.storage_dtype is None:
            return float("inf")
        return self.max_finite + self._top_step() / 2

    @property
    def tie_overflows(self) -> bool:
        """Whether a value exactly at :attr:`overflow_threshold` overflows (odd last bit)."""
        return self.storage_dtype is not None and round(self.max_finite / self._top_step()) % 2 == 1

    def quantize(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """The stored codes: ``(x / scale)`` in fp32, rounded to ``x.dtype``, cast to the
        storage type (SGLang ``set_kv_buffer``). ``x`` itself when nothing is rounded."""
        if self.storage_dtype is None:
            return x
        y = x if scale == 1.0 else (x.float() / scale).to(x.dtype)
        return y.to(self.storage_dtype)

    def dequantize(self, codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """What the attention kernel reads back: ``codes * scale`` in ``dtype``."""
        if self.storage_dtype is None:
            return codes.to(dtype)
        y = codes.to(dtype)
        return y if scale == 1.0 else (y.float() * scale).to(dtype)


def register_kv_format(fmt: KVCacheFormat) -> KVCacheFormat:
    """Add ``fmt`` to the registry; a name registered twice raises ``ValueError``."""
    if fmt.name in _KV_REGISTRY:
        raise ValueError(f"KV-cache format {fmt.name!r} is already registered")
    _KV_REGISTRY[fmt.name] = fmt
    return fmt


def get_kv_format(name: str) -> KVCacheFormat:
    """The registered KV-cache format ``name`` (``--qrl-rollout-kv-cache``)."""
    try:
        return _KV_REGISTRY[name]
    except KeyError:
        raise ValueError(f"--qrl-rollout-kv-cache {name!r}: unknown KV-cache format; choose "
                         f"one of {sorted(_KV_REGISTRY)}") from None


def list_kv_formats() -> list[str]:
    """Names of the registered KV-cache formats, in registration order."""
    return list(_KV_REGISTRY)


register_kv_format(KVCacheFormat("bf16", "bf16", None, "K/V kept in the model dtype"))
register_kv_format(KVCacheFormat("fp8_e4m3", "fp8_e4m3", torch.float8_e4m3fn,
                                 "FP8 E4M3 (max 448), per-tensor scale, RNE cast"))
register_kv_format(KVCacheFormat("fp8_e5m2", "fp8_e5m2", torch.float8_e5m2,
                                 "FP8 E5M2 (max 57344), per-tensor scale, RNE cast"))


class _KVStraightThrough(torch.autograd.Function):
    """Forward: the engine's store-and-read rounding; backward: identity (STE, Bengio et al.
    2013, arXiv:1308.3432, eq. 3 with the identity surrogate)."""

    @staticmethod
    def forward(ctx, x, fmt, scale):  # noqa: D401
        return fmt.dequantize(fmt.quantize(x, scale), scale, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def fake_quant_kv(x: torch.Tensor, fmt: KVCacheFormat | str, scale: float = 1.0) -> torch.Tensor:
    """``dequantize(quantize(x))`` as the engine stores and reads K or V, with a
    straight-through gradient; ``x`` unchanged for a format that rounds nothing."""
    fmt = get_kv_format(fmt) if isinstance(fmt, str) else fmt
    if not fmt.quantizes:
        return x
    if not scale > 0:
        raise ValueError(f"KV-cache scale must be > 0, got {scale}")
    return _KVStraightThrough.apply(x, fmt, float(scale))


def cast_overflow_behaviour(fmt: KVCacheFormat | str, device: torch.device | str = "cpu") -> str:
    """What this torch build's cast does with a finite value beyond the format's range on
    ``device``: ``saturate`` (max finite), ``nan``, ``inf`` or ``none`` (nothing rounded)."""
    fmt = get_kv_format(fmt) if isinstance(fmt, str) else fmt
    if not fmt.quantizes:
        return "none"
    probe = torch.tensor([fmt.overflow_threshold * 4], device=device)
    got = float(probe.to(fmt.storage_dtype).float().item())
    if got != got:
        return "nan"
    return "inf" if got == float("inf") else "saturate"


@dataclass(frozen=True)
class KVOverflow:
    """Elements of one K or V tensor outside the KV format's range."""

    count: int
    """Finite elements whose ``|x / scale|`` rounds beyond the largest finite value."""
    amax: float
    """Largest ``|x / scale|`` (finite elements)."""
    threshold: float
    """The format's overflow threshold (see :attr:`KVCacheFormat.overflow_threshold`)."""


def overflow_report(x: torch.Tensor, fmt: KVCacheFormat | str, scale: float = 1.0) -> KVOverflow:
    """Count the elements of ``x`` the KV cast cannot represent (they become whatever
    :func:`cast_overflow_behaviour` says); a suitable per-tensor ``scale`` removes them."""
    fmt = get_kv_format(fmt) if isinstance(fmt, str) else fmt
    a = (x.detach().float() / scale).abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    amax = float(a.max()) if a.numel() else 0.0
    thr = fmt.overflow_threshold
    over = (a > thr) | (a == thr) if fmt.tie_overflows else a > thr
    return KVOverflow(int(over.sum()), amax, thr)
