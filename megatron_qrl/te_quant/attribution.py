"""Per-layer-type attribution of the train/rollout mismatch KL(pi_aligned || pi_bf16).

For one batch the trainer forward is run with quantization enabled in ONE layer type at a time
(attention, dense mlp, experts) and in all of them; each run's token-mean
``KL(pi_aligned || pi_bf16) = mean_t sum_v p_a(v|t) (log p_a(v|t) - log p_b(v|t))``
(ALGORITHMS.md section 5: the aligned forward is what the rollout computes) tells how much of
the mismatch that layer type causes, i.e. which layers are worth keeping in BF16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_qrl.models.hf_config import ModelArch
from megatron_qrl.te_quant.state import AlignedForwardState


def token_kl(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """Per-token ``KL(p || q) = sum_v p_v (log p_v - log q_v)`` from logits ``[..., V]`` (fp32)."""
    lp = F.log_softmax(logits_p.float(), dim=-1)
    lq = F.log_softmax(logits_q.float(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def megatron_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits ``[batch, seq, vocab]`` of a megatron ``GPTModel`` (no grad)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        out = model(ids, pos, attention_mask=None)
    if ps.get_tensor_model_parallel_world_size() > 1:
        out = gather_from_tensor_model_parallel_region(out)
    return out.float()


def layer_kinds(arch: ModelArch) -> tuple[str, ...]:
    """The quantizable layer types of ``arch``."""
    return ("attention", "experts") if arch.is_moe else ("attention", "mlp")


@dataclass(frozen=True)
class AttributionRow:
    """One row of the mismatch table."""

    layers: str
    """Layer type quantized in this run (``all``: every type)."""
    kl_mean: float
    """Token-mean KL(pi_aligned || pi_bf16)."""
    kl_max: float
    """Largest per-token KL."""
    share: float
    """kl_mean / kl_mean of ``all`` (types interact, so shares need not sum to 1)."""


def attribute_mismatch(model: Any, state: AlignedForwardState, arch: ModelArch,
                       ids: torch.Tensor) -> list[AttributionRow]:
    """Rows for each layer type of ``arch`` and ``all`` (``model`` built with ``state``)."""
    model.eval()
    with state.only(()):
        ref = megatron_logits(model, ids)
    runs = [(kind, (kind,)) for kind in layer_kinds(arch)] + [("all", layer_kinds(arch))]
    stats = []
    for label, kinds in runs:
        with state.only(kinds):
            kl = token_kl(megatron_logits(model, ids), ref)
        stats.append((label, float(kl.mean()), float(kl.max())))
    total = stats[-1][1]
    return [AttributionRow(label, mean, mx, mean / total if total > 0 else 0.0)
            for label, mean, mx in stats]


def format_table(rows: list[AttributionRow], fmt: str) -> str:
    """A fixed-width text table of ``rows``."""
    lines = [f"KL(pi_aligned || pi_bf16) by quantized layer type, format={fmt}",
             f"{'layers':<12}{'KL mean':>14}{'KL max':>14}{'share':>9}"]
    lines += [f"{r.layers:<12}{r.kl_mean:>14.4e}{r.kl_max:>14.4e}{r.share:>9.2f}" for r in rows]
    return "\n".join(lines)


def plot_rows(rows: list[AttributionRow], fmt: str, out: str) -> None:
    """Bar chart of the token-mean KL per layer type (PNG at ``out``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([r.layers for r in rows], [r.kl_mean for r in rows],
           color=["tab:blue"] * (len(rows) - 1) + ["tab:red"])
    ax.set_ylabel("token-mean KL(aligned || bf16)")
    ax.set_title(f"mismatch by layer type ({fmt})")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
