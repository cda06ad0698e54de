"""Tiny random HF Qwen3 / Qwen3-MoE models and the aligned reference SGLang should match.

The reference is the transformers model whose quantized linears compute with
``spec.dequantize(spec.unpack(...))`` of the SAME tensors the engine loaded (read back from the
exported directory), with ``spec.fake_quant_activation`` on the inputs of those linears (the
dynamic per-token / per-group activation numerics of SGLang's W8A8 kernels). Log-probs are
computed teacher-forced on the engine's greedy tokens.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
import torch.nn.functional as F

VOCAB = 512
# dims valid for every format: fp8_block needs each q/k/v shard % 128, Marlin out % 64 and
# in % 128, SGLang fp8 MoE moe_intermediate % 128
DIMS = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=128,
            max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None)
MOE = dict(moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[])
WEIGHT_STD = 0.02
# lm_head and router get a larger std so that greedy choices are not near-ties everywhere
# (logit std ~1.6 instead of ~0.3), which makes token agreement a meaningful number
HEAD_STD = 0.1

_EXPERT = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def build_tiny(kind: str, out: Path, seed: int = 0) -> Path:
    """Save a random bf16 ``moe`` (Qwen3MoeForCausalLM) or ``dense`` (Qwen3ForCausalLM)."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**DIMS, **MOE) if kind == "moe" else Qwen3Config(**DIMS)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.05 * torch.randn_like(p, dtype=torch.float32))
            elif name.startswith("lm_head") or name.endswith("mlp.gate.weight"):
                p.copy_(HEAD_STD * torch.randn_like(p, dtype=torch.float32))
            else:
                p.copy_(WEIGHT_STD * torch.randn_like(p, dtype=torch.float32))
    model.save_pretrained(out)
    return out


def load_model(hf_dir: Path, device: str, dtype: torch.dtype = torch.bfloat16):
    """The HF model on ``device``, MoE experts replaced by :func:`experts_forward`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    model = model.to(device=device, dtype=dtype).eval()
    set_activation_quant(model, None)
    return model


def _expert_layout(experts) -> bool:
    """True if ``gate_up_proj`` is [E, 2I, H] (transformers 5), False if [E, H, 2I]."""
    e, a, b = experts.gate_up_proj.shape
    return a == 2 * experts.down_proj.shape[2]


def experts_forward(experts, act):
    """Replacement forward for transformers-5 ``Qwen3MoeExperts`` with activation fake quant.

    Per (token, expert): ``y = w_k * down(act(silu(gate(x_q)) * up(x_q)))`` with
    ``x_q = act(x)``, accumulated over the top-k in fp32 (SGLang's fused MoE multiplies the
    routing weight in its fp32 accumulator).
    """
    out_major = _expert_layout(experts)

    def forward(hidden_states, top_k_index, top_k_weights):
        acc = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        x_q = act(hidden_states)
        for e in range(experts.gate_up_proj.shape[0]):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            w13 = experts.gate_up_proj[e] if out_major else experts.gate_up_proj[e].t()
            w2 = experts.down_proj[e] if out_major else experts.down_proj[e].t()
            gate, up = F.linear(x_q[tok], w13).chunk(2, dim=-1)
            h = act(experts.act_fn(gate) * up)
            y = F.linear(h, w2).float() * top_k_weights[tok, pos, None].float()
            acc.index_add_(0, tok, y)
        return acc.to(hidden_states.dtype)

    return forward


def set_activation_quant(model, spec) -> None:
    """Apply ``spec.fake_quant_activation`` to the inputs of every quantized linear."""
    act = (lambda x: x) if spec is None else spec.fake_quant_activation
    for h in getattr(model, "_qrl_hooks", []):
        h.remove()
    model._qrl_hooks = []
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith("Experts"):
            mod.forward = experts_forward(mod, act)
        elif isinstance(mod, torch.nn.Linear) and spec is not None and spec.is_quantized(
                f"{name}.weight") and spec.quantizes_activations:
            model._qrl_hooks.append(mod.register_forward_pre_hook(
                lambda _m, args: (act(args[0]),) + tuple(args[1:])))


def _assign(params: dict, hf_name: str, w: torch.Tensor) -> None:
    if hf_name in params:
        p = params[hf_name]
        if p.shape != w.shape:
            raise ValueError(f"{hf_name}: model {tuple(p.shape)} vs packed {tuple(w.shape)}")
        p.data.copy_(w.to(p.dtype))
        return
    m = _EXPERT.match(hf_name)
    if m is None:
        raise KeyError(f"no model parameter for packed weight {hf_name}")
    e = int(m["e"])
    if m["proj"] == "down_proj":
        p = params[f"{m['base']}.down_proj"]
        dst = p.data[e] if p.shape[1:] == w.shape else p.data[e].t()
        dst.copy_(w.to(p.dtype))
        return
    p = params[f"{m['base']}.gate_up_proj"]
    inter = w.shape[0]
    rows = slice(0, inter) if m["proj"] == "gate_proj" else slice(inter, 2 * inter)
    if p.shape[1] == 2 * inter:
        p.data[e, rows].copy_(w.to(p.dtype))
    else:
        p.data[e][:, rows].copy_(w.t().to(p.dtype))


def read_safetensors_dir(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def aligned_model(base, export_dir: Path, spec, base_names: list[str], dtype=torch.bfloat16):
    """Copy of ``base`` whose quantized weights are dequantized from ``export_dir``."""
    model = copy.deepcopy(base).to(dtype)
    packed = read_safetensors_dir(export_dir)
    params = dict(model.named_parameters())
    n = 0
    for name in base_names:
        if not spec.is_quantized(name):
            continue
        q = spec.unpack(name, packed)
        w = spec.dequantize(q, dtype=torch.float32)
        _assign(params, name, w.to(next(model.parameters()).device))
        n += 1
    set_activation_quant(model, spec)
    model._qrl_n_dequantized = n
    return model


@torch.no_grad()
def teacher_force(model, prompts: list[list[int]], outputs: list[list[int]]):
    """Per prompt: (log-prob of each engine token, reference argmax at each position)."""
    dev = next(model.parameters()).device
    lps, tops = [], []
    for p, o in zip(prompts, outputs):
        ids = torch.tensor([p + o], device=dev)
        logits = model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        pos = torch.arange(len(p) - 1, len(p) - 1 + len(o), device=dev)
        tgt = torch.tensor(o, device=dev)
        lps.append(lp[pos, tgt].tolist())
        tops.append(lp[pos].argmax(dim=-1).tolist())
    return lps, tops


def compare(engine: dict, ref_lps, ref_tops) -> dict:
    """Greedy agreement and |log-prob| differences between an engine run and a reference."""
    toks = [t for o in engine["output_ids"] for t in o]
    elp = torch.tensor([v for o in engine["output_logprobs"] for v in o], dtype=torch.float64)
    rlp = torch.tensor([v for o in ref_lps for v in o], dtype=torch.float64)
    top = [t for o in ref_tops for t in o]
    d = (elp - rlp).abs()
    return {
        "greedy_agree": round(sum(a == b for a, b in zip(toks, top)) / len(toks), 4),
        "max_abs_dlogprob": float(d.max()),
        "mean_abs_dlogprob": float(d.mean()),
        "n_tokens": len(toks),
    }
