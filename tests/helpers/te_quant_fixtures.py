"""Shared helpers of the te_quant / routing replay / mismatch report tests (no tests here).

Tiny random Qwen3 / Qwen3-MoE models whose dimensions suit every format (hidden 256, head_dim
128, 2 heads / 1 kv head, intermediate 512, moe_intermediate 128, 8 experts top-2, vocab 512:
``data/configs/quant_report_qwen3_moe.json``), built in memory with transformers.
"""

from __future__ import annotations

import contextlib
import json
import logging

import torch

from megatron_qrl.models import CONFIG_DIR
from megatron_qrl.models.hf_config import ModelArch, arch_from_dict

_MOE_ONLY = ("num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step",
             "mlp_only_layers", "moe_intermediate_size")


def tiny_cfg(kind: str, **overrides) -> dict:
    """config.json dict of the format-friendly tiny ``kind`` (``moe`` | ``dense``) model."""
    cfg = json.loads((CONFIG_DIR / "quant_report_qwen3_moe.json").read_text())
    cfg.update(overrides)
    if kind == "dense":
        cfg = {k: v for k, v in cfg.items() if k not in _MOE_ONLY}
        cfg.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    return cfg


def tiny_hf(kind: str, seed: int = 0, **overrides) -> tuple[torch.nn.Module, ModelArch]:
    """A random fp32 transformers model of ``kind`` and its :class:`ModelArch`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = tiny_cfg(kind, **overrides)
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    cls_cfg, cls = ((Qwen3MoeConfig, Qwen3MoeForCausalLM) if kind == "moe"
                    else (Qwen3Config, Qwen3ForCausalLM))
    torch.manual_seed(seed)
    model = cls(cls_cfg(**kwargs)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    return model, arch_from_dict(cfg)


def hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF-named tensors (per-expert names even for transformers-5 fused experts)."""
    from megatron_qrl.quant.hf_reference import hf_tensors

    return {n: t.clone() for n, t in hf_tensors(model)}


def ids(batch: int = 2, seq: int = 8, seed: int = 3, vocab: int = 512) -> torch.Tensor:
    """Deterministic token ids."""
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


FLIP_BATCH = dict(batch=4, seed=7)
"""The token batch of the trainer-vs-reference comparisons: any seed works (see :func:`flips`);
this one holds flips (dense fp8 and fp8_block, sequence 1), so the tolerance is exercised."""


def flips(got: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> dict[int, int]:
    """``{sequence: first token}`` of every sequence whose logits leave ``tol`` of the reference.

    The trainer and the reference compute in fp32 with different GEMM shapes, so they differ by
    accumulation order (~1e-6). An activation within ~1e-7 of a rounding boundary of the
    quantizer (int8 ``x * 127 / amax`` at n + 0.5, an E4M3 tie) then gets one code apart on the
    two sides: a flip. It moves that token's logits by up to ~1e-1 and, through attention, the
    later tokens of its sequence — never another sequence. About 4% of random 8-token
    sequences hold one per W8A8 format on the tiny models. A wrong scale, layout or missing
    hook moves every sequence from its first tokens on."""
    tok = (got.detach().float() - ref.detach().float()).abs().amax(-1)  # [batch, seq]
    out = {}
    for b in range(tok.shape[0]):
        over = (tok[b] > tol).nonzero()
        if len(over):
            out[b] = int(over[0])
    return out


def assert_close_up_to_flips(got: torch.Tensor, ref: torch.Tensor, what: str,
                             tol: float = 1e-4) -> dict[int, int]:
    """Every sequence within ``tol`` of the reference except at most half of them, each from
    a flip on (:func:`flips`); returns the flips."""
    found = flips(got, ref, tol)
    assert len(found) <= got.shape[0] // 2, (
        f"{what}: {len(found)} of {got.shape[0]} sequences leave {tol} of the reference "
        f"(sequence: first token {found}); rounding-boundary flips touch a few, not most")
    return found


def build(arch: ModelArch, tensors: dict, spec_hook=None, **overrides):
    """A megatron GPTModel of ``arch`` (call inside a megatron job) loaded with HF ``tensors``."""
    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.streaming import groups_from_parallel_state, load_hf_weights

    model = build_model(arch, spec_hook=spec_hook, **overrides)
    load_hf_weights(model, arch, tensors.__getitem__, groups_from_parallel_state())
    return model


def grads_as_hf(model: torch.nn.Module, arch: ModelArch) -> dict[str, torch.Tensor]:
    """Gradients of a megatron model under HF names (weights restored afterwards)."""
    from megatron_qrl.models.streaming import iter_hf_tensors

    saved = {}
    for name, p in model.named_parameters():
        saved[name] = p.data
        p.data = p.grad if p.grad is not None else torch.zeros_like(p)
    try:
        return dict(iter_hf_tensors(model, arch))
    finally:
        for name, p in model.named_parameters():
            p.data = saved[name]


@contextlib.contextmanager
def quiet_torch_trace():
    """Silence torch's structured-trace logger while pytest captures logs.

    pytest's log capture makes ``torch.__trace`` emit a DEBUG record per torch call inside
    megatron's code, which slows these CPU tests several-fold.
    """
    logger = logging.getLogger("torch.__trace")
    saved = logger.level, logger.propagate
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        yield
    finally:
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
