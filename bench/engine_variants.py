"""Rollout-bench variants ``FMT[:OPT[+OPT...]]``: the engine arguments and child environment
each option sets (pure; no sglang needed, CPU-tested in tests/bench/test_bench_engine_variants.py).

The SGLang 0.5.17 facts behind each option (paths under ``sglang/srt/``):

* ``fa3``: ``attention_backend="fa3"`` (``server_args.py`` ATTENTION_BACKEND_CHOICES);
  ``layers/attention/flashattention_backend.py`` imports ``sgl_kernel.flash_attn``, which
  imports ``sgl_kernel.flash_ops`` (the 1.1 GB ``flash_ops.abi3.so`` the H200 site drops; stage
  it with tools/stage_fa3.sh and bench/h200.sh ``fa3-part``/``fa3-install``).
  ``SGLANG_USE_SGL_FA3_KERNEL=1`` (``environ.py``, default already 1) keeps
  ``kernels/ops/attention/flash_attention_v3.py`` on sgl-kernel instead of the HF-hub
  ``kernels`` package, which an offline machine cannot fetch.
* ``deepgemm`` (``fp8_block`` only): ``SGLANG_ENABLE_JIT_DEEPGEMM=1`` (``deep_gemm_wrapper/
  configurer.py``), ``fp8_gemm_runner_backend="deep_gemm"`` (block-FP8 dense GEMMs,
  ``layers/quantization/fp8_utils.py`` ``_dispatch_explicit_backend``: raises at start when
  DeepGEMM is unavailable instead of falling back) and ``moe_runner_backend="deep_gemm"``
  (``Fp8MoEMethod``: an explicit ``deep_gemm`` runner is used without DeepEP, through the
  ``standard`` dispatcher's ``pre_permute_standard_to_deep_gemm``, ``layers/moe/moe_runner/
  deep_gemm.py``; ``auto`` picks it only with DeepEP/Mooncake/NIXL all-to-all,
  ``layers/quantization/fp8.py`` ``is_deepgemm_moe_runner_backend_enabled``).
  ``SGLANG_JIT_DEEPGEMM_PRECOMPILE=0``: compile lazily the kernels the run uses (in the
  bench's warm-up generate and the CUDA-graph warm-up runs) instead of every M in 1..16384
  per shape (``deep_gemm_wrapper/compile_utils.py``; "10-20 mins"); the cache goes to
  ``SGLANG_DG_CACHE_DIR=/tmp/deep_gemm_cache`` (kept while the H200 machine stays warm);
  these two are defaults (a value in the environment wins), while
  ``SGLANG_ENABLE_JIT_DEEPGEMM=1`` is forced: the recipe's setup.sh exports it as 0.
* ``deepgemm_dense``: the dense GEMMs only (MoE stays on Triton): tells which half wins.
* ``fp8`` (``w8a8_fp8``, per channel) never reaches DeepGEMM: its linear layers call
  sgl-kernel's CUTLASS ``fp8_scaled_mm`` (``fp8_utils.apply_fp8_linear``) and its MoE runner is
  hard-coded Triton (``layers/quantization/w8a8_fp8.py`` ``W8A8FP8MoEMethod.create_moe_runner``),
  so ``fp8:deepgemm`` is rejected rather than measured as a no-op.
* ``flashinfer``: ``attention_backend="flashinfer"`` (flashinfer-python 0.6.15 is in the
  site; it JIT-compiles its kernels with nvcc at the first start).
* ``sglang``: SGLang's own fused-MoE configs (no ``SGLANG_MOE_CONFIG_DIR``) instead of the
  ones megatron_qrl ships (tools/tune_fused_moe.py).
* ``kv_NAME`` (one per rounding format of ``megatron_qrl.quant.kv_cache``, e.g.
  ``kv_fp8_e4m3``): the KV cache in that format, with exactly the engine arguments a
  ``--qrl-rollout-kv-cache NAME`` rollout uses (``KVCacheFormat.sglang_engine_kwargs``:
  ``kv_cache_dtype``, no radix cache, no chunked prefill).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_qrl.quant.kv_cache import get_kv_format, list_kv_formats

OPTIONS: dict[str, str] = {
    "sglang": "SGLang's own fused-MoE configs instead of megatron_qrl's",
    "fa3": "attention_backend='fa3' (needs flash_ops.abi3.so: bench/h200.sh fa3-install)",
    "flashinfer": "attention_backend='flashinfer' (JIT-compiled with nvcc at start)",
    "deepgemm": "DeepGEMM for the block-FP8 dense GEMMs and the MoE (fp8_block only)",
    "deepgemm_dense": "DeepGEMM for the block-FP8 dense GEMMs only (fp8_block only)",
} | {f"kv_{n}": f"KV cache {n} ({get_kv_format(n).description})"
     for n in list_kv_formats() if get_kv_format(n).quantizes}
"""Every option a variant may carry after ``FMT:``, joined with ``+``."""

ATTENTION_OPTIONS = ("fa3", "flashinfer")
KV_OPTIONS = tuple(o for o in OPTIONS if o.startswith("kv_"))
DEEPGEMM_OPTIONS = ("deepgemm", "deepgemm_dense")
DEEPGEMM_FORMATS = ("fp8_block",)
"""Formats whose SGLang kernels DeepGEMM can replace (block FP8, ``quant_method: fp8``)."""

DEEPGEMM_ENV_DEFAULTS = {"SGLANG_JIT_DEEPGEMM_PRECOMPILE": "0",
                         "SGLANG_DG_CACHE_DIR": "/tmp/deep_gemm_cache"}


@dataclass(frozen=True)
class VariantPlan:
    """What one bench variant changes relative to ``engine_args_for(fmt)``."""

    variant: str
    """The variant as given, e.g. ``fp8_block:fa3+deepgemm``."""
    fmt: str
    """The QuantSpec format name (before the colon)."""
    options: tuple[str, ...] = ()
    """The options after the colon, in the order given."""
    engine_kwargs: dict = field(default_factory=dict)
    """Extra ``sglang.Engine`` arguments (applied after the bench's own, before ``--extra``)."""
    env: dict = field(default_factory=dict)
    """Environment variables the child process must see (they override the caller's)."""
    env_defaults: dict = field(default_factory=dict)
    """Environment variables for the child unless the caller sets them (tunables)."""
    own_moe_configs: bool = True
    """Point ``SGLANG_MOE_CONFIG_DIR`` at megatron_qrl's tuned fused-MoE configs."""


def parse_variant(variant: str) -> VariantPlan:
    """``FMT[:OPT[+OPT...]]`` -> its :class:`VariantPlan`; unknown or conflicting options raise
    ``ValueError`` naming the known ones."""
    fmt, sep, rest = variant.partition(":")
    if not fmt:
        raise ValueError(f"variant {variant!r}: no format before ':' (e.g. fp8_block:fa3)")
    opts = tuple(rest.split("+")) if sep else ()
    unknown = [o for o in opts if o not in OPTIONS]
    if unknown:
        known = ", ".join(f"{k} ({v})" for k, v in OPTIONS.items())
        raise ValueError(f"variant {variant!r}: unknown option(s) {unknown}; known options "
                         f"(join with '+', e.g. fp8_block:fa3+deepgemm): {known}")
    if len(set(opts)) != len(opts):
        raise ValueError(f"variant {variant!r}: an option is repeated")
    attn = [o for o in opts if o in ATTENTION_OPTIONS]
    dg = [o for o in opts if o in DEEPGEMM_OPTIONS]
    kv = [o for o in opts if o in KV_OPTIONS]
    if len(attn) > 1 or len(dg) > 1 or len(kv) > 1:
        raise ValueError(f"variant {variant!r}: pick at most one of {ATTENTION_OPTIONS}, one "
                         f"of {DEEPGEMM_OPTIONS} and one of {KV_OPTIONS}")
    if dg and fmt not in DEEPGEMM_FORMATS:
        raise ValueError(
            f"variant {variant!r}: DeepGEMM serves only {DEEPGEMM_FORMATS} in SGLang 0.5.17 "
            "(w8a8_fp8 linears use CUTLASS fp8_scaled_mm and its MoE runner is hard-coded "
            "Triton, sglang/srt/layers/quantization/w8a8_fp8.py); use fp8_block:" + dg[0])
    kw: dict = {}
    env: dict = {}
    env_defaults: dict = {}
    if attn:
        kw["attention_backend"] = attn[0]
    if kv:
        kw |= get_kv_format(kv[0].removeprefix("kv_")).sglang_engine_kwargs
    if "fa3" in opts:
        env["SGLANG_USE_SGL_FA3_KERNEL"] = "1"
    if dg:
        env["SGLANG_ENABLE_JIT_DEEPGEMM"] = "1"
        env_defaults |= DEEPGEMM_ENV_DEFAULTS
        kw["fp8_gemm_runner_backend"] = "deep_gemm"
        if dg[0] == "deepgemm":
            kw["moe_runner_backend"] = "deep_gemm"
    return VariantPlan(variant, fmt, opts, kw, env, env_defaults,
                       own_moe_configs="sglang" not in opts)


def child_env(plan: VariantPlan, base: dict, moe_config_dir: str | None) -> dict:
    """The child's environment: ``base`` without ``SGLANG_MOE_CONFIG_DIR``, then
    ``moe_config_dir`` (when the plan uses megatron_qrl's configs and one is given), the
    plan's ``env_defaults`` unless ``base`` sets them, then its ``env``."""
    env = dict(base)
    env.pop("SGLANG_MOE_CONFIG_DIR", None)
    if plan.own_moe_configs and moe_config_dir:
        env["SGLANG_MOE_CONFIG_DIR"] = moe_config_dir
    for k, v in plan.env_defaults.items():
        env.setdefault(k, v)
    return env | plan.env
