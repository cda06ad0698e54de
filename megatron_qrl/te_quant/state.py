"""Shared state of one model's rollout-aligned forward: weight version and enabled layer kinds.

One :class:`AlignedForwardState` is created per model by :func:`~megatron_qrl.te_quant.
spec_hook.aligned_spec_hook` and handed to every aligned linear through its ``ModuleSpec``
params (no module-level caches). The quantized weights are cached in the linears and
recomputed lazily on the first forward after the weights changed: the version counter is
bumped by :meth:`AlignedForwardState.mark_weights_updated` (called automatically after
``optimizer.step()`` once :meth:`AlignedForwardState.attach_to_optimizer` hooked the
optimizer), and a parameter's own ``torch`` version counter also invalidates the cache when
the weight was changed in place through autograd-visible ops (``param.add_``).

The refresh is lazy: each linear quantizes its weight when the first forward after a change
reaches it. Its finiteness is not read on the host there (one device->host sync per linear,
six per layer of Qwen3-30B-A3B, each draining the GPU's queue mid-forward); the refresh
records it in the state's one :class:`~megatron_qrl.quant.finite_checks.FiniteChecks`
(:meth:`AlignedForwardState.finite_checks`) and :meth:`AlignedForwardState.check_finite`
reads it with one sync, raising :class:`~megatron_qrl.utils.finite.NonFiniteError` naming
the first non-finite weight in forward order (what the immediate check raised, later in the
same step). Where it is read: at the end of the forward (and backward) of the micro batches
that refreshed (``rl.trainer.PolicyTrainer._run``: before the step's loss / gradient-norm
reads, which drain the queue anyway, and before the non-finite-loss guard could count the
step as merely skipped), and, for callers that drive the model themselves, before the
attached optimizer applies an update (a step pre-hook), in :meth:`mark_weights_updated`,
before the weight sync hands out cached codes (``rl.qcache_sync``) and when the next refresh
starts with the last one unread. So a result computed from a NaN weight is never used
silently: the step that computed it stops with the error, as before. The end of the first
forward rather than the optimizer step: a forward-only pass (the log-prob recompute) has no
step, and under the guard a NaN loss skips the step without ever reaching the optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from megatron_qrl.quant import QuantSpec, get_spec
from megatron_qrl.quant.finite_checks import FiniteChecks
from megatron_qrl.quant.targets import LAYER_KINDS
from megatron_qrl.te_quant.fp8_backward import (
    BACKWARD_FLAG,
    BACKWARDS,
    GRAD_FORMAT,
    WGRAD_FLAG,
    check_fp8_backward,
    check_fp8_wgrad,
)


class AlignedForwardState:
    """What the aligned linears of one model read at forward time."""

    def __init__(self, spec: QuantSpec | str, kinds: Iterable[str] = LAYER_KINDS,
                 gemm: str = "fake", backward: str = "bf16", wgrad: str = "bf16") -> None:
        self.spec: QuantSpec = get_spec(spec) if isinstance(spec, str) else spec
        """The rollout format the forward is aligned to."""
        if gemm not in ("fake", "real"):
            raise ValueError(f"AlignedForwardState: gemm must be fake|real, got {gemm!r}")
        if gemm == "real":
            from megatron_qrl.te_quant.real_gemm import kernel_for

            kernel_for(self.spec)  # one clear error where the format has no real GEMM
        self.gemm: str = gemm
        """``fake``: dequantized operands in a BF16 GEMM; ``real``: the codes and scales in the
        format's low-bit GEMM (:mod:`megatron_qrl.te_quant.real_gemm`); the cache then holds
        the codes and scales, not a dequantized weight."""
        for flag, value, check in ((BACKWARD_FLAG, backward, check_fp8_backward),
                                   (WGRAD_FLAG, wgrad, check_fp8_wgrad)):
            if value not in BACKWARDS:
                raise ValueError(f"{flag} must be one of {BACKWARDS}, got {value!r}")
            if value != "bf16":
                check(self.spec, gemm)
        self.backward: str = backward
        """Input-gradient GEMM of the real linears: ``bf16`` (straight-through, the fake
        path's) or ``fp8`` (:mod:`megatron_qrl.te_quant.fp8_backward`; needs ``gemm`` real)."""
        self.wgrad: str = wgrad
        """Weight-gradient GEMM of the real linears: ``bf16`` (straight-through, the fake
        path's) or ``fp8`` (the saved activation codes in an FP8 GEMM,
        :mod:`megatron_qrl.te_quant.fp8_backward`; needs ``gemm`` real)."""
        self.grad_format: str = GRAD_FORMAT
        """FP8 element type of the quantized gradient under ``fp8`` (a key of
        :data:`~megatron_qrl.te_quant.fp8_backward.GRAD_DTYPES`; ``e4m3``, measured)."""
        self.version: int = 0
        """Bumped after every optimizer step; part of each linear's cache key."""
        self.keep_codes: bool = False
        """The fake GEMM's cache also keeps each HF tensor's codes and scales (the weight sync
        packs them instead of quantizing again, :mod:`megatron_qrl.te_quant.qcodes`); the
        real GEMM's cache holds them anyway. Costs one code tensor per weight."""
        self.keep_dequantized: bool = False
        """The real GEMM's cache also keeps ``deq Q_w(W)`` in BF16 once the first backward of
        an optimizer step made it (:meth:`~.real_gemm.RealWeight.grad_weight`), instead of
        dequantizing every weight again in each micro batch's backward. Costs 2 bytes per
        weight element (all local experts: 4.8 GB for 4 layers of Qwen3-30B-A3B, 58 GB for
        its 48 layers, divided by the expert-parallel size); gradients are the same bits.
        Off by default; set before the step's first forward."""
        self.enabled_kinds: frozenset[str] = self._check_kinds(kinds)
        """Layer kinds (``attention``, ``mlp``, ``experts``) that run quantized now."""
        self.inputs_quantized: bool = False
        """True while a caller feeds the linears inputs it already quantized (see
        :meth:`inputs_prequantized`)."""
        self._hooks: list[Any] = []
        self._checked_optimizers: set[int] = set()
        self._finite: tuple[FiniteChecks, int, QuantSpec] | None = None
        """The checks the refresh of weight version ``[1]`` recorded, not read yet."""

    @staticmethod
    def _check_kinds(kinds: Iterable[str]) -> frozenset[str]:
        kinds = frozenset(kinds)
        bad = sorted(kinds - set(LAYER_KINDS))
        if bad:
            raise ValueError(f"unknown layer kinds {bad}; choose from {list(LAYER_KINDS)}")
        return kinds

    def gemm_for(self, kind: str) -> str:
        """The GEMM linears of layer kind ``kind`` run: :attr:`gemm`, but ``fake`` for the
        experts of a format whose real GEMM has no experts form
        (:func:`~megatron_qrl.te_quant.real_gemm.experts_gemm`)."""
        if kind != "experts" or self.gemm == "fake":
            return self.gemm
        from megatron_qrl.te_quant.real_gemm import experts_gemm

        return experts_gemm(self.spec, self.gemm)[0]

    def grad_fp8(self) -> str | None:
        """The FP8 element type of the real linears' input-gradient GEMM, None for BF16."""
        return self.grad_format if self.backward == "fp8" else None

    def wgrad_fp8(self) -> str | None:
        """The FP8 element type of the real linears' weight-gradient GEMM, None for BF16."""
        return self.grad_format if self.wgrad == "fp8" else None

    def mark_weights_updated(self) -> None:
        """Invalidate every cached quantized weight (call after ``optimizer.step()``); the
        refresh of the weights before, if unread, is checked first (:meth:`check_finite`)."""
        self.check_finite()
        self.version += 1

    def finite_checks(self) -> FiniteChecks:
        """Where a refresh of ``Q_w(W)`` records its weights' finiteness (device bools, no
        host sync): one :class:`~megatron_qrl.quant.finite_checks.FiniteChecks` per weight
        version; a refresh of a newer version first checks the older one's
        (:meth:`check_finite`)."""
        if self._finite is not None and self._finite[1] != self.version:
            self.check_finite()
        if self._finite is None:
            self._finite = (FiniteChecks(), self.version, self.spec)
        return self._finite[0]

    def check_finite(self) -> None:
        """Read the unread refresh's finiteness: one host sync per device (none when nothing
        was refreshed since the last read); raises
        :class:`~megatron_qrl.utils.finite.NonFiniteError` naming the first weight, in
        refresh order, that held a NaN / Inf (module doc: where it is called)."""
        pending, self._finite = self._finite, None
        if pending is not None:
            pending[0].check(pending[2])

    def name_modules(self, model: Any) -> None:
        """Name the weight of each aligned module of ``model`` (those reading this state) by
        its parameter name, ``decoder.layers.1.self_attention.linear_proj.weight``, in the
        errors of its refresh (:meth:`check_finite`); unnamed: layer kind and class."""
        for name, module in model.named_modules():
            if getattr(module, "qrl_state", None) is self and hasattr(module, "qrl_kind"):
                module.qrl_name = f"{name}.weight"

    def is_enabled(self, kind: str) -> bool:
        """True if linears of layer kind ``kind`` run quantized now."""
        return self.spec.quantizes_weights and kind in self.enabled_kinds

    @contextmanager
    def only(self, kinds: Iterable[str]) -> Iterator[None]:
        """Quantize only ``kinds`` inside the block (``()``: the plain BF16 forward)."""
        saved = self.enabled_kinds
        self.enabled_kinds = self._check_kinds(kinds)
        try:
            yield
        finally:
            self.enabled_kinds = saved

    @contextmanager
    def inputs_prequantized(self) -> Iterator[None]:
        """Inside the block the aligned linears take their inputs as already quantized.

        Per-token activation quantization treats each row alone, so a caller may quantize
        many linears' inputs in one call (``AlignedSequentialMLP``: all experts at once).
        """
        saved = self.inputs_quantized
        self.inputs_quantized = True
        try:
            yield
        finally:
            self.inputs_quantized = saved

    def attach_to_optimizer(self, optimizer: Any) -> None:
        """Bump the version after every step of ``optimizer``, and check the unread refresh
        (:meth:`check_finite`) before it applies an update.

        Accepts a ``torch.optim.Optimizer`` or a megatron-core ``MegatronOptimizer`` /
        ``ChainedOptimizer`` (the hook goes on the inner torch optimizers; the cache is only
        invalidated there and recomputed at the next forward, after Megatron copied the
        updated main params into the model params).
        """
        found = list({id(o): o for o in _torch_optimizers(optimizer)}.values())
        if not found:
            raise TypeError(
                f"attach_to_optimizer: {type(optimizer).__name__} holds no torch.optim.Optimizer; "
                "call state.mark_weights_updated() after each step instead")
        self.check_before_steps(optimizer)
        for opt in found:
            self._hooks.append(opt.register_step_post_hook(
                lambda *_args, **_kw: self.mark_weights_updated()))

    def check_before_steps(self, optimizer: Any) -> None:
        """Check the unread refresh (:meth:`check_finite`) before every step of ``optimizer``
        (its inner torch optimizers) applies an update; once per optimizer, however often
        called (for hosts that bump the version themselves: slime's hooks)."""
        for opt in {id(o): o for o in _torch_optimizers(optimizer)}.values():
            if id(opt) not in self._checked_optimizers:
                self._checked_optimizers.add(id(opt))
                self._hooks.append(opt.register_step_pre_hook(
                    lambda *_args, **_kw: self.check_finite()))


def _torch_optimizers(optimizer: Any) -> Iterator[Any]:
    import torch

    if isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer
        return
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained:  # megatron's ChainedOptimizer (EP > 1): its ``.optimizer`` asserts on > 1
        for child in chained:
            yield from _torch_optimizers(child)
        return
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer:
        yield from _torch_optimizers(inner)
