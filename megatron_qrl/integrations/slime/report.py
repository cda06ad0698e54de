"""What megatron_qrl installed in a slime trainer, said once on rank 0 (a line in slime's log).

Two lines, because slime builds the model after its init hook runs:

- :func:`install_line` (the init hook): the rollout format, whether the aligned forward was
  asked for and quantizes activations (and how), the AQN schedule of the weight syncs and the
  weight-sync quantizer that replaced slime's ``quantize_params``;
- :func:`aligned_line` (the first before-log-prob / before-train-step hook, when the model
  exists): how many linears the ``--spec`` swap made rollout-aligned, per layer kind, and their
  classes, so a run whose Transformer Engine linears were not replaced shows it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

PREFIX = "[megatron_qrl]"


def say(line: str) -> None:
    """Print ``line`` on rank 0 only (every rank when torch.distributed is not initialised)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        print(f"{PREFIX} {line}", flush=True)


def _activations(spec: Any) -> str:
    if not spec.quantizes_activations:
        return "activations BF16 (weight-only format)"
    group = f"1x{spec.act_group} groups" if spec.act_group else "per token"
    return f"activations quantized ({spec.activation}, {group})"


def _aqn(aqn: Any, total_steps: int) -> str:
    if not aqn.enabled:
        return "AQN off"
    sigmas = [aqn.sigma(s, total_steps) for s in range(total_steps)]
    shown = ", ".join(f"{s:.3g}" for s in sigmas[:8]) + (", ..." if total_steps > 8 else "")
    return (f"AQN on norm gains of the rollout copy: sigma {aqn.sigma_start:g} -> {aqn.sigma_end:g}"
            f" in {aqn.num_stages} stages over {total_steps} syncs (sync k: {shown})")


def install_line(opts: Any, quantizer: Any | None, total_steps: int) -> str:
    """The init hook's line: format, aligned forward, activations, AQN, weight-sync quantizer."""
    spec = opts.rollout.spec
    forward = opts.train.forward
    aligned = (f"train forward {forward} ({_activations(spec)}; the linears are counted when "
               "the model exists)" if forward == "aligned" else f"train forward {forward}")
    if quantizer is None:
        sync = "weight sync: slime's own quantize_params (nothing installed)"
    else:
        sync = (f"weight sync: slime's quantize_params replaced by QrlSlimeQuantizer "
                f"(QuantSpec {quantizer.spec.name} packs, seed {quantizer.seed})")
    return (f"rollout format {spec.name}; {aligned}; "
            f"{_aqn(opts.aqn, total_steps)}; {sync}")


def aligned_line(model: Any, states: list[Any]) -> str:
    """The first hook's line: the rollout-aligned linears of ``model`` by kind and class."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    linears = [m for chunk in chunks for m in chunk.modules()
               if getattr(m, "qrl_kind", None) is not None]
    kinds = Counter(m.qrl_kind for m in linears)
    classes = Counter(type(m).__name__ for m in linears)
    fmt = ", ".join(sorted({s.spec.name for s in states})) or "none"
    return (f"aligned forward: {len(linears)} linears rollout-aligned to {fmt} "
            f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}; "
            f"{', '.join(f'{k} x{n}' for k, n in sorted(classes.items()))}), "
            f"gemm {'/'.join(sorted({s.gemm for s in states}))}, "
            f"{_activations(states[0].spec) if states else 'no aligned state'}")
