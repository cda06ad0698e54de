"""The walk's log-prob checks: slime's recompute forward against the rollout's reference forward.

Run inside :mod:`tests.helpers.slime_walk` (its subprocess, Megatron-LM 1dcf0da, slime 0.3.1).
On the walk's packed samples, slime's ``get_log_probs_and_entropy`` of slime's model after the
before-log-prob hook (the aligned forward), of the same model with quantization off
(``state.only(())``), and the log-probs of two transformers Qwen3 models (not Megatron): the
fp8_block export SGLang starts from (``spec.dequantize`` of its codes and scales, SGLang's
per-token-group activation quantization: :mod:`megatron_qrl.quant.hf_reference`) and the BF16
checkpoint slime loads (``--load``). Then the hook timing of slime's trainer: weights changed the
way Megatron's optimizer writes them (``param.data.copy_``: no autograd version bump, same
storage), then the before-log-prob hook, then the forward.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _megatron_logprobs(args: Any, model: Any, batch: dict[str, Any]) -> Any:
    """slime's log-probs of each sample's response, one sample per forward (the walk has no
    THD ``packed_seq_params``: a packed forward would attend across samples)."""
    import torch
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy

    out = []
    with torch.no_grad():
        for tok, r in zip(batch["unconcat_tokens"], batch["response_lengths"]):
            t = tok.numel()
            logits = model(tok[None], torch.arange(t)[None], attention_mask=None)
            _, got = get_log_probs_and_entropy(
                logits.float(), args=args, unconcat_tokens=[tok], total_lengths=[t],
                response_lengths=[r])
            out += got["log_probs"]
    return torch.cat(out)


def _hf_logprobs(hf: Any, batch: dict[str, Any]) -> Any:
    import torch

    out = []
    with torch.no_grad():
        for tok, r in zip(batch["unconcat_tokens"], batch["response_lengths"]):
            lp = torch.log_softmax(hf(tok[None]).logits[0].float(), -1)
            t = tok.numel()
            out.append(lp[t - r - 1:t - 1].gather(-1, tok[t - r:, None])[:, 0])
    return torch.cat(out)


def hf_models(args: Any, dtype: Any = None) -> tuple[Any, Any]:
    """transformers models of the fp8_block export (with activation quant) and of ``--load``."""
    import torch
    from safetensors.torch import load_file

    from megatron_qrl.quant import get_spec
    from megatron_qrl.quant.hf_reference import (
        attach_activation_quant,
        build_hf_model,
        hf_tensor_names,
        load_packed_weights,
    )

    export = Path(args.hf_checkpoint)
    cfg = json.loads((export / "config.json").read_text())
    spec = get_spec(args.qrl_rollout_format)
    dtype = dtype or torch.bfloat16
    ref = build_hf_model(cfg, dtype)
    bad = load_packed_weights(ref, spec, load_file(export / "model.safetensors"),
                              hf_tensor_names(ref))
    assert not bad, bad
    attach_activation_quant(ref, spec)
    bf16 = build_hf_model(cfg, dtype)
    missing, unexpected = bf16.load_state_dict(
        load_file(Path(args.load) / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    bf16.tie_weights()
    return ref, bf16


def _dist(a: Any, b: Any) -> float:
    return float((a - b).abs().mean())


def logprob_alignment(args: Any, model: Any, batch: dict[str, Any],
                      dtype: Any = None) -> dict[str, Any]:
    """Mean |log-prob differences| between slime's forward (aligned / off) and the references
    (``dtype``: the transformers models', BF16 by default as slime's model)."""
    from megatron_qrl.integrations.slime.hooks import qrl_before_log_prob
    from megatron_qrl.integrations.slime.model import aligned_states

    model.eval()
    qrl_before_log_prob(args, [model], "")
    states = aligned_states([model])
    aligned = _megatron_logprobs(args, model, batch)
    with states[0].only(()):
        off = _megatron_logprobs(args, model, batch)
    ref, bf16 = hf_models(args, dtype)
    ref_lp, bf16_lp = _hf_logprobs(ref, batch), _hf_logprobs(bf16, batch)
    model.train()
    return {"aligned_vs_ref": _dist(aligned, ref_lp), "off_vs_ref": _dist(off, ref_lp),
            "off_vs_hf_bf16": _dist(off, bf16_lp), "aligned_vs_off": _dist(aligned, off),
            "ref_vs_hf_bf16": _dist(ref_lp, bf16_lp), "tokens": int(aligned.numel())}


def fp32_alignment(args: Any, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """:func:`logprob_alignment` with slime's GPT model and the references in FP32 (changes
    ``model``: the walk's last step). Without BF16 rounding upstream of each per-token-group
    activation quantization, no E4M3 code lands on the other side of a rounding boundary, so
    the aligned forward must equal the export's forward to FP32 rounding."""
    import torch

    gpt = model.module.float()  # out of megatron's Float16Module, which casts to BF16
    return logprob_alignment(args, gpt, batch, torch.float32)


def hook_timing(args: Any, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """Weights written as Megatron's optimizer writes them, then slime's before-log-prob hook:
    the next forward must use Q(W) of the new weights (the cache key alone cannot see it)."""
    import torch

    from megatron_qrl.integrations.slime.hooks import qrl_before_log_prob

    model.eval()
    qrl_before_log_prob(args, [model], "")
    before = _megatron_logprobs(args, model, batch)
    linears = [m for m in model.modules() if getattr(m, "qrl_kind", None) is not None]
    saved = [lin.weight.detach().clone() for lin in linears]
    recomputes = sum(lin.qrl_recomputes for lin in linears)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for lin in linears:  # Megatron's _copy_main_params_to_model_params: .data.copy_
            step = torch.randn(lin.weight.shape, generator=g) * lin.weight.float().std() * 0.5
            lin.weight.data.copy_(lin.weight.float() + step)
    qrl_before_log_prob(args, [model], "")
    after = _megatron_logprobs(args, model, batch)
    fresh = sum(lin.qrl_recomputes for lin in linears) - recomputes
    for lin in linears:  # Q(W) of the new weights, whatever the hook did
        lin._qrl_cache = None
    rebuilt = _megatron_logprobs(args, model, batch)
    with torch.no_grad():
        for lin, w in zip(linears, saved):
            lin.weight.data.copy_(w)
    qrl_before_log_prob(args, [model], "")
    model.train()
    return {"linears": len(linears), "recomputed": fresh, "changed": _dist(after, before),
            "after_vs_rebuilt": _dist(after, rebuilt)}
