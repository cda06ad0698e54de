"""A minimal rollout engine for the driver tests (NOT product code).

A transformers Qwen3(-MoE) model whose weights come from the packed stream through
``spec.unpack`` / ``spec.dequantize`` (quant.hf_reference), activation fake-quant for W8A8,
and plain (no KV cache) ancestral sampling seeded by ``SamplingParams.seed``.
"""

from __future__ import annotations

import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.hf_reference import (
    attach_activation_quant,
    hf_tensor_names,
    load_packed_weights,
)
from megatron_qrl.rollout.base import GenerationOutput, RolloutEngine, tensor_checksum


class TinyEngine(RolloutEngine):
    def __init__(self, hf_config: dict, spec_name: str, seed: int = 0) -> None:
        import transformers

        arch = hf_config["architectures"][0]
        cfg_cls = transformers.Qwen3MoeConfig if "Moe" in arch else transformers.Qwen3Config
        model_cls = getattr(transformers, arch)
        kwargs = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
        torch.manual_seed(seed)
        self.model = model_cls(cfg_cls(**kwargs)).eval()
        self.spec = get_spec(spec_name)
        attach_activation_quant(self.model, self.spec)
        self.names = hf_tensor_names(self.model)
        self.held: dict[str, str] = {}
        self.version = -1

    def update_weights(self, named_tensors, version: int) -> None:
        packed = {}
        for name, t in named_tensors:
            packed[name] = t.clone()
            self.held[name] = tensor_checksum(t)
        load_packed_weights(self.model, self.spec, packed, self.names)
        self.version = version

    def held_checksums(self) -> dict[str, str]:
        return dict(self.held)

    def weight_version(self) -> int:
        return self.version

    @torch.no_grad()
    def generate(self, prompts, sampling) -> GenerationOutput:
        gen = torch.Generator().manual_seed(int(sampling.seed or 0))
        b, t_max = len(prompts), sampling.max_new_tokens
        out_ids = torch.zeros(b, t_max, dtype=torch.long)
        lps = torch.zeros(b, t_max)
        mask = torch.zeros(b, t_max, dtype=torch.bool)
        reasons = ["length"] * b
        for i, p in enumerate(prompts):
            seq = list(p)
            for t in range(t_max):
                logits = self.model(torch.tensor([seq])).logits[0, -1].float()
                logp = torch.log_softmax(logits / sampling.temperature, -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                out_ids[i, t], lps[i, t], mask[i, t] = tok, logp[tok], True
                seq.append(tok)
                if tok in sampling.stop_token_ids:
                    reasons[i] = "stop"
                    break
        return GenerationOutput([list(p) for p in prompts], out_ids, lps, mask, reasons,
                                self.version)


def tiny_engine_factory(rollout_cfg, hf_config, seed):
    return TinyEngine(hf_config, rollout_cfg.format, seed)
