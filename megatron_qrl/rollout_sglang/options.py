"""The SGLang engine's options: one frozen object from the flags to the engine.

:class:`SGLangOptions` is generated into the ``--qrl-rollout-sglang-*`` flags (it is the
``sglang`` field of :class:`megatron_qrl.config.run.RolloutConfig`) and passed whole to
:func:`~megatron_qrl.rollout_sglang.launch.start_job_engine`, to
:class:`~megatron_qrl.rollout_sglang.engine.SGLangEngine` and into a Ray engine actor.
:meth:`SGLangOptions.resolve` owns the rules of the sync paths: which paths SGLang 0.5.17 was
measured to support per format, the default path, and which speed options apply to which
path with their measured defaults (docs/BENCHMARKS.md). The flag checks call it too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from ..quant import get_spec, list_specs
from ..quant.engine_facts import SYNC_MODES
from ..quant.kv_cache import get_kv_format, list_kv_formats
from .attention import BACKENDS

__all__ = ["OPTION_SYNCS", "SYNC_MODES", "SYNC_SUPPORT", "SGLangOptions",
           "check_sync_supported", "default_sync"]

SYNC_SUPPORT: dict[tuple[str, str], bool] = {
    (name, path): works for name in list_specs()
    for path, works in get_spec(name).engine.sglang_syncs.items()}
"""``(format, sync path) -> works`` on SGLang 0.5.17, as each format declares it
(:attr:`megatron_qrl.quant.engine_facts.EngineFacts.sglang_syncs`); absent = not yet run."""

OPTION_SYNCS = {"flat_buckets": ("inplace",), "prefetch_buckets": ("tensor", "inplace"),
                "direct_expert_loads": ("inplace",), "stack_experts": ("inplace",)}
"""The syncs each speed option applies to."""

_FLAG = "--qrl-rollout-sglang-"


def _flag(field: str) -> str:
    return _FLAG + field.replace("_", "-")


@dataclass(frozen=True)
class SGLangOptions:
    """SGLang rollout engine: weight-sync path and speed options, placement, memory."""

    sync: Literal["auto", "tensor", "disk", "inplace", "distributed", "direct"] = field(
        default="auto",
        metadata={"on_resume": "may change"})
    """SGLang weight-sync path: tensor (update_weights_from_tensor, colocated), disk
    (safetensors in --qrl-rollout-sglang-sync-dir + update_weights_from_disk), inplace
    (tensor buckets re-processed into the engine's live quantized layout), distributed
    (--qrl-mode single, engine on other GPUs of the node: every bucket broadcast from the
    trainer's GPU over NCCL, --qrl-rollout-sglang-base-gpu), direct (colocated, one engine
    process, the formats whose EngineFacts.direct_write is set: the trainer's weights
    quantized straight into the engine's own tensors, by the trainer through their CUDA IPC
    handles, or, with --qrl-rollout-sglang-release-memory, whose memory saver's tensors CUDA
    IPC cannot export, by the engine from the trainer's tensors' handles), auto (the engine's
    choice per format)."""

    base_gpu: int = field(default=0, metadata={"on_resume": "may change"})
    """First GPU of the in-process SGLang engine (its TP ranks take the next ones); with
    --qrl-rollout-sglang-sync distributed, a GPU the trainer does not use."""

    sync_dir: str = field(default="/dev/shm", metadata={"on_resume": "may change"})
    """Directory for --qrl-rollout-sglang-sync disk (fast local storage)."""

    flat_buckets: bool | None = field(default=None, metadata={"on_resume": "may change"})
    """In-place sync: send each bucket as one flattened buffer (one CUDA-IPC handle per bucket
    instead of one per tensor). Unset: on for the in-place sync;
    --no-qrl-rollout-sglang-flat-buckets turns it off."""

    prefetch_buckets: int | None = field(default=None, metadata={"on_resume": "may change"})
    """Tensor / in-place sync: weight buckets prepared (packed, fingerprinted, flattened) in a
    thread ahead of the one the engine is loading (0: one after the other). Unset: 1 for the
    in-place sync, 0 for the tensor sync."""

    direct_expert_loads: bool | None = field(default=None, metadata={"on_resume": "may change"})
    """In-place sync: expert tensors go straight to their FusedMoE parameters' weight loaders
    in batched copies, skipping SGLang's per-tensor expert-mapping scan in load_weights
    (Qwen3-MoE). Unset: on for the in-place sync (the engine's bits equal a per-tensor load
    in all five formats); --no-qrl-rollout-sglang-direct-expert-loads turns it and
    --qrl-rollout-sglang-stack-experts off."""

    stack_experts: bool | None = field(default=None, metadata={"on_resume": "may change"})
    """In-place sync with direct expert loads: send each decoder layer's experts of one kind
    (e.g. every expert's gate_proj.weight) as one stacked tensor instead of one tensor per
    expert (~37k fewer wire tensors per Qwen3-30B-A3B sync); fingerprints stay per expert.
    Unset: on wherever direct expert loads are; --no-qrl-rollout-sglang-stack-experts turns
    it off."""

    hold_trainer_tensors: bool = field(default=True, metadata={"on_resume": "may change"})
    """Direct sync written by the engine (with --qrl-rollout-sglang-release-memory): the
    engine keeps the trainer's parameters it opened from their CUDA IPC handles (each
    ``cudaIpcOpenMemHandle`` costs ~0.4 ms, one per parameter allocation) and the trainer
    sends their names only while their storage is the one the engine opened (a parameter
    that kept its storage for a whole sync; temporaries made for a sync never are), the
    engine checking what it holds against the trainer's fingerprints before writing (an
    engine that lost them or holds a copy gets the request again with every handle, and
    every handle from then on); --no-qrl-rollout-sglang-hold-trainer-tensors sends every
    tensor's handle each sync. Off where the trainer sleeps during rollout
    (``rl.driver.engine_rollout_config``): PyTorch keeps memory it shared by CUDA IPC until
    the importer lets go, so weights the engine held would stay on the GPU through the
    trainer's sleep."""

    receipt: bool = field(default=True, metadata={"on_resume": "may change"})
    """In-place (and quantized distributed) syncs: each engine process fingerprints what it
    received, and the parameters it holds in the received layout, and the engine compares
    that receipt with the fingerprints of what was sent, failing the sync on the first
    tensor missing or different. --no-qrl-rollout-sglang-receipt skips it (only the
    engine's weight version is checked then)."""

    mem_fraction: float = 0.5
    """SGLang mem_fraction_static: share of GPU memory for the engine's weights + KV cache
    (the trainer needs the rest when colocated)."""

    release_memory: bool = True
    """Start SGLang with its memory saver (torch_memory_saver) and release the engine's GPU
    memory (weights, KV cache, CUDA graphs) after each rollout, resuming it before the next
    weight sync, so recompute + training get the GPU (--qrl-mode single and colocated; the
    sync refills every weight). --no-qrl-rollout-sglang-release-memory keeps it resident
    (then size --qrl-rollout-sglang-mem-fraction for engine + trainer together)."""

    kv_cache: str = field(default="bf16", metadata={"flag": "--qrl-rollout-kv-cache",
                                                    "choices": list_kv_formats})
    """KV-cache format of the rollout (megatron_qrl.quant.kv_cache): bf16, fp8_e4m3 or
    fp8_e5m2 (SGLang kv_cache_dtype, per-tensor scale 1.0). A rounding format also runs the
    engine without its radix cache and chunked prefill, so that which positions read rounded
    K/V is fixed (prompt: fresh, response: the cache); with --qrl-train-forward aligned the
    trainer's attention reads K/V rounded the same way."""

    attention_backend: str = field(default="auto", metadata={"choices": list(BACKENDS)})
    """SGLang's attention backend (rollout_sglang.attention): auto takes FA3 on Hopper where
    SGLang's FA3 kernel is installed and the KV cache is bf16 (FA3 decodes 12-19% faster than
    Triton on the H200), else triton; fa3, triton or flashinfer as asked (fa3 where it cannot
    run: one error naming what is missing)."""

    deterministic: bool = False
    """Start SGLang with enable_deterministic_inference: each request's sampling seed selects
    its samples (SGLang ignores the seeds otherwise: samples then depend on the engine, its
    history and the batch) and torch's ops run batch-invariant, so that the same prompts + seeds
    give the same tokens on any engine of the fleet and after a restart. SGLang 0.5.17 then forces the pytorch sampling backend, needs attention
    triton / fa3 / fa4 / flashinfer (ours: triton, radix cache kept), swaps torch's matmul,
    log_softmax, mean and rms_norm for batch-invariant Triton kernels, fixes the triton
    attention's KV split size, uses the default (untuned) fused-MoE kernel configs, disables
    piecewise prefill CUDA graphs and, with TP > 1, custom all-reduce (NCCL tree). Quantized
    GEMM kernels (int8 / fp8 / Marlin) are SGLang's own and not among the batch-invariant ops.
    Costs decode speed; off by default (the sampled distribution is the same either way)."""

    sleep_on_idle: bool = True
    """Start SGLang with sleep_on_idle: an idle scheduler waits on its request sockets (a
    request, generate or weight sync, wakes it at once) instead of polling them in a loop at
    100% of a CPU core through every training phase of the RL loop, beside the trainer.
    Measured on the H200 (30B-A3B slice, fp8 rollouts): the same train time either way (3.81 /
    3.80 s), rollout 4.9 vs 5.8 s (one run each). --no-qrl-rollout-sglang-sleep-on-idle keeps
    SGLang's polling."""

    def __post_init__(self) -> None:
        get_kv_format(self.kv_cache)  # an unknown format: one error naming the flag
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"{_flag('attention_backend')} must be one of "
                             f"{', '.join(BACKENDS)}, got {self.attention_backend!r}")
        if self.sync not in ("auto", *SYNC_MODES):
            raise ValueError(f"{_flag('sync')} must be one of auto, {', '.join(SYNC_MODES)}, "
                             f"got {self.sync!r}")
        for name in ("base_gpu", "prefetch_buckets"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{_flag(name)} must be an integer >= 0, got {v!r}")
        m = self.mem_fraction
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (
                math.isfinite(m) and 0.0 < m <= 1.0):
            raise ValueError(f"{_flag('mem_fraction')} must be a finite number in (0.0, 1.0], "
                             f"got {m!r}")

    @property
    def kv_engine_kwargs(self) -> dict:
        """The ``sglang.Engine`` arguments of :attr:`kv_cache`
        (``KVCacheFormat.sglang_engine_kwargs``)."""
        return get_kv_format(self.kv_cache).sglang_engine_kwargs

    @property
    def engine_kwargs(self) -> dict:
        """The ``sglang.Engine`` arguments these options set: ``mem_fraction_static``, the KV
        cache's (:attr:`kv_engine_kwargs`), ``enable_deterministic_inference`` where
        :attr:`deterministic` and ``sleep_on_idle`` where :attr:`sleep_on_idle`."""
        det = {"enable_deterministic_inference": True} if self.deterministic else {}
        idle = {"sleep_on_idle": True} if self.sleep_on_idle else {}
        return {"mem_fraction_static": self.mem_fraction} | self.kv_engine_kwargs | det | idle

    def replace(self, **changes) -> SGLangOptions:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def sync_for(self, spec_name: str, lora: bool = False) -> str:
        """The sync path of format ``spec_name``, the one place ``auto`` is resolved: the
        path asked for, else :func:`default_sync`, or ``inplace`` for a LoRA engine (SGLang's
        LoRA wrappers rename its parameters: only our in-place loader finds them)."""
        if self.sync != "auto":
            return self.sync
        return "inplace" if lora else default_sync(spec_name)

    def problem(self, spec_name: str) -> str | None:
        """Why these options cannot run with format ``spec_name`` (naming the flags), or None:
        a speed option asked for (True / > 0) on a sync it does not apply to, stacked experts
        without direct expert loads, or a (format, sync) SGLang 0.5.17 cannot update."""
        resolved = self.sync_for(spec_name)
        said = self.sync if self.sync != "auto" else f"auto ({resolved} for {spec_name})"
        if self.prefetch_buckets and resolved not in OPTION_SYNCS["prefetch_buckets"]:
            return (f"{_flag('prefetch_buckets')} applies to the tensor and in-place syncs, "
                    f"not {_flag('sync')} {said}")
        flags = [_flag(f) for f in ("flat_buckets", "direct_expert_loads", "stack_experts")
                 if getattr(self, f) is True and resolved not in OPTION_SYNCS[f]]
        if flags:
            return (f"{' and '.join(flags)} apply to the in-place sync ({_flag('sync')} "
                    f"inplace, the default for weight-quantized formats); this run syncs "
                    f"with {said}")
        if self.stack_experts and self.direct_expert_loads is False:
            return (f"{_flag('stack_experts')} needs direct expert loads (stacked expert "
                    "tensors are loaded straight into the FusedMoE parameters); drop "
                    f"--no-{_flag('direct_expert_loads')[2:]} or the first")
        if resolved == "direct" and not get_spec(spec_name).engine.direct_write:
            ok = [n for n in list_specs() if get_spec(n).engine.direct_write]
            return (f"{_flag('sync')} direct writes the packed tensors straight into the "
                    f"engine's live ones, which SGLang re-processes for {spec_name!r}; direct "
                    f"serves {ok}; use {_flag('sync')} inplace")
        return _unsupported(spec_name, resolved)

    def describe_sync(self) -> str:
        """One line for the run's log: the weight transport of these (resolved) options."""
        how = {"tensor": "update_weights_from_tensor, the stream in buckets",
               "disk": f"safetensors in {self.sync_dir}, then update_weights_from_disk",
               "inplace": "packed buckets re-processed into the engine's live layout",
               "distributed": "buckets broadcast over the weight-update group"}
        if self.sync == "direct":
            held = ("the trainer's tensors held across syncs" if self.hold_trainer_tensors
                    else "every handle opened anew each sync")
            text = ("quantized straight into the engine's tensors by the engine, from the "
                    f"trainer's CUDA IPC handles, {held} (its memory saver's tensors cannot be "
                    "handed out)" if self.release_memory else "quantized straight into the "
                    "engine's tensors by the trainer, through their CUDA IPC handles")
        else:
            text = how.get(self.sync, self.sync)
        saver = "memory saver on" if self.release_memory else "engine resident"
        return f"SGLang weight sync: {self.sync} ({text}; {saver})"

    def resolve(self, spec_name: str) -> SGLangOptions:
        """These options for format ``spec_name`` with every choice made: ``sync`` auto ->
        the format's default path; unset speed options -> their measured defaults for the
        path (in place: flat buckets, one bucket prefetched, direct expert loads over the
        expert-stacked wire; none of them elsewhere). Raises ``ValueError`` with
        :meth:`problem`'s text (``NotImplementedError`` for an unsupported format / path)."""
        text = self.problem(spec_name)
        if text is not None:
            err = NotImplementedError if text.startswith("SGLang 0.5.17 cannot") else ValueError
            raise err(text)
        sync = self.sync_for(spec_name)
        inplace = sync == "inplace"
        direct = inplace if self.direct_expert_loads is None else self.direct_expert_loads
        return self.replace(
            sync=sync, direct_expert_loads=direct,
            stack_experts=direct if self.stack_experts is None else self.stack_experts,
            flat_buckets=inplace if self.flat_buckets is None else self.flat_buckets,
            prefetch_buckets=(1 if inplace else 0) if self.prefetch_buckets is None
            else self.prefetch_buckets)


def default_sync(spec_name: str) -> str:
    """``inplace`` for formats that quantize weights (their loaded layout differs from the
    checkpoint's), ``tensor`` for bf16."""
    return "inplace" if get_spec(spec_name).quantizes_weights else "tensor"


def _unsupported(spec_name: str, sync: str) -> str | None:
    spec = get_spec(spec_name)
    known = spec.engine.sglang_syncs.get(sync)
    if known or (known is None and not (sync == "tensor" and spec.quantizes_weights)):
        return None
    works = sorted(f"{f}/{p}" for f in list_specs()
                   for p, ok in get_spec(f).engine.sglang_syncs.items() if ok)
    why = ("measured on H200" if known is False else "SGLang's plain load_weights cannot "
           "reload a quantized layer after its post-load processing; every quantized format "
           "measured failed")
    return (f"SGLang 0.5.17 cannot update {spec_name!r} weights in place with sync={sync!r} "
            f"({why}; see the format's EngineFacts.sglang_syncs). Known to work: {works}; use "
            "sync='inplace' (--qrl-rollout-sglang-sync inplace), --qrl-rollout-engine "
            "reference, or another format / sync path")


def check_sync_supported(spec_name: str, sync: str) -> None:
    """Raise ``NotImplementedError`` for a (format, sync path) known not to work on SGLang
    0.5.17: those measured broken, and ``tensor`` for any format that quantizes weights
    unless measured working."""
    text = _unsupported(spec_name, sync)
    if text is not None:
        raise NotImplementedError(text)
