"""``qrl-quant-report``: what each rollout format does to a model, measured on CPU.

For every registered format it packs the model's weights exactly as weight sync does
(:meth:`QuantSpec.pack_state_dict`), checks the contract live (the rollout's dequantized
weights equal the trainer's fake-quantized ones, bit for bit), then runs the rollout-side
model (:func:`~megatron_qrl.quant.hf_reference.quantized_copy`) on random prompts and
reports per-format weight SQNR by layer kind, KL(pi_bf16 || pi_quant) per token, top-1
agreement and the packed size. The command line (``qrl-quant-report``) is
:mod:`megatron_qrl.models.quant_report_cli`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import get_spec
from .hf_reference import build_hf_model, hf_tensors, quantized_copy
from .targets import layer_kind

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "data" / "configs" / "quant_report_qwen3_moe.json"


def build_model(config_path: Path, seed: int) -> torch.nn.Module:
    """A randomly initialised fp32 HF model from a config.json (no hub access)."""
    torch.manual_seed(seed)
    return build_hf_model(json.loads(Path(config_path).read_text()), torch.float32)


def weight_stats(model: torch.nn.Module, fmt: str) -> dict:
    """SQNR by layer kind and the live contract check for one format."""
    spec = get_spec(fmt)
    tensors = dict(hf_tensors(model))
    packed = dict(spec.pack_state_dict(tensors.items()))
    sig: dict[str, float] = {}
    err: dict[str, float] = {}
    mismatched = 0
    for name, w in tensors.items():
        kind = layer_kind(name)
        if kind is None or not spec.is_quantized(name):
            continue
        rollout = spec.dequantize(spec.unpack(name, packed, dtype=w.dtype))
        if not torch.equal(rollout, spec.fake_quant_weight(w, global_amax=spec.shared_amax(name, tensors))):
            mismatched += 1
        sig[kind] = sig.get(kind, 0.0) + float(w.double().pow(2).sum())
        err[kind] = err.get(kind, 0.0) + float((w.double() - rollout.double()).pow(2).sum())
    sqnr = {k: (10 * torch.log10(torch.tensor(sig[k] / err[k])).item() if err[k] else float("inf"))
            for k in sig}
    # tensors a format leaves in high precision count as bf16, as the engine holds them
    nbytes = sum(t.numel() * (2 if n in tensors and not spec.is_quantized(n) else t.element_size())
                 for n, t in packed.items())
    return {"sqnr_db": sqnr, "contract_mismatches": mismatched, "packed_bytes": nbytes}


def logit_stats(model, fmt, input_ids) -> dict:
    """KL(pi_bf16 || pi_fmt) per token and top-1 agreement of the rollout-side model."""
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids).logits.float(), -1)
        lp = torch.log_softmax(quantized_copy(model, get_spec(fmt))(input_ids).logits.float(), -1)
    kl = (ref.exp() * (ref - lp)).sum(-1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agree": float((ref.argmax(-1) == lp.argmax(-1)).float().mean())}


def run_report(config: Path, formats: list[str], batch: int, seq_len: int, seed: int) -> dict:
    model = build_model(config, seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    bf16_bytes = sum(t.numel() * 2 for _, t in hf_tensors(model))
    rows = {}
    for fmt in tqdm(formats, desc="formats", unit="fmt"):
        t0 = time.perf_counter()
        row = weight_stats(model, fmt) | logit_stats(model, fmt, ids)
        row["size_vs_bf16"] = row["packed_bytes"] / bf16_bytes
        row["seconds"] = time.perf_counter() - t0
        rows[fmt] = row
    return {"config": str(config), "batch": batch, "seq_len": seq_len, "seed": seed, "formats": rows}


def format_table(report: dict) -> str:
    kinds = sorted({k for r in report["formats"].values() for k in r["sqnr_db"]})
    head = ["format", *(f"SQNR {k} dB" for k in kinds), "KL mean", "KL max", "top1 agree",
            "size/bf16", "contract"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fmt, r in report["formats"].items():
        sq = [f"{r['sqnr_db'].get(k, float('inf')):.1f}" for k in kinds]
        ok = "ok" if r["contract_mismatches"] == 0 else f"{r['contract_mismatches']} MISMATCH"
        lines.append("| " + " | ".join([fmt, *sq, f"{r['kl_mean']:.2e}", f"{r['kl_max']:.2e}",
                                        f"{r['top1_agree']:.3f}", f"{r['size_vs_bf16']:.2f}", ok]) + " |")
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> None:
    from ..utils.plots import new_figure, save_png

    fmts = [f for f in report["formats"] if f != "bf16"]
    rows = [report["formats"][f] for f in fmts]
    fig, (ax1, ax2) = new_figure(1, 2, figsize=(10, 4))
    ax1.bar(fmts, [r["kl_mean"] for r in rows], color="tab:red")
    ax1.set_yscale("log")
    ax1.set_title("KL(pi_bf16 || pi_rollout) per token")
    kinds = sorted({k for r in rows for k in r["sqnr_db"]})
    width = 0.8 / max(len(kinds), 1)
    for i, k in enumerate(kinds):
        ax2.bar([j + i * width for j in range(len(fmts))],
                [r["sqnr_db"].get(k, 0.0) for r in rows], width, label=k)
    ax2.set_xticks([j + 0.4 - width / 2 for j in range(len(fmts))], fmts)
    ax2.set_title("weight SQNR (dB) by layer kind")
    ax2.legend()
    fig.suptitle("megatron_qrl rollout formats on " + Path(report["config"]).stem)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
