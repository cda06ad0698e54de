"""Per-layer-type attribution of the train/rollout mismatch KL(pi_aligned || pi_bf16).

For one batch the trainer forward is run with quantization enabled in ONE layer type at a time
(attention, dense mlp, experts) and in all of them; each run's token-mean
``KL(pi_aligned || pi_bf16) = mean_t sum_v p_a(v|t) (log p_a(v|t) - log p_b(v|t))``
(docs/ALGORITHMS.md section 5: the aligned forward is what the rollout computes) tells how much of
the mismatch that layer type causes, i.e. which layers are worth keeping in BF16.

With a quantized KV cache (``--kv-cache fp8_e4m3``) a ``kv cache`` row runs the BF16 weights
with K/V rounded as the engine's cache stores them (:mod:`megatron_qrl.te_quant.kv_core_attention`,
every position read as a decode step reads it) and ``all`` includes the rounding too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_qrl.models.hf_config import ModelArch
from megatron_qrl.te_quant.kv_core_attention import KVAlignState
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
    routing_agreement: float | None = None
    """MoE: mean fraction of top-k experts equal to the bf16 forward's (None for dense)."""


def _routing(replay: Any, arch: ModelArch) -> torch.Tensor | None:
    from megatron_qrl.moe import recorded_ids

    return None if replay is None else recorded_ids(replay, arch.num_layers)


def _runs(state: AlignedForwardState, arch: ModelArch, kv: KVAlignState | None
          ) -> list[tuple[str, tuple[str, ...], bool]]:
    """(row label, quantized layer kinds, KV rounding on) of each attribution run."""
    kinds = layer_kinds(arch) if state.spec.quantizes_weights else ()
    kv_on = kv is not None and kv.fmt.quantizes
    runs = [(kind, (kind,), False) for kind in kinds]
    if kv_on:
        runs.append(("kv cache", (), True))
    return runs + [("all", kinds, kv_on)]


def attribute_mismatch(model: Any, state: AlignedForwardState, arch: ModelArch,
                       ids: torch.Tensor, replay: Any = None,
                       kv: KVAlignState | None = None) -> list[AttributionRow]:
    """Rows for each layer type of ``arch``, the KV cache (``kv``: the model's
    :class:`KVAlignState`, when its format rounds) and ``all`` (``model`` built with
    ``state`` and ``kv``).

    ``replay``: the model's :class:`~megatron_qrl.moe.RoutingReplay` (mode ``off``) to also
    report how often quantization changes the routing of MoE models.
    """
    from contextlib import nullcontext

    from megatron_qrl.moe import routing_agreement

    def kv_as(flag: bool):
        return nullcontext() if kv is None else kv.enabled_as(flag)

    model.eval()
    with state.only(()), kv_as(False):
        ref = megatron_logits(model, ids)
        ref_routes = _routing(replay, arch)
    stats = []
    for label, kinds, kv_on in _runs(state, arch, kv):
        with state.only(kinds), kv_as(kv_on):
            kl = token_kl(megatron_logits(model, ids), ref)
            routes = _routing(replay, arch)
        agree = None if routes is None else float(routing_agreement(routes, ref_routes).mean())
        stats.append((label, float(kl.mean()), float(kl.max()), agree))
    total = stats[-1][1]
    return [AttributionRow(label, mean, mx, mean / total if total > 0 else 0.0, agree)
            for label, mean, mx, agree in stats]


def format_table(rows: list[AttributionRow], fmt: str) -> str:
    """A fixed-width text table of ``rows``."""
    lines = [f"KL(pi_aligned || pi_bf16) by quantized layer type, format={fmt}",
             f"{'layers':<12}{'KL mean':>14}{'KL max':>14}{'share':>9}{'routing agree':>15}"]
    for r in rows:
        agree = "-" if r.routing_agreement is None else f"{r.routing_agreement:.4f}"
        lines.append(f"{r.layers:<12}{r.kl_mean:>14.4e}{r.kl_max:>14.4e}{r.share:>9.2f}{agree:>15}")
    return "\n".join(lines)


def plot_rows(rows: list[AttributionRow], fmt: str, out: str) -> None:
    """Bar chart of the token-mean KL per layer type (PNG at ``out``)."""
    from ..utils.plots import new_figure, save_png

    fig, ax = new_figure(figsize=(5, 3.2))
    ax.bar([r.layers for r in rows], [r.kl_mean for r in rows],
           color=["tab:blue"] * (len(rows) - 1) + ["tab:red"])
    ax.set_ylabel("token-mean KL(aligned || bf16)")
    ax.set_title(f"mismatch by layer type ({fmt})")
    fig.tight_layout()
    save_png(fig, out, dpi=120)


def prompt_ids(hf_dir: str, prompts: str | None, batch: int, seq_len: int, vocab: int,
               seed: int = 0) -> torch.Tensor:
    """``[batch, seq_len]`` token ids: random ids, or the first prompts of ``prompts``.

    ``prompts``: a text file (one prompt per line) or JSONL with a ``prompt`` field, tokenized
    with the tokenizer in ``hf_dir`` and truncated / right-padded (by repeating) to ``seq_len``.
    """
    if prompts is None:
        return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from megatron_qrl.models.hf_io import HF_VOCAB_FILES

    if not any((Path(hf_dir) / name).is_file() for name in HF_VOCAB_FILES):
        raise ValueError(f"--prompts needs a tokenizer in --hf-dir {hf_dir}, which holds none of "
                         f"{' / '.join(HF_VOCAB_FILES)}; copy the model's tokenizer files into "
                         "it, or drop --prompts to use random token ids")
    try:
        tok = AutoTokenizer.from_pretrained(hf_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--prompts needs a tokenizer in --hf-dir {hf_dir} ({exc}); drop "
                         "--prompts to use random token ids") from None
    lines = [ln for ln in Path(prompts).read_text().splitlines() if ln.strip()][:batch]
    texts = []
    for i, ln in enumerate(lines, 1):
        if not ln.lstrip().startswith("{"):
            texts.append(ln)
            continue
        try:
            texts.append(str(json.loads(ln)["prompt"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--prompts {prompts}: prompt {i} is a JSON line without a string "
                             f"'prompt' field ({exc!r}); give one JSON object with 'prompt' or "
                             "plain text per line") from None
    if len(texts) < batch:
        raise ValueError(f"{prompts}: {len(texts)} prompts, need --batch {batch}")
    rows = []
    for i, text in enumerate(texts, 1):
        got = tok(text)["input_ids"]
        if not got:
            raise ValueError(f"--prompts {prompts}: prompt {i} encodes to no tokens with the "
                             f"tokenizer of --hf-dir {hf_dir}; give a non-empty prompt")
        rows.append((got * (seq_len // len(got) + 1))[:seq_len])
    return torch.tensor(rows, dtype=torch.long)


def run_report(hf_dir: str, fmt: str, ids: torch.Tensor, kv_cache: str = "bf16"
               ) -> tuple[ModelArch, list[AttributionRow]]:
    """Load ``hf_dir`` into a one-process megatron model with the aligned forward (and the
    KV-cache rounding of ``kv_cache``); attribute."""
    from megatron_qrl.models.hf_config import load_hf_config
    from megatron_qrl.models.hf_io import HFCheckpointReader
    from megatron_qrl.models.runtime import build_model, single_process_megatron
    from megatron_qrl.models.streaming import load_hf_weights
    from megatron_qrl.moe import RoutingReplay, replay_spec_hook
    from megatron_qrl.te_quant.kv_core_attention import kv_spec_hook
    from megatron_qrl.te_quant.spec_hook import aligned_spec_hook, compose_hooks

    _, arch = load_hf_config(hf_dir)
    state = AlignedForwardState(fmt)
    kv = KVAlignState(kv_cache)
    if not state.spec.quantizes_weights and not kv.fmt.quantizes:
        raise ValueError(f"--format {fmt} with --kv-cache {kv_cache} quantizes nothing; choose a "
                         "quantized format or KV cache")
    replay = RoutingReplay("off", arch.num_experts, arch.moe_top_k) if arch.is_moe else None
    hook = compose_hooks(aligned_spec_hook(state), replay and replay_spec_hook(replay),
                         kv_spec_hook(kv) if kv.fmt.quantizes else None)
    with single_process_megatron():
        model = build_model(arch, spec_hook=hook)
        load_hf_weights(model, arch, HFCheckpointReader(hf_dir).get)
        return arch, attribute_mismatch(model, state, arch, ids, replay,
                                        kv if kv.fmt.quantizes else None)
