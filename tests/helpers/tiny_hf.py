"""Tiny random HF Qwen3 / Qwen3-MoE checkpoints (safetensors) for the model/converter tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_qrl.models import CONFIG_DIR

CONFIGS = {"dense": "tiny_qwen3.json", "moe": "tiny_qwen3_moe.json"}


def tiny_config(kind: str, **overrides) -> dict:
    """The shipped tiny config.json of ``kind`` ("dense" | "moe") with ``overrides``."""
    cfg = json.loads((CONFIG_DIR / CONFIGS[kind]).read_text())
    cfg.update(overrides)
    return cfg


def make_tiny_hf(out_dir: Path, kind: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                 **overrides) -> Path:
    """Save a random tiny HF model of ``kind`` to ``out_dir``; return the directory.

    Every weight is random (norm gains around 1, not exactly 1) so a swapped or transposed
    mapping changes the logits. A tokenizer_config.json rides along to test side files.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = tiny_config(kind, **overrides)
    cfg.pop("architectures")
    cls_cfg, cls_model = ((Qwen3Config, Qwen3ForCausalLM) if kind == "dense"
                          else (Qwen3MoeConfig, Qwen3MoeForCausalLM))
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**cfg)).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out_dir)
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return out_dir


def hf_logits(hf_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the saved HF model (loaded back from disk with transformers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def tokens(batch: int = 2, seq: int = 8, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    """Deterministic token ids ``[batch, seq]``."""
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def read_safetensors_dir(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` shards in ``out``."""
    from safetensors import safe_open

    tensors = {}
    for f in sorted(Path(out).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    return tensors
