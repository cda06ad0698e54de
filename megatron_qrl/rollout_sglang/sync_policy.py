"""Which weight-sync path and speed options an SGLang engine gets (pure functions).

The sync paths of :class:`~megatron_qrl.rollout_sglang.engine.SGLangEngine` that SGLang 0.5.17
was measured to support per format, the default path, and the speed options per path with
their measured defaults (docs/BENCHMARKS.md). ``--qrl-rollout-sglang-*`` flag checks read the
same tables.
"""

from __future__ import annotations

from ..quant import get_spec

__all__ = ["OPTION_SYNCS", "SYNC_MODES", "SYNC_SUPPORT", "check_sync_supported",
           "default_sync", "sync_options"]

# In-place weight updates of a running SGLang 0.5.17 engine, measured on the H200
# (tests/gpu/test_sglang_engine.py and tests/gpu/test_sglang_inplace.py, 2026-11-29): True
# works, False fails, absent = not yet run. "distributed" ran between two GPUs over NCCL.
# Plain "tensor" (SGLang's own model.load_weights) fails for every format that quantizes
# weights that was measured: int8 and fp8 raise "'Parameter' object has no attribute
# 'weight_loader'" (w8a8 replaces its parameters after loading), fp8_block killed the engine;
# it is refused for those formats unless measured True here (use "inplace").
# int8 and fp8 over disk (SGLang's update_weights_from_disk, the same load_weights) fail the
# same way; bf16 and fp8_block over disk work.
SYNC_MODES = ("inplace", "tensor", "disk", "distributed")
SYNC_SUPPORT: dict[tuple[str, str], bool] = {
    ("bf16", "tensor"): True,
    ("bf16", "disk"): True,
    ("fp8_block", "disk"): True,
    ("fp8", "disk"): False,
    ("fp8_block", "tensor"): False,
    ("int8", "tensor"): False,
    ("fp8", "tensor"): False,
    ("int8", "disk"): False,
    ("int8", "inplace"): True,
    ("fp8", "inplace"): True,
    ("fp8_block", "inplace"): True,
    ("w4a16", "inplace"): True,
    ("nvfp4", "inplace"): True,
    ("bf16", "distributed"): True,
    ("int8", "distributed"): True,
    ("fp8", "distributed"): True,
}


def check_sync_supported(spec_name: str, sync: str) -> None:
    """Raise for a (format, sync path) known not to work on SGLang 0.5.17: those measured
    broken, and ``tensor`` for any format that quantizes weights unless measured working."""
    known = SYNC_SUPPORT.get((spec_name, sync))
    if known or (known is None and not (sync == "tensor"
                                        and get_spec(spec_name).quantizes_weights)):
        return
    works = sorted(f"{f}/{p}" for (f, p), ok in SYNC_SUPPORT.items() if ok)
    why = ("measured on H200" if known is False else "SGLang's plain load_weights cannot "
           "reload a quantized layer after its post-load processing; every quantized format "
           "measured failed")
    raise NotImplementedError(
        f"SGLang 0.5.17 cannot update {spec_name!r} weights in place with sync={sync!r} "
        f"({why}; see SYNC_SUPPORT in {__name__}). Known to work: {works}; use "
        "sync='inplace' (--qrl-rollout-sglang-sync inplace), --qrl-rollout-engine reference, "
        "or another format / sync path")


def default_sync(spec_name: str) -> str:
    """``inplace`` for formats that quantize weights (their loaded layout differs from the
    checkpoint's), ``tensor`` for bf16."""
    return "inplace" if get_spec(spec_name).quantizes_weights else "tensor"


OPTION_SYNCS = {"flatten_buckets": ("inplace",), "prefetch_buckets": ("tensor", "inplace"),
                "direct_expert_loads": ("inplace",), "stack_experts": ("inplace",)}
"""The syncs each speed option of :class:`SGLangEngine` applies to (the flag checks of
``--qrl-rollout-sglang-*`` read it too)."""


def sync_options(sync: str, flatten_buckets: bool | None = None,
                 prefetch_buckets: int | None = None,
                 direct_expert_loads: bool | None = None, stack_experts: bool | None = None
                 ) -> tuple[bool, int, bool, bool]:
    """The sync speed options of :class:`SGLangEngine` for ``sync``: unset (None) means the
    default measured for it (in place: flat buckets, one bucket prefetched, direct expert
    loads over the expert-stacked wire; none of them elsewhere: docs/BENCHMARKS.md); an
    option asked for where it does not apply is an error (``stack_experts`` needs
    ``direct_expert_loads``: stacked tensors are loaded directly)."""
    if prefetch_buckets is not None and prefetch_buckets < 0:
        raise ValueError(f"prefetch_buckets must be >= 0, got {prefetch_buckets}")
    for name, on in (("flatten_buckets", flatten_buckets), ("direct_expert_loads",
                     direct_expert_loads), ("stack_experts", stack_experts),
                     ("prefetch_buckets", prefetch_buckets)):
        if on and sync not in OPTION_SYNCS[name]:
            raise ValueError(f"{name} applies to sync=" + " and ".join(
                repr(s) for s in OPTION_SYNCS[name]) + f" (got sync={sync!r})")
    inplace = sync == "inplace"
    direct = inplace if direct_expert_loads is None else bool(direct_expert_loads)
    if stack_experts and not direct:
        raise ValueError("stack_experts=True needs direct_expert_loads=True (stacked expert "
                         "tensors are loaded straight into the FusedMoE parameters; "
                         "--qrl-rollout-sglang-stack-experts needs "
                         "--qrl-rollout-sglang-direct-expert-loads)")
    stack = direct if stack_experts is None else bool(stack_experts)
    if prefetch_buckets is None:
        prefetch_buckets = 1 if inplace else 0
    flat = inplace if flatten_buckets is None else bool(flatten_buckets)
    return flat, prefetch_buckets, direct, stack
